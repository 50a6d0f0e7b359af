"""`adopter rewrite` (placeholder until implemented)."""

HELP = "rewrite (not implemented yet)"


def add_arguments(parser):
    pass


def run(args):
    from adopter.cli import UserError

    raise UserError("not implemented yet")

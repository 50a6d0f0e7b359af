"""`adopter verify` (placeholder until implemented)."""

HELP = "verify (not implemented yet)"


def add_arguments(parser):
    pass


def run(args):
    from adopter.cli import UserError

    raise UserError("not implemented yet")

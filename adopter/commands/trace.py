"""`adopter trace` (placeholder until implemented)."""

HELP = "trace (not implemented yet)"


def add_arguments(parser):
    pass


def run(args):
    from adopter.cli import UserError

    raise UserError("not implemented yet")

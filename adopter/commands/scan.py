"""`adopter scan` (placeholder until implemented)."""

HELP = "scan (not implemented yet)"


def add_arguments(parser):
    pass


def run(args):
    from adopter.cli import UserError

    raise UserError("not implemented yet")

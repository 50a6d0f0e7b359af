"""`adopter rules` (placeholder until implemented)."""

HELP = "rules (not implemented yet)"


def add_arguments(parser):
    pass


def run(args):
    from adopter.cli import UserError

    raise UserError("not implemented yet")

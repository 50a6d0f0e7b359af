"""CLI sub-commands; see :mod:`adopter.cli`. Command modules must import heavy
dependencies (torch, transformers) inside ``run`` only."""

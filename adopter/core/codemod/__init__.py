"""Edit planning: a matched site in the source -> an :class:`~adopter.core.codemod.edits.Edit`.

Pure ``ast`` analysis (``context.FileContext``), the edit dataclasses (``edits``), shared
codemod helpers (``base``) and synthesis from a rule's DSL target (``generic``). Applying an
edit to a concrete syntax tree is :mod:`adopter.rewrite`'s job.
"""

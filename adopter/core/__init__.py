"""The analysis core: DSL, extraction, structures, matching, rules, edit planning.

Source text in, plain dataclasses out (``FileStructures`` -> ``Match`` -> ``Edit``). Nothing
here imports ``adopter.tracing``, ``adopter.rewrite``, ``adopter.kernels`` or the orchestration
modules above them, and nothing here imports or runs the code it analyses
(``tests/analysis/test_layers.py`` walks the imports and fails on an upward one).
"""

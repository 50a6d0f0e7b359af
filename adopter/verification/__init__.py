"""``adopter verify``: equivalence of an optimized model with its original (``equivalence.py``),
the training-step benchmark (``benchmark.py``), report, plot and regression gate (``gate.py``),
and the run that ties them together (``run.py``)."""

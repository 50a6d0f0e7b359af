"""``optimize(model_cls)``: scan, trace, rewrite and load a model class, proven equivalent
(``optimize.py``); the instance it analyses (``subject.py``); the second check on a flipped
configuration (``config_flip.py``)."""

"""Adopter: find where optimized kernels fit in PyTorch model source, rewrite it, prove it."""

from adopter.errors import AdopterWarning, OptimizeError, UserError

__version__ = "0.1.0"
__all__ = ["AdopterWarning", "OptimizeError", "UserError", "optimize"]


def __getattr__(name):
    # Lazy so that `import adopter` (and `adopter scan`) never imports torch.
    if name == "optimize":
        from adopter.optimizing.optimize import optimize

        return optimize
    raise AttributeError(name)

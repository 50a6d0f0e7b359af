"""What each optional extra brings, and the one-line error when a feature needs one that is not
installed. The base install (``pip install adopter``) is torch plus fissix and bowler: scanning,
rewriting, ``optimize()`` of any ``nn.Module`` class and the runtime ``adopter.kernels``.
Stdlib only: every layer may ask."""

from __future__ import annotations

from types import ModuleType

# extra -> what it is for (its packages are in setup.cfg's [options.extras_require])
EXTRAS = {
    "hf": "models built from HuggingFace configs (shipped ids such as bert-base-uncased, config directories)",
    "verify": "adopter verify: the pytest-benchmark training-step benchmark and its plot",
    "gpu": "triton and xformers kernels on CUDA",
    "dev": "the project's own tests and tools",
}


class MissingExtra(ImportError):
    """A feature needs a package of an extra that is not installed (one line, with the fix)."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """``import module``, or :class:`MissingExtra` naming the ``pip install`` that brings it."""
    try:
        # the import statement's machinery (builtins.__import__), as a plain ``import`` would
        return __import__(module, fromlist=["__name__"])
    except ImportError:
        root = module.split(".")[0]
        raise MissingExtra(
            f"{feature} needs {root}, which is not installed: pip install 'adopter[{extra}]'"
        ) from None

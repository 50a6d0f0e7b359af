"""Where each ``nn.Sequential`` of a model was built: the runtime side of Sequential pairs.

A pair of Sequential entries is matched where the Sequential is built (a factory, a
``_make_layer``), not where it is called, so confirming it needs the instances built at that
place. While adopter instantiates a model (:func:`recording_build_sites`), every
``nn.Sequential.__init__`` (subclasses included) notes the file and line of the code that called
it on the instance; :func:`built_at` finds the instances of one build site afterwards.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from torch import nn

BUILT_AT = _ATTR = "_adopter_built_at"
_LOCK = threading.Lock()
_DEPTH = [0]
_ORIGINAL_INIT = nn.Sequential.__init__


def _recording_init(self, *args, **kwargs):
    _ORIGINAL_INIT(self, *args, **kwargs)
    caller = sys._getframe(1)
    # plain attribute (not a submodule, parameter or buffer): the state dict does not change
    object.__setattr__(self, _ATTR, (os.path.realpath(caller.f_code.co_filename), caller.f_lineno))


@contextlib.contextmanager
def recording_build_sites() -> Iterator[None]:
    """Note the build site of every ``nn.Sequential`` constructed inside the block (re-entrant)."""
    with _LOCK:
        _DEPTH[0] += 1
        if _DEPTH[0] == 1:
            nn.Sequential.__init__ = _recording_init
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                nn.Sequential.__init__ = _ORIGINAL_INIT


def built_at(model: nn.Module, file: str, first_line: int, last_line: int) -> list[tuple[str, nn.Module]]:
    """(module path, Sequential) of the Sequentials of ``model`` built by the call spanning
    ``first_line``..``last_line`` of ``file`` (real path)."""
    out = []
    for path, module in model.named_modules():
        site = module.__dict__.get(_ATTR)
        if site is not None and site[0] == file and first_line <= site[1] <= last_line:
            out.append((path, module))
    return out


def recorded(model: nn.Module) -> bool:
    """Whether ``model`` was built while recording (some Sequential of it carries its site)."""
    return any(_ATTR in m.__dict__ for m in model.modules() if isinstance(m, nn.Sequential))

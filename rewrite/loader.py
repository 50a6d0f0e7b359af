"""Import rewritten source in memory, in the original module's package context.

``load_rewritten_module(transformers.models.bert.modeling_bert, new_text)`` executes the
text as module ``transformers.models.bert._adopter_rewritten_modeling_bert_<hash>``
with ``__package__`` set, so ``from ...utils import x`` and ``from .configuration_bert
import BertConfig`` resolve exactly as in the original. The source is registered with
:mod:`linecache` so tracebacks and ``inspect.getsource`` show the rewritten code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import linecache
import sys
import types

__all__ = ["load_rewritten_module", "rewritten_module_name"]


def rewritten_module_name(original: types.ModuleType, new_text: str) -> str:
    package = original.__package__ or ""
    base = original.__name__.rsplit(".", 1)[-1]
    digest = hashlib.sha1(new_text.encode("utf-8")).hexdigest()[:10]
    name = f"_adopter_rewritten_{base}_{digest}"
    return f"{package}.{name}" if package else name


def load_rewritten_module(original: types.ModuleType, new_text: str, *, register: bool = True) -> types.ModuleType:
    """Execute ``new_text`` as a sibling of ``original`` and return the new module.

    The module is put in ``sys.modules`` (``register``) because transformers and
    dataclasses look classes' modules up there. Loading the same text twice returns the
    module already loaded. Raises what executing the module raises (``SyntaxError``,
    ``ImportError``...)."""
    name = rewritten_module_name(original, new_text)
    if register and name in sys.modules:
        return sys.modules[name]
    origin = getattr(original, "__file__", None) or original.__name__
    filename = f"{origin}<adopter-rewritten {name.rsplit('.', 1)[-1]}>"
    spec = importlib.util.spec_from_loader(name, loader=None, origin=filename)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = filename
    module.__package__ = original.__package__
    lines = new_text.splitlines(keepends=True)
    linecache.cache[filename] = (len(new_text), None, lines, filename)
    code = compile(new_text, filename, "exec", dont_inherit=True)
    if register:
        sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        if register:
            sys.modules.pop(name, None)
        raise
    return module

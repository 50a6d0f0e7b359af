"""Keep the state-dict keys of the layers a fused module replaced.

A fused module that replaces *sibling* layers (QKV replaces ``query``/``key``/``value``; Conv+BN
keeps the conv's name but absorbs the BN sibling) must save and load its tensors under the keys of
its *parent*: ``<parent>.query.weight``, ``<parent>.<bn_name>.running_mean``, ...

* Saving: a state-dict post hook on the fused module moves its keys to the parent-level names
  (the parent prefix is the module's own prefix minus its last component).
* Loading: ``Module.load_state_dict`` hands each child only the keys under the child's own prefix,
  and the parent reports sibling keys it does not own as unexpected before the child sees anything.
  So the remapping has to run in the *parent's* load pre-hook. A global module-registration hook
  installs that pre-hook on any module that gets a fused child (once per parent; it looks the
  children up at load time, so deep copies and pickles stay correct). The fused module also has
  its own pre-hook, which does the same job when it is itself the root of ``load_state_dict``.
* Loaders that bypass ``load_state_dict`` (transformers' ``from_pretrained`` resolves each key with
  ``get_submodule(path)`` and assigns the tensor with ``setattr``): the same registration hook puts
  *unregistered* views under the original sibling names in the parent's ``__dict__`` (e.g.
  ``parent.query``, ``parent.batch_norm``), so those paths resolve. Views are not in ``_modules``:
  no duplicate parameters, state-dict keys or ``modules()`` entries.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

_PARENT_HOOK_FLAG = "_adopter_parent_key_hook"
_PARENT_VIEWS = "_adopter_parent_views"  # names of the views we installed in a parent's __dict__


class ParentKeyRemap:
    """Mixin for fused modules whose state-dict keys live at the parent level."""

    def _export_to_parent(self, state_dict: dict[str, torch.Tensor], prefix: str, parent_prefix: str) -> None:
        raise NotImplementedError

    def _parent_views(self) -> dict[str, nn.Module]:
        """Modules to expose (unregistered) under the replaced siblings' names in the parent."""
        return {}

    def _import_from_parent(
        self, state_dict: dict[str, torch.Tensor], prefix: str, parent_prefix: str, missing_keys: list[str]
    ) -> None:
        """Move parent-level keys to this module's own keys; report absent parent-level keys (by
        their original names) in ``missing_keys``."""
        raise NotImplementedError


def parent_prefix_of(prefix: str) -> str:
    """``"encoder.layer.0.attn.qkv."`` -> ``"encoder.layer.0.attn."``; a root module (``""``) -> ``""``."""
    if not prefix:
        return ""
    head, _, _ = prefix[:-1].rpartition(".")
    return head + "." if head else ""


def _save_hook(module, state_dict, prefix, local_metadata) -> None:
    module._export_to_parent(state_dict, prefix, parent_prefix_of(prefix))


def _own_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    module._import_from_parent(state_dict, prefix, parent_prefix_of(prefix), missing)


def _parent_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    for name, child in module._modules.items():
        if isinstance(child, ParentKeyRemap):
            child._import_from_parent(state_dict, prefix + name + ".", prefix, missing)


def install_hooks(module: nn.Module) -> None:
    """Called by a fused module's ``__init__``."""
    module.register_state_dict_post_hook(_save_hook)
    module._register_load_state_dict_pre_hook(_own_load_pre_hook, with_module=True)


def ensure_parent_hook(parent: nn.Module) -> None:
    """Install the parent-level load pre-hook (idempotent). Done automatically on assignment."""
    if not parent.__dict__.get(_PARENT_HOOK_FLAG, False):
        parent._register_load_state_dict_pre_hook(_parent_load_pre_hook, with_module=True)
        parent.__dict__[_PARENT_HOOK_FLAG] = True


def install_parent_views(parent: nn.Module, child: ParentKeyRemap) -> None:
    """Expose ``child._parent_views()`` as plain attributes of ``parent`` (never over a real member)."""
    ours = parent.__dict__.setdefault(_PARENT_VIEWS, set())
    for attr, view in child._parent_views().items():
        taken = attr in parent._modules or attr in parent._parameters or attr in parent._buffers
        if taken or (attr in parent.__dict__ and attr not in ours):
            continue
        parent.__dict__[attr] = view
        ours.add(attr)


def _on_module_registration(parent: nn.Module, name: str, child) -> None:
    if isinstance(child, ParentKeyRemap):
        ensure_parent_hook(parent)
        install_parent_views(parent, child)


_registration_handle = register_module_module_registration_hook(_on_module_registration)


def move_keys(state_dict: dict[str, torch.Tensor], src_prefix: str, dst_prefix: str, keys) -> None:
    """Rename ``src_prefix + k`` to ``dst_prefix + k`` for the given local keys that are present."""
    for key in keys:
        if src_prefix + key in state_dict:
            state_dict[dst_prefix + key] = state_dict.pop(src_prefix + key)

"""Small copies of model configs: what ``optimize()`` analyses when the user gives no config.

``shrink_config(config)`` returns a copy of a transformers config whose sizes are small enough
that building, tracing and checking the model takes about a second, while every code path of the
full-size model stays: each kind of layer, heads dividing the hidden size, grouped-query heads,
experts routed top-k, low-rank (MLA) attention, partial rotary dimensions. It is rules over field
names and the relationships the full-size values hold, not a table per family:

* **sizes** — widths (``hidden_size``, ``d_model``...), heads, head dims, FFN/expert sizes
  (anything ``*intermediate_size``/``*ffn_*``), low-rank sizes (``*_lora_rank``, ``*_head_dim``),
  expert counts (``*experts``) and top-k (``*_per_tok``, ``*topk*``, groups), vocabularies
  (``*vocab*``; token ids beyond the new vocabulary move into ``[1000, vocab)``, ids the generated
  inputs never draw), each capped (never raised);
* **relationships** — size fields equal in the full config stay equal; a size field that is a
  multiple (or a power-of-two fraction) of the hidden size stays that multiple; a heads count
  times a head dim that equals another size (``num_heads * head_dim == expand * hidden_size``)
  still does; a partial rotary factor still gives an even rotary dimension; grouped-query
  attention keeps grouping;
* **layers** — the new layer count is the fewest layers that keep one layer of each kind: per-layer
  lists (``layer_types``, ``mlp_layer_types``, any list as long as the layer count) keep the first
  layer of each distinct value, lists of layer indices (``mlp_only_layers``, ``*_layer_ids``) one
  listed and one unlisted layer, layer thresholds (``first_k_dense_replace``,
  ``num_dense_layers``, ``max_window_layers``; ``*shared*`` ones count from the end) a layer on
  each side, periodic layouts (``*_period`` + ``*_offset``, ``*_interval``, ``*every_n*``) a
  whole period; per-layer configs (``per_layer_config``) follow their layers;
* **derived values** — a transformers config is a dataclass whose ``__post_init__`` derives
  values (``head_dim``, ``qk_head_dim``, ``layer_types``...): the copy is built again from the
  shrunk fields it was given, so the config derives them from the small sizes itself; a field
  the defaults leave ``None`` that the model cannot do without (``head_dim``,
  ``num_key_value_heads``, the expert counts of a mixture-of-experts config, ``layer_types``) is
  filled with its usual meaning;
* sub-configs (``text_config``, ``attn_config``...) are shrunk the same way.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from typing import Any

__all__ = ["SHRINK_LIMITS", "shrink_config", "shrunk_fields"]

# Upper bounds of the sizes a shrunk config gets (a smaller value is kept).
_SHRINK_SCALARS = {
    "num_hidden_layers": 2, "num_layers": 2, "num_decoder_layers": 2, "n_layer": 2,
    "encoder_layers": 2, "decoder_layers": 2, "n_layers": 2,
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "d_ff": 128, "hidden_dim": 128, "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128, "ffn_dim": 128,
    "num_attention_heads": 4, "num_heads": 4, "n_head": 4, "n_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "d_kv": 16, "head_dim": 16, "embedding_size": 32,
}  # fmt: skip
SHRINK_LIMITS = {
    "vocab": 1024,  # token ids the generated inputs draw stay below 1000
    "experts": 4,
    "experts_per_token": 2,
    "expert_size": 64,  # moe_intermediate_size and the like
    "lora_rank": 32,
    "head_dim": 16,
    "ffn": 128,
}
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "decoder_layers")
# Keys that a stage-based config (list ``depths`` / ``hidden_sizes``) derives from its stages.
_STAGE_DERIVED = frozenset({
    "num_hidden_layers", "num_layers", "n_layers", "hidden_size", "embed_dim", "dim",
    "num_attention_heads", "num_heads",
})  # fmt: skip
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim")
_HEADS_KEYS = ("num_attention_heads", "num_heads", "n_head", "n_heads")

# A "size" field by its name: widths, dims, ranks, heads, expert counts.
_SIZE_NAME = re.compile(r"size|dim|rank|hidden|embd|d_model|d_ff|d_kv|width|heads|channels|ffn|experts|_d_|d_state")
# ... unless the name says it is something else (positions, windows, ids, layer counts, images, audio).
_NOT_SIZE = re.compile(
    r"vocab|token|position|window|chunk|max_|cache|seq|length|bucket|distance|image|patch|sample|rate|ctx|seed"
    r"|layer|bins|frame|hop|stride|kernel|_id$|_ids$|_idx|group|batch|conv|factor|multiple|mult|scale|ratio|prob"
    r"|eps|std|range|init|dropout|theta|bias|norm|block"
)
_EXPERT_GROUPS = re.compile(r"^n_group$|expert_group$|^num_groups_experts$")
_STATE_SIZE = re.compile(r"state_size$|d_state$")
_HEADS = re.compile(r"heads$|groups$")
# the part of a heads/groups field name that says which attention it counts for
_HEADS_ROLE = re.compile(r"(num_|n_)?(attention_|key_value_|kv_|key_|value_|query_|q_)?(heads|groups)$")
_EXPERTS_PER_TOKEN = re.compile(r"experts_per_tok|moe_topk|^top_k_experts$|^num_selected_experts$|^moe_k$")
_SHARED_EXPERTS = re.compile(r"shared_experts$")
_EXPERT_SIZE = re.compile(r"(moe|expert|shared)\w*_(intermediate_size|ffn_hidden_size|hidden_size)$"
                          r"|^expert_ffn_hidden_size$")
_FFN_SIZE = re.compile(r"intermediate_size$|ffn_hidden_size$|_ffn_dim$|^dim_ff$|^dff$|^d_ff$")
_LORA_RANK = re.compile(r"lora_rank$|^adapter_rank$")
_HEAD_DIM = re.compile(r"head_dim$|^d_head$|_d_head$|headdim$|^kv_channels$")
_ROTARY_DIM = re.compile(r"^(rotary_dim|rotary_emb_dim|rope_dim)$")
_TOKEN_ID = re.compile(r"token_(id|ids|index)$|^(pad|bos|eos|sep|cls|unk|mask)_id$")
_VOCAB = re.compile(r"vocab")
# layer structure
_INDEX_LIST = re.compile(r"layers$|layer_ids$|_idxs?$|indices$|_ids$")
_PERIOD = re.compile(r"period$|interval$|every_n|_step$|_freq$|^interleave")
_THRESHOLD = re.compile(r"first_k|dense_layers$|window_layers$|shared_layers$|start_index$|end_index$")


def _is_expert_count(key: str) -> bool:
    """``num_experts``, ``n_routed_experts``, ``num_local_experts``... (not shared experts, not top-k)."""
    if _SHARED_EXPERTS.search(key) or _EXPERTS_PER_TOKEN.search(key) or key.startswith("zero"):
        return False
    return key.endswith("experts") or key in ("moe_num_experts", "n_experts")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_config(value: Any) -> bool:
    return hasattr(value, "to_dict") and not isinstance(value, type) and hasattr(value, "__dict__")


def _values(config) -> dict[str, Any]:
    """The config's attributes (public ones, and heterogeneous-config state it keeps privately)."""
    out = {}
    for key, value in vars(config).items():
        if key.startswith("_"):
            continue
        out[key] = value
    return out


# ---------------------------------------------------------------- layer plan


def _layer_count(values: dict) -> tuple[str | None, int]:
    for key in _LAYER_COUNTS:
        value = values.get(key)
        if _is_int(value) and value > 0:
            return key, value
    return None, 0


def _is_index_list(key: str, value: Any, layers: int) -> bool:
    return (
        isinstance(value, (list, tuple)) and bool(value) and bool(_INDEX_LIST.search(key))
        and all(_is_int(v) and 0 <= v < layers for v in value) and len(set(value)) == len(value)
    )  # fmt: skip


def _is_per_layer(key: str, value: Any, layers: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == layers and layers > 1 and not _is_index_list(
        key, value, layers
    )


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _layer_plan(values: dict, layers: int, target: int, per_layer_config: dict | None) -> list[int]:
    """The indices of the layers the small config keeps (see the module docstring)."""
    reps: set[int] = set()
    prefix = min(layers, target)
    for key, value in values.items():
        if _is_index_list(key, value, layers):
            listed = sorted(value)
            reps.add(listed[0])
            unlisted = next((i for i in range(layers) if i not in value), None)
            if unlisted is not None:
                reps.add(unlisted)
        elif _is_per_layer(key, value, layers):
            # two layers of each kind: layers of a kind may share weights (Zamba's shared block)
            seen: dict = {}
            for i, v in enumerate(value):
                kind = seen.setdefault(_hashable(v), [])
                if len(kind) < 2:
                    kind.append(i)
            reps.update(i for kind in seen.values() for i in kind)
        elif _is_int(value) and 0 < value < layers and _THRESHOLD.search(key):
            edge = layers - value if "shared" in key else value
            reps.update({edge - 1, edge})
        elif _is_int(value) and 1 < value <= layers and _PERIOD.search(key):
            offset_key = key.rsplit("_", 1)[0] + "_offset"
            offset = values.get(offset_key)
            need = max(value, offset + 1 if _is_int(offset) else 0)
            prefix = max(prefix, min(layers, need))
    if per_layer_config:
        first = {}
        for index in sorted(per_layer_config):
            first.setdefault(_hashable(tuple(sorted(per_layer_config[index].items()))), index)
        reps.update(first.values())
        reps.add(next((i for i in range(layers) if i not in per_layer_config), 0))
    chosen = sorted({i for i in reps if 0 <= i < layers} | set(range(prefix)))
    return chosen


def _remap_layers(values: dict, layers: int, kept: list[int]) -> dict:
    """New values of the per-layer fields for the layers ``kept``."""
    out: dict[str, Any] = {}
    position = {old: new for new, old in enumerate(kept)}
    for key, value in values.items():
        if _is_index_list(key, value, layers):
            out[key] = type(value)(position[v] for v in value if v in position)
        elif _is_per_layer(key, value, layers):
            out[key] = type(value)(_shrink_scalar(key, value[i]) for i in kept)
        elif _is_int(value) and 0 < value < layers and _THRESHOLD.search(key):
            if "shared" in key:
                out[key] = sum(1 for i in kept if i >= layers - value)
            else:
                out[key] = sum(1 for i in kept if i < value)
    return out


# ---------------------------------------------------------------- sizes


def _shrink_scalar(key: str, value: Any) -> Any:
    """The capped value of one size field by its name alone (no relationships)."""
    if not _is_int(value) or value <= 0:
        return value
    cap = None
    if key in _SHRINK_SCALARS:
        cap = _SHRINK_SCALARS[key]
    elif _EXPERTS_PER_TOKEN.search(key):
        cap = SHRINK_LIMITS["experts_per_token"]
    elif _is_expert_count(key):
        cap = SHRINK_LIMITS["experts"]
    elif _SHARED_EXPERTS.search(key):
        cap = 1
    elif _EXPERT_SIZE.search(key):
        cap = SHRINK_LIMITS["expert_size"]
    elif _FFN_SIZE.search(key):
        cap = SHRINK_LIMITS["ffn"]
    elif _LORA_RANK.search(key):
        cap = SHRINK_LIMITS["lora_rank"]
    elif _HEAD_DIM.search(key) and not _NOT_SIZE.search(key.replace("head_dim", "")):
        cap = SHRINK_LIMITS["head_dim"]
    elif key.endswith("heads"):
        cap = _SHRINK_SCALARS["num_attention_heads"]
    elif _STATE_SIZE.search(key):
        cap = 16
    elif _VOCAB.search(key):
        cap = SHRINK_LIMITS["vocab"]
    return min(value, cap) if cap is not None else value


def _is_size(key: str) -> bool:
    return bool(_SIZE_NAME.search(key)) and not _NOT_SIZE.search(key) or bool(_HEAD_DIM.search(key))


def _first(values: dict, keys) -> str | None:
    return next((k for k in keys if _is_int(values.get(k)) and values[k] > 0), None)


def _partial_rotary_factor(values: dict) -> float | None:
    factor = values.get("partial_rotary_factor")
    rope = values.get("rope_parameters") or values.get("rope_scaling")
    if not isinstance(factor, float) and isinstance(rope, dict):
        factor = rope.get("partial_rotary_factor")
        if factor is None:  # per layer type: {"full_attention": {...}, "sliding_attention": {...}}
            factors = [v.get("partial_rotary_factor") for v in rope.values() if isinstance(v, dict)]
            factors = [f for f in factors if isinstance(f, float)]
            factor = min(factors) if factors else None
    return factor if isinstance(factor, float) and 0 < factor < 1 else None


def _rotary_head_dim(target: int, factor: float, original: int) -> int:
    """The smallest head dim >= ``target`` whose rotary part (``int(dim * factor)``) is even, at
    least 2, and as exact as in the full-size config."""
    slack = original * factor - int(original * factor)
    for dim in range(target, 8 * target + 1, 2):
        rotary = dim * factor
        if int(rotary) >= 2 and int(rotary) % 2 == 0 and rotary - int(rotary) <= slack + 1e-6:
            return dim
    return target


def _head_groups(values: dict, new: dict) -> dict[str, int]:
    """Heads and groups counting for the same attention (``num_attention_heads`` and
    ``num_key_value_heads``; ``linear_num_value_heads`` and ``linear_num_key_heads``; ``num_heads``
    and ``n_groups``): the largest is capped, the others keep dividing it by the same ratio
    (grouped-query attention keeps grouping)."""
    roles: dict[str, list[str]] = {}
    for key, value in values.items():
        if _is_int(value) and value > 0 and _HEADS.search(key) and not _EXPERT_GROUPS.search(key) \
                and "expert" not in key:
            roles.setdefault(_HEADS_ROLE.sub("", key), []).append(key)
    out: dict[str, int] = {}
    for keys in roles.values():
        if len(keys) < 2:
            continue
        top = max(keys, key=lambda k: values[k])
        small_top = new.get(top, values[top])
        for key in keys:
            value = values[key]
            if key == top or values[top] % value:
                continue
            count = max(1, small_top * value // values[top])
            while small_top % count:
                count -= 1
            out[key] = count
    return out


def _sizes(values: dict, staged: bool, efficientnet: bool) -> dict[str, Any]:
    """New values of the size fields (the module docstring's *sizes* and *relationships*)."""
    new: dict[str, Any] = {}
    for key, value in values.items():
        if staged and key in _STAGE_DERIVED:
            # In stage-based models (Swin, ConvNext) these are the stage count or derived from
            # the per-stage lists (ConvNext's num_hidden_layers is num_stages; Swin's hidden_size
            # is embed_dim * 2**(stages-1), its per-stage heads must divide embed_dim * 2**i):
            # shrinking them alone breaks the model. Depths and widths are shrunk below instead.
            continue
        if key == "hidden_dim" and efficientnet:
            # EfficientNet-style configs: hidden_dim is the final width, derived from the
            # per-block channels and the width coefficient, not an FFN size.
            continue
        if key in _LAYER_COUNTS or key == "n_inner":
            continue
        small = _shrink_scalar(key, value)
        # identity first: values that are not sizes (a heterogeneous config's per-layer
        # configs) may not even compare
        if small is not value and small != value:
            new[key] = small
    hidden_key = _first(values, _HIDDEN_KEYS)
    heads_key = _first(values, _HEADS_KEYS)
    if staged:
        return new
    new.update(_head_groups(values, new))
    # equal sizes stay equal; multiples (or power-of-two fractions) of the hidden size stay so
    hidden = values.get(hidden_key) if hidden_key else None
    small_hidden = new.get(hidden_key, hidden) if hidden_key else None
    for key, value in values.items():
        if key in new or not _is_int(value) or value <= 1 or not _is_size(key) or key in _LAYER_COUNTS:
            continue
        if staged and key in _STAGE_DERIVED:
            continue
        twin = next((k for k, v in values.items() if k in new and k != key and v == value and _is_size(k)), None)
        if twin is not None and twin not in _HEADS_KEYS and key not in _HEADS_KEYS:
            new[key] = new[twin]
        elif hidden and small_hidden and value != hidden:
            if value % hidden == 0 and value // hidden <= 8:
                new[key] = small_hidden * (value // hidden)
            elif hidden % value == 0 and (hidden // value) & (hidden // value - 1) == 0 and hidden // value <= 64:
                new[key] = max(1, small_hidden // (hidden // value))
    # a head dim that is the sum of two others (MLA: qk_head_dim = qk_nope_head_dim + qk_rope_head_dim) still is
    dims = {k: v for k, v in values.items() if _is_int(v) and v > 0 and _HEAD_DIM.search(k)}
    sums = set()
    for key, value in dims.items():
        parts = [(a, b) for a in dims for b in dims if a < b and key not in (a, b) and dims[a] + dims[b] == value]
        if parts:
            a, b = parts[0]
            new[key] = new.get(a, dims[a]) + new.get(b, dims[b])
            sums.add(key)
    # a partial rotary factor gives an even rotary dimension, as it did at full size
    factor = _partial_rotary_factor(values)
    head_dim = values.get("head_dim")
    if factor and _is_int(head_dim) and "head_dim" in new:
        new["head_dim"] = _rotary_head_dim(new["head_dim"], factor, head_dim)
    # explicit rotary dims keep their share of the head
    full_head = head_dim if _is_int(head_dim) else (hidden // values[heads_key] if hidden and heads_key else None)
    small_head = new.get("head_dim", head_dim) if _is_int(head_dim) else (
        small_hidden // new.get(heads_key, values[heads_key]) if small_hidden and heads_key else None)
    for key, value in values.items():
        if _ROTARY_DIM.match(key) and _is_int(value) and full_head and small_head and value <= full_head:
            rotary = max(2, int(small_head * value / full_head) // 2 * 2)
            new[key] = min(rotary, small_head)
    # a heads count times a head dim equal to another size (or to expand * hidden) still is
    sizes = {k: v for k, v in values.items() if _is_int(v) and v > 0}
    expand_key = next((k for k in ("expand", "mamba_expand") if _is_int(values.get(k))), None)
    for dim_key, dim in sizes.items():
        if not _HEAD_DIM.search(dim_key) or dim_key in sums or dim_key in ("qk_rope_head_dim", "qk_nope_head_dim"):
            continue
        prefix = dim_key.split("_")[0]
        for h_key, h in sizes.items():
            if h_key == dim_key or not (h_key.endswith("heads") or h_key in ("num_query_groups",)):
                continue
            if h_key.startswith(("num_key_value", "num_kv", "n_kv")):
                continue
            product = h * dim
            targets = {k: (v, new.get(k, v)) for k, v in sizes.items() if _is_size(k) and k not in (h_key, dim_key)}
            if expand_key and hidden_key:
                targets[f"{expand_key}*{hidden_key}"] = (values[expand_key] * hidden,
                                                          new.get(expand_key, values[expand_key]) * small_hidden)
            match = [k for k, (v, _) in targets.items() if v == product and (k.startswith(prefix) or "*" in k
                                                                              or k in _HIDDEN_KEYS)]
            if not match:
                continue
            small_target = targets[match[0]][1]
            small_h = new.get(h_key, h)
            if small_target % small_h == 0:
                new[dim_key] = small_target // small_h
            break
    return new


# ---------------------------------------------------------------- vocabulary and token ids


def _token_ids(values: dict, old_vocab: int, new_vocab: int, base: int) -> tuple[dict, int]:
    """Token ids at or beyond the new vocabulary moved to distinct ids in ``[base, vocab)``;
    returns (new values, the vocabulary they need)."""
    high: dict[int, int] = {}
    for key, value in values.items():
        if not _TOKEN_ID.search(key):
            continue
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if _is_int(v) and v >= new_vocab and v not in high:
                high[v] = len(high)
    vocab = max(new_vocab, base + len(high)) if high else new_vocab
    vocab = min(vocab, old_vocab)
    moved = {old: vocab - 1 - i for old, i in high.items()}
    out = {}
    for key, value in values.items():
        if not _TOKEN_ID.search(key):
            continue
        if _is_int(value) and value in moved:
            out[key] = moved[value]
        elif isinstance(value, (list, tuple)) and any(_is_int(v) and v in moved for v in value):
            out[key] = type(value)(moved.get(v, v) if _is_int(v) else v for v in value)
    return out, vocab


# ---------------------------------------------------------------- the whole config


def _derived_fields(cls) -> set[str]:
    """Dataclass fields of a config class whose default instance holds something else than the
    declared default: values ``__post_init__`` derives (``head_dim`` from the hidden size...)."""
    if not dataclasses.is_dataclass(cls):
        return set()
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - a config class that needs arguments: nothing known derived
        return set()
    out = set()
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            declared = f.default
        elif f.default_factory is not dataclasses.MISSING:
            try:
                declared = f.default_factory()
            except Exception:  # noqa: BLE001
                continue
        else:
            continue
        try:
            current = default.__dict__.get(f.name, declared)
            if current != declared and not _is_config(current):
                out.add(f.name)
        except Exception:  # noqa: BLE001 - values that do not compare
            continue
    return out


def _per_layer_config(config) -> dict[int, dict] | None:
    spec = config.__dict__.get("_heterogeneity_spec")
    overrides = getattr(spec, "per_layer_overrides", None)
    if not overrides:
        return None
    return {int(k): dict(v) for k, v in overrides.items()}


def _moe_fills(values: dict) -> dict:
    """Expert counts a mixture-of-experts config leaves None (its model cannot be built so)."""
    expert_size = next((v for k, v in values.items() if _EXPERT_SIZE.search(k) and _is_int(v) and v > 0), None)
    if expert_size is None:
        return {}
    out = {}
    for key, value in values.items():
        if value is not None:
            continue
        if _EXPERTS_PER_TOKEN.search(key):
            out[key] = SHRINK_LIMITS["experts_per_token"]
        elif _is_expert_count(key):
            out[key] = SHRINK_LIMITS["experts"]
        elif _SHARED_EXPERTS.search(key):
            out[key] = 1
    return out


def _expert_groups(values: dict, new: dict) -> dict:
    """Expert groups that still divide the (fewer) experts; top-k no more than the experts."""
    experts = next((new.get(k, v) for k, v in values.items() if _is_expert_count(k) and _is_int(new.get(k, v))
                    and new.get(k, v) > 0), None)
    out = {}
    if experts is None:
        return out
    for key, group in values.items():
        if _EXPERT_GROUPS.search(key) and _is_int(group) and group > 1:
            out[key] = 2 if experts % 2 == 0 else 1
            if _is_int(values.get("topk_group")):
                out["topk_group"] = 1
    for key, value in values.items():
        if _EXPERTS_PER_TOKEN.search(key) and _is_int(new.get(key, value)) and new.get(key, value) > experts:
            out[key] = experts
    return out


def shrunk_fields(config, *, layer_kinds: bool = True) -> dict[str, Any]:
    """{field: small value} for ``config`` (top level; sub-configs are config objects).
    ``layer_kinds=False``: the first layers only (for defaults whose other layer kinds need
    values the default leaves unset)."""
    values = _values(config)
    new: dict[str, Any] = {}
    depths = values.get("depths")
    sizes = values.get("hidden_sizes")
    staged = any(isinstance(v, (list, tuple)) and v for v in (depths, sizes))
    efficientnet = isinstance(values.get("num_block_repeats"), (list, tuple))
    # layers
    count_key, layers = _layer_count(values)
    per_layer_config = _per_layer_config(config)
    if count_key and not staged:
        target = min(layers, _SHRINK_SCALARS.get(count_key, 2))
        kept = _layer_plan(values, layers, target, per_layer_config) if layer_kinds else list(range(target))
        if len(kept) < layers:
            new.update(_remap_layers(values, layers, kept))
            for key in _LAYER_COUNTS:
                if values.get(key) == layers:
                    new[key] = len(kept)
            if per_layer_config:
                position = {old: i for i, old in enumerate(kept)}
                new["per_layer_config"] = {
                    f"{position[i]:02d}": {k: _shrink_scalar(k, v) for k, v in o.items()}
                    for i, o in per_layer_config.items() if i in position
                }  # fmt: skip
        elif per_layer_config:
            new["per_layer_config"] = {f"{i:02d}": {k: _shrink_scalar(k, v) for k, v in o.items()}
                                       for i, o in per_layer_config.items()}
    elif staged:
        for key in ("encoder_layers", "decoder_layers", "num_decoder_layers"):
            if _is_int(values.get(key)) and values[key] > 2:
                new[key] = 2
    for key in ("encoder_layers", "decoder_layers", "num_decoder_layers", "num_blocks", "num_layers_per_stack"):
        value = values.get(key)
        if key not in new and _is_int(value) and value > 2:
            # another count of the same layers follows the layer count; others get 2
            new[key] = new.get(count_key, value) if count_key and value == layers else 2
    # sizes
    for key, value in _sizes(values, staged, efficientnet).items():
        new.setdefault(key, value)
    new.update(_moe_fills(values))
    new.update(_expert_groups(values, new))
    embedding = values.get("embedding_size")
    if _is_int(embedding) and embedding == values.get("hidden_size") and "hidden_size" in new:
        # Models that require embedding_size == hidden_size (SqueezeBERT) keep them equal;
        # factorised embeddings (ALBERT: 128 vs 768) shrink independently.
        new["embedding_size"] = new["hidden_size"]
    if values.get("n_inner"):
        new["n_inner"] = SHRINK_LIMITS["ffn"]
    # vocabulary and token ids
    vocab = values.get("vocab_size")
    if _is_int(vocab) and vocab > SHRINK_LIMITS["vocab"]:
        moved, small_vocab = _token_ids(values, vocab, SHRINK_LIMITS["vocab"], 1000)
        new.update(moved)
        new["vocab_size"] = small_vocab
    # stage-based vision configs
    if isinstance(depths, (list, tuple)) and depths:
        new["depths"] = [1] * len(depths)
    if isinstance(sizes, (list, tuple)) and sizes:
        new["hidden_sizes"] = [min(int(s), 32 * 2**i) for i, s in enumerate(sizes)]
    image_size = values.get("image_size")
    patch = values.get("patch_size")
    if _is_int(image_size) and _is_int(patch) and image_size > 4 * patch:
        target = 4 * patch
        if staged:
            # Every stage halves the resolution; windowed attention (Swin) needs each stage's
            # resolution to hold a whole window: keep the last stage at least one window wide.
            window = values.get("window_size")
            if _is_int(window) and window > 2:
                new["window_size"] = window = 2
            window = window if _is_int(window) else 1
            stages = len(depths if isinstance(depths, (list, tuple)) and depths else sizes)
            target = max(target, patch * window * 2 ** (stages - 1))
        new["image_size"] = min(image_size, target)
    elif _is_int(image_size) and patch is None and efficientnet:
        # EfficientNet: 600 px by default; its strides reduce by 32, so 64 px keeps every stage.
        new["image_size"] = min(image_size, 64)
    # sub-configs
    for key, value in values.items():
        if _is_config(value):
            new[key] = shrink_config(value, layer_kinds=layer_kinds)
    _sibling_widths(values, new)
    return new


_SIBLING_WIDTH = re.compile(r"^hidden_size_(\w+)$|^(\w+)_hidden_size$")


def _sibling_widths(values: dict, new: dict) -> None:
    """A sub-config's width named after a sibling sub-config (BLT: ``encoder_config.hidden_size_global``
    is ``global_config.hidden_size``) follows that sibling's small width, when they were equal."""
    subs = {k: v for k, v in values.items() if _is_config(v) and _is_config(new.get(k))}
    for key, sub in subs.items():
        for field, value in vars(sub).items():
            match = _SIBLING_WIDTH.match(field)
            if not match or not _is_int(value):
                continue
            sibling = f"{match.group(1) or match.group(2)}_config"
            if sibling not in subs or vars(subs[sibling]).get("hidden_size") != value:
                continue
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(new[key], field, vars(new[sibling])["hidden_size"])


def _rebuilt(config, new: dict):
    """``type(config)`` built again from its given fields with ``new`` (so ``__post_init__``
    derives what it derives from the small sizes), or None when that does not work."""
    cls = type(config)
    if not dataclasses.is_dataclass(cls):
        return None
    derived = _derived_fields(cls)
    default_values = None
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in config.__dict__:
            continue
        if f.name in derived and f.name not in new:
            if default_values is None:
                with contextlib.suppress(Exception):
                    default_values = cls().__dict__
            if default_values is not None and config.__dict__[f.name] == default_values.get(f.name):
                continue  # derived from the other fields: let the config derive it again
        kwargs[f.name] = config.__dict__[f.name]
    for key, value in new.items():
        if key in derived and key not in ("layer_types",) and not isinstance(value, (list, tuple, dict)):
            kwargs.pop(key, None)  # a derived size: derived again from the small ones
            continue
        kwargs[key] = value
    # attributes that are not fields: passed on only where they differ from a default instance's
    # (set by the user); the others are derived, and derived again
    names = {f.name for f in dataclasses.fields(cls)}
    extra = {k: v for k, v in _values(config).items() if k not in kwargs and k not in names and not _is_config(v)}
    if extra:
        if default_values is None:
            with contextlib.suppress(Exception):
                default_values = cls().__dict__
        for key, value in extra.items():
            with contextlib.suppress(Exception):
                if default_values is not None and key in default_values and default_values[key] == value:
                    continue
            kwargs[key] = copy.deepcopy(value)
    attn = config.__dict__.get("_attn_implementation_internal")
    if attn is not None:
        kwargs["attn_implementation"] = attn
    try:
        small = cls(**kwargs)
    except Exception:  # noqa: BLE001 - the class's own validation: fall back to setting fields
        return None
    return small


def _set_fields(config, new: dict):
    small = copy.deepcopy(config)
    for key, value in new.items():
        if key == "per_layer_config":
            with contextlib.suppress(Exception):
                small.per_layer_config = value
            continue
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            setattr(small, key, value)
    return small


def _fill_missing(small) -> None:
    """Values a default config leaves None that its model cannot do without."""
    values = small.__dict__
    hidden_key = _first(values, _HIDDEN_KEYS)
    heads_key = _first(values, _HEADS_KEYS)
    with contextlib.suppress(Exception):
        if "head_dim" in values and values["head_dim"] is None and hidden_key and heads_key:
            small.head_dim = values[hidden_key] // values[heads_key]
        if "num_key_value_heads" in values and values["num_key_value_heads"] is None and heads_key:
            small.num_key_value_heads = values[heads_key]
        count_key, layers = _layer_count(values)
        if "layer_types" in values and values["layer_types"] is None and layers:
            small.layer_types = ["full_attention"] * layers
        kinds = values.get("layer_types")
        if values.get("rope_parameters") == {} and isinstance(kinds, (list, tuple)) and kinds:
            # rotary parameters per layer kind left empty by the default (Cohere Compass): the
            # model looks each kind up, so each gets transformers' default rotary embedding
            small.rope_parameters = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in set(kinds)}


def shrink_config(config, *, layer_kinds: bool = True):
    """A copy of a transformers config with small sizes (never larger than the original); see
    the module docstring for the rules. ``config`` itself is not changed. ``layer_kinds=False``
    keeps the first layers only instead of one layer of each kind."""
    new = shrunk_fields(config, layer_kinds=layer_kinds)
    small = _rebuilt(config, new)
    if small is None:
        small = _set_fields(config, new)
    _fill_missing(small)
    return small

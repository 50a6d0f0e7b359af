"""Runtime confirmation with torch.fx (installed as ``adopter.tracing``).

    build_model(model_id | dir | class, device=..., attn_implementation=...) -> BuiltModel
    capture_model(model, example_inputs) -> Capture        (symbolic_trace, else torch.export)
    map_nodes(graph_module) -> [NodeSource]                  (node -> file/line/class/module)
    confirm_matches(model, example_inputs, matches) -> [Match with status/reason/trace_code]
    confirm_model_id(matches, model_id, device=None, **build_kwargs) -> [Match]

Importing this package imports torch; `adopter scan` imports it only with ``--model``.
"""

from .capture import Capture, CaptureError, LayerTracer, capture_model
from .confirm import confirm_matches
from .confirm_model import confirm_model_id
from .models import BuiltModel, TracingError, build_model, known_model_ids, make_example_inputs
from .runtime_only import find_runtime_only
from .runtime_types import runtime_reach, runtime_type_hints
from .source_map import NodeSource, map_nodes
from .trace_codes import TRACE_CODES, TraceCode

__all__ = [
    "TRACE_CODES",
    "TraceCode",
    "runtime_reach",
    "runtime_type_hints",
    "BuiltModel",
    "Capture",
    "CaptureError",
    "LayerTracer",
    "NodeSource",
    "TracingError",
    "build_model",
    "capture_model",
    "confirm_matches",
    "confirm_model_id",
    "find_runtime_only",
    "known_model_ids",
    "make_example_inputs",
    "map_nodes",
]

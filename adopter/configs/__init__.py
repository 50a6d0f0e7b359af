"""Shipped model configurations for the model ids `adopter trace`/`verify` know without network.

Each ``<model id with "/" as "__">.json`` is a Hugging Face ``config.json`` written from the
transformers config class with the public sizes of that checkpoint; ``architectures[0]`` names the
class to build. No weights: models are built from the config with random initialization.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent


def _file_for(model_id: str) -> Path:
    return CONFIG_DIR / (model_id.replace("/", "__") + ".json")


def known_model_ids() -> list[str]:
    """All model ids with a shipped config, sorted."""
    ids = []
    for path in CONFIG_DIR.glob("*.json"):
        ids.append(json.loads(path.read_text()).get("_adopter_model_id") or path.stem.replace("__", "/"))
    return sorted(ids)


def has_config(model_id: str) -> bool:
    return _file_for(model_id).is_file()


def load_config_dict(model_id: str) -> dict:
    """The shipped config as a dict (``KeyError`` for an unknown id)."""
    path = _file_for(model_id)
    if not path.is_file():
        raise KeyError(model_id)
    return json.loads(path.read_text())

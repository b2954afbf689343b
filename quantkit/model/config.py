"""The handful of hyper-parameters quantkit needs, read from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SourceError


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        # transformers 5 nests rope settings in rope_parameters; 4.x used rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            return cls(
                model_type=str(raw["model_type"]),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                raw=raw,
            )
        except KeyError as e:
            raise SourceError(f"{where}: missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise SourceError(f"{where}: bad value ({e})") from None


def read_config_json(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise SourceError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SourceError(f"{path}: cannot parse ({e})") from e
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise SourceError(f"{path}: not a transformers config (no model_type)")
    return raw

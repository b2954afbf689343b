"""A resolved model: its config, its adapter and its weights, read one layer at a time."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from ..errors import DependencyError, SourceError
from .adapters import ArchAdapter, adapter_for
from .block import Block, ModelPieces, MoE
from .config import ModelConfig, read_config_json
from .safetensors_reader import SafetensorsCheckpoint

NON_FLOAT_OK = (torch.float32, torch.float16, torch.bfloat16)


def load_tokenizer(folder: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is a base dependency
        raise DependencyError("transformers is needed to read the tokenizer: pip install transformers") from e
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types for a bad/missing tokenizer
        raise SourceError(f"{folder}: cannot load the tokenizer ({type(e).__name__}: {e})".splitlines()[0]) from e


class Described:
    """A model with an adapter and a config, whatever stores its weights: its layers as block descriptions."""
    adapter: ArchAdapter
    config: ModelConfig

    def block(self, i: int) -> Block:
        """Layer i as a block description (what the engine runs and the formats store)."""
        cache = self.__dict__.setdefault("_blocks", {})
        if i not in cache:
            cache[i] = self.adapter.describe_layer(self.config, i)
        return cache[i]

    @cached_property
    def pieces(self) -> ModelPieces:
        return self.adapter.model_pieces(self.config)

    @cached_property
    def has_experts(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(isinstance(r.op, MoE) for i in range(self.config.num_layers) for r in self.block(i).residuals)

    @cached_property
    def fused_parts(self) -> dict[str, tuple[str, int, int]]:
        """part name -> (stored name, first row, end row) for tensors the checkpoint stores joined."""
        out = {}
        for stored, parts in (self.adapter.fused(self.config) if self.adapter.fused else {}).items():
            row = 0
            for name, rows in parts:
                out[name] = (stored, row, row + rows)
                row += rows
        return out

    def stored_names(self, i: int) -> list[str]:
        """Layer i's tensors as the checkpoint stores them (joined tensors once, under their own name)."""
        names = []
        for n in self.block(i).tensor_names():
            n = self.fused_parts[n][0] if n in self.fused_parts else n
            if n not in names:
                names.append(n)
        return names

    def split_layer(self, i: int, get) -> dict[str, torch.Tensor]:
        """Layer i's tensors by the names its block description uses, from `get(stored relative name)`."""
        stored: dict[str, torch.Tensor] = {}
        out = {}
        for n in self.block(i).tensor_names():
            if n in self.fused_parts:
                name, a, b = self.fused_parts[n]
                if name not in stored:
                    stored[name] = get(name)
                out[n] = stored[name][a:b]
            else:
                out[n] = get(n)
        problem = self.block(i).shape_problem({k: v.shape for k, v in out.items()}, self.config.hidden_size)
        if problem:
            raise SourceError(f"{getattr(self, 'folder', None) or getattr(self, 'path', self.name)}: layer {i}: "
                              f"{problem}; the weights and the configuration disagree")
        return out


@dataclass(frozen=True)
class StoredLinear:
    """A decoder layer's linear as the checkpoint stores it: formats quantize these (Phi-3's joined qkv_proj once)."""
    name: str          # full name without ".weight"
    in_features: int
    out_features: int
    bias: bool
    parts: tuple[str, ...] = ()   # the block's linears it stores, in row order (names relative to the layer)


class ModelFolder(Described):
    """What every model folder quantkit reads shares: an adapter naming the tensors, safetensors `weights`,
    and the tensors outside the decoder layers (a base for source checkpoints and quantized artifacts)."""
    folder: Path
    weights: SafetensorsCheckpoint

    @property
    def tied_embeddings(self) -> bool:
        return self.adapter.lm_head not in self.weights

    def embed_weight(self) -> torch.Tensor:
        return self.weights.get(self.adapter.embed)

    def beside_language_model(self) -> list[str]:
        """Tensors outside the language model (a vision tower and its projector), in file order."""
        return [n for n in self.weights.entries if not self.adapter.in_language_model(n)]

    @cached_property
    def stored_linears(self) -> list[list[StoredLinear]]:
        """Per decoder layer, its linears as stored (joined ones once), in the order the block runs them."""
        layers = []
        for i in range(self.num_layers):
            prefix = self.adapter.prefix(i)
            row: dict[str, list[str]] = {}
            for lin in self.block(i).linears:
                stored = self.fused_parts.get(f"{lin}.weight", (f"{lin}.weight",))[0].removesuffix(".weight")
                row.setdefault(stored, []).append(lin)
            shapes = []
            for stored, parts in row.items():
                e = self.weights.entries[f"{prefix}{stored}.weight"]
                shapes.append(StoredLinear(f"{prefix}{stored}", e.shape[1], e.shape[0],
                                           f"{prefix}{stored}.bias" in self.weights, tuple(parts)))
            layers.append(shapes)
        return layers

    def final_norm_weight(self) -> torch.Tensor:
        return self.weights.get(self.adapter.final_norm)

    def lm_head_weight(self) -> torch.Tensor:
        return self.weights.get(self.adapter.embed if self.tied_embeddings else self.adapter.lm_head)

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.folder)


class Checkpoint(ModelFolder):
    """A Hugging Face checkpoint folder.  Nothing is loaded until asked for."""

    def __init__(self, folder: Path, name: str | None = None, revision: str | None = None):
        self.folder = Path(folder)
        if not self.folder.exists():
            raise SourceError(f"{self.folder}: no such folder")
        if not self.folder.is_dir():
            raise SourceError(f"{self.folder}: not a folder (pass a Hugging Face model folder)")
        self.name = name or str(self.folder)
        self.revision = revision
        raw = read_config_json(self.folder)
        self.adapter: ArchAdapter = adapter_for(raw["model_type"])  # refuse unknown families up front
        where = str(self.folder / "config.json")
        self.config = ModelConfig.from_dict(self.adapter.language_config(raw, where), where=where)
        self.weights = SafetensorsCheckpoint(self.folder)
        self._check_layout()

    def _check_layout(self) -> None:
        missing = [n for n in (self.adapter.embed, self.adapter.final_norm) if n not in self.weights]
        missing += [self.adapter.prefix(i) + n for i in range(self.num_layers) for n in self.stored_names(i)
                    if self.adapter.prefix(i) + n not in self.weights]
        if not self.tied_embeddings and self.adapter.lm_head not in self.weights:
            missing.append(self.adapter.lm_head)
        if missing:
            raise SourceError(f"{self.folder}: weights do not match the {self.adapter.family} layout "
                              f"(missing {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''})")
        for i in range(self.num_layers):   # from the headers alone: a wrong shape is refused before any work
            prefix, shapes = self.adapter.prefix(i), {}
            for n in self.block(i).tensor_names():
                stored, a, b = self.fused_parts.get(n, (n, None, None))
                shape = self.weights.entries[prefix + stored].shape
                shapes[n] = shape if a is None else (b - a, *shape[1:])
            problem = self.block(i).shape_problem(shapes, self.config.hidden_size)
            if problem:
                raise SourceError(f"{self.folder}: {prefix}{problem}; the weights and config.json disagree")
        for e in self.weights.entries.values():
            if e.dtype not in ("F32", "F16", "BF16"):
                raise SourceError(f"{self.folder}: tensor {e.name} is {e.dtype}; quantkit reads bf16/fp16/fp32 "
                                  f"checkpoints (is this model already quantized?)")

    # --- structure ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def parameter_count(self) -> int:
        return sum(e.numel for e in self.weights.entries.values())

    def size_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob("*.safetensors"))

    # --- tensors --------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        return self.weights.get(name)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """One decoder layer's tensors, keyed by their names relative to the layer prefix."""
        if not 0 <= i < self.num_layers:
            raise IndexError(i)
        prefix = self.adapter.prefix(i)
        return self.split_layer(i, lambda n: self.weights.get(prefix + n))

    def iter_layers(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        for i in range(self.num_layers):
            yield i, self.layer(i)


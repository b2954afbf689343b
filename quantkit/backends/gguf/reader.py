"""Read a GGUF file back: a description for `inspect`, and a dequantized DenseModel for `eval`."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import gguf
import numpy as np
import torch

from ...errors import SourceError, UnsupportedArchitectureError, UsageError
from ...model.adapters import adapter_for
from ...model.checkpoint import Described
from ...model.config import ModelConfig
from . import encoders
from .activations import activation_fn
from .split import all_parts
from .tensors import ARCHES, EXPERT_RENORMALIZE, NORM_SHIFT, expert_stacks, unpermute_qk

_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
         "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
         "attention.key_length", "vocab_size", "expert_count", "expert_used_count", "expert_feed_forward_length",
         "expert_shared_feed_forward_length")


class BoundedReader(gguf.GGUFReader):
    """gguf-py's reader with every read checked against the end of the file.  Its own reads past the end come
    back empty instead of failing, so a corrupt array length (2^60 elements) loops for ever over nothing."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None):
        end = int(offset) + int(np.empty([], dtype=dtype).itemsize) * int(count)
        if end > len(self.data):
            raise ValueError(f"a read at byte {int(offset)} runs past the end of the file ({len(self.data)} bytes)")
        return super()._get(offset, dtype, count, override_order)


def open_reader(path: Path) -> gguf.GGUFReader:
    try:
        return BoundedReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise SourceError(f"{path}: not a readable GGUF file ({e})".splitlines()[0]) from None


def open_readers(path: Path) -> list[gguf.GGUFReader]:
    """A file's reader, or a split file's readers part by part (path: its first part; split.py)."""
    first = open_reader(path)
    parts = all_parts(Path(path), field_value(first, gguf.Keys.Split.LLM_KV_SPLIT_COUNT))
    return [first] + [open_reader(p) for p in parts[1:]]


def field_value(reader: gguf.GGUFReader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return f"[{len(f.data)} strings]"
        return f"[{len(f.data)} values]"
    try:
        return f.contents()
    except (UnicodeDecodeError, ValueError, IndexError):
        where = getattr(reader.data, "filename", None) or "the GGUF file"
        raise SourceError(f"{where}: metadata {key} is unreadable; the file is corrupt") from None


# the transformers model_type of a GGUF architecture where the names differ (llama with experts: mixtral)
MODEL_TYPE = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


def _expert_config(arch: str, kv: dict) -> dict:
    """The config keys of a mixture of experts as llama.cpp runs it: experts in every layer, renormalised or not
    as the architecture fixes it."""
    if not kv["expert_count"]:
        return {}
    extra = {"num_local_experts": kv["expert_count"], "num_experts": kv["expert_count"],
             "num_experts_per_tok": kv["expert_used_count"], "norm_topk_prob": EXPERT_RENORMALIZE[arch],
             "decoder_sparse_step": 1, "mlp_only_layers": []}
    if kv["expert_feed_forward_length"]:
        extra["moe_intermediate_size"] = kv["expert_feed_forward_length"]
    if kv["expert_shared_feed_forward_length"]:
        extra["shared_expert_intermediate_size"] = kv["expert_shared_feed_forward_length"]
    return extra


def _arch_config(reader: gguf.GGUFReader, arch: str, raw: dict, tensor, names: set[str]) -> dict:
    """The config keys a family's block description reads, as llama.cpp interprets the file: Gemma's softcaps
    and window, its query scale (llama.cpp: 1/sqrt(head size)) and Gemma 3's per-layer-type RoPE; Phi-3's
    partial rotary, window and longrope factors (`tensor(name)` reads a tensor of the file, `names` are all its
    tensors' names)."""
    get = lambda key: field_value(reader, f"{arch}.{key}")
    if arch == "phi3":
        # the window key is written, but llama.cpp runs Phi-3 without it (its loader turns Phi SWA off)
        extra = {"partial_rotary_factor": (get("rope.dimension_count") or raw["head_dim"]) / raw["head_dim"],
                 "original_max_position_embeddings": get("rope.scaling.original_context_length")}
        if "rope_factors_long.weight" in names:
            extra["rope_parameters"] = {"rope_type": "longrope", "rope_theta": raw["rope_theta"],
                                        "long_factor": tensor("rope_factors_long.weight").flatten().tolist(),
                                        "short_factor": tensor("rope_factors_short.weight").flatten().tolist()}
        return extra
    if arch not in ("gemma2", "gemma3"):
        return {}
    extra = {"query_pre_attn_scalar": raw["head_dim"], "sliding_window": get("attention.sliding_window"),
             "final_logit_softcapping": get("final_logit_softcapping") or None}
    if arch == "gemma2":
        extra["attn_logit_softcapping"] = get("attn_logit_softcapping") or None
        return extra
    pattern = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None:   # per layer, whether it slides (else llama.cpp's default: every sixth layer global)
        sliding = pattern.contents()
        if isinstance(sliding, list):
            extra["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
        else:
            extra["sliding_window_pattern"] = int(sliding)
    full = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
    if get("rope.scaling.type") == "linear":
        full = {"rope_type": "linear", "factor": get("rope.scaling.factor"), "rope_theta": raw["rope_theta"]}
    extra["rope_parameters"] = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": get("rope.freq_base_swa") or 10000.0}}
    return extra


class GGUFModel(Described):
    """A GGUF file seen as a dense model (weights dequantized one layer at a time)."""

    def __init__(self, path: Path, base=None, activations: str = "exact"):
        self.path = Path(path)
        if activations not in ("exact", "llama.cpp"):
            raise UsageError(f"--activations {activations!r}: expected exact or llama.cpp")
        self.emulate = activations == "llama.cpp"
        self.name = self.path.name
        self.readers = open_readers(self.path)
        self.reader = self.readers[0]   # the metadata is in the first part
        self.base = base
        arch = field_value(self.reader, "general.architecture")
        if arch not in ARCHES:
            raise UnsupportedArchitectureError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                               f"supported: {', '.join(ARCHES)}")
        kv = {k: field_value(self.reader, f"{arch}.{k}") for k in _KEYS}
        model_type = "mixtral" if arch == "llama" and kv["expert_count"] else MODEL_TYPE.get(arch, arch)
        self.adapter = adapter_for(model_type)
        if kv["embedding_length"] is None or kv["block_count"] is None:
            raise SourceError(f"{path}: missing {arch} hyper-parameters")
        self.tensors = {t.name: t for r in self.readers for t in r.tensors}
        layers = {int(n.split(".")[1]) for n in self.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
        if kv["block_count"] != len(layers) or layers != set(range(len(layers))):
            raise SourceError(f"{path}: the file says {kv['block_count']} layers and holds tensors of {len(layers)}; "
                              f"the file is corrupt")
        missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in self.tensors]
        if missing:
            raise SourceError(f"{path}: tensor {missing[0]} is missing; the file is corrupt or not a language model")
        n_vocab = int(self.tensors["token_embd.weight"].shape[1])
        heads = kv["attention.head_count"]
        if not isinstance(heads, int) or heads <= 0 or int(self.tensors["token_embd.weight"].shape[0]) != kv["embedding_length"]:
            raise SourceError(f"{path}: the hyper-parameters (width {kv['embedding_length']}, {heads} heads) do not fit "
                              f"the embedding's shape {list(map(int, self.tensors['token_embd.weight'].shape))}; the file is corrupt")
        raw = {"model_type": model_type, "hidden_size": kv["embedding_length"], "num_hidden_layers": kv["block_count"],
               "num_attention_heads": heads, "num_key_value_heads": kv["attention.head_count_kv"] or heads,
               "head_dim": kv["attention.key_length"] or kv["embedding_length"] // heads,
               "intermediate_size": kv["feed_forward_length"], "vocab_size": n_vocab,
               "rms_norm_eps": kv["attention.layer_norm_rms_epsilon"], "rope_theta": kv["rope.freq_base"] or 10000.0,
               "tie_word_embeddings": "output.weight" not in self.tensors,
               "max_position_embeddings": kv["context_length"] or 2048}
        raw.update(_arch_config(self.reader, arch, raw, self.gguf_tensor, set(self.tensors)))
        raw.update(_expert_config(arch, kv))
        if "rope_freqs.weight" in self.tensors:   # llama3 scaling, stored as one divisor per frequency
            factors = self.gguf_tensor("rope_freqs.weight").flatten().tolist()
            raw["rope_parameters"] = {"rope_type": "factors", "factors": factors, "rope_theta": raw["rope_theta"]}
        self.config = ModelConfig.from_dict(raw, where=str(path))
        self.num_layers = self.config.num_layers
        self._names = gguf.get_tensor_name_map(ARCHES[arch], self.num_layers)

    @cached_property
    def tokenizer(self):
        if self.base is not None:
            return self.base.tokenizer
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        except Exception as e:
            raise SourceError(f"{self.path}: cannot build a tokenizer from the GGUF file ({e}); pass --base MODEL"
                              .splitlines()[0]) from None

    def gguf_tensor(self, name: str) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise SourceError(f"{self.path}: tensor {name} missing")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # torch order
        # GGUFReader hands float tensors back typed and quantized ones as bytes: give the decoder bytes, row by row.
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1, int(t.n_bytes) // max(1, int(np.prod(shape[:-1]))))
        return encoders.dequantize(raw, t.tensor_type, shape)

    def _hf(self, hf_name: str) -> torch.Tensor:
        gname = self._names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        w = self.gguf_tensor(gname)
        shift = NORM_SHIFT.get(self.adapter.gguf_arch, 0.0)
        if shift and hf_name.endswith("norm.weight"):
            w = w - shift
        if self.adapter.gguf_permute_qk and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = self.config.num_heads if ".q_proj." in hf_name else self.config.num_kv_heads
            if w.shape[0] != heads * self.config.head_dim:   # the un-permutation below reshapes by the head count
                raise SourceError(f"{self.path}: {gname} has {w.shape[0]} rows where the file's head count and "
                                  f"size imply {heads * self.config.head_dim}; the file is corrupt")
            w = unpermute_qk(w, heads)
        return w

    def _act(self, gguf_name: str):
        return activation_fn(self.tensors[gguf_name].tensor_type)

    def activation_fns(self, i: int) -> dict | None:
        """Per linear, llama.cpp's rounding of its input (only when emulating llama.cpp)."""
        if not self.emulate:
            return None
        prefix = self.adapter.prefix(i)
        stored = lambda lin: self.fused_parts.get(f"{lin}.weight", (f"{lin}.weight",))[0]
        stacked = {rel: name for name, parts in expert_stacks(self, i).items() for rel in parts}
        gguf_name = lambda lin: stacked.get(f"{lin}.weight") or self._names.get_name(prefix + stored(lin),
                                                                                      try_suffixes=(".weight",))
        return {lin: self._act(gguf_name(lin)) for lin in self.block(i).linears}

    @property
    def head_activation_fn(self):
        if not self.emulate:
            return None
        return self._act("output.weight" if "output.weight" in self.tensors else "token_embd.weight")

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = self.adapter.prefix(i)
        in_stack = {rel: (name, e) for name, parts in expert_stacks(self, i).items() for e, rel in enumerate(parts)}
        stacks: dict[str, torch.Tensor] = {}   # each stacked expert tensor dequantized once per layer

        def get(rel: str) -> torch.Tensor:
            if rel not in in_stack:
                return self._hf(prefix + rel)
            name, e = in_stack[rel]
            if name not in stacks:
                stacks[name] = self.gguf_tensor(name)
            return stacks[name][e]
        return self.split_layer(i, get)

    def embed_weight(self) -> torch.Tensor:
        return self.gguf_tensor("token_embd.weight")

    def final_norm_weight(self) -> torch.Tensor:
        return self.gguf_tensor("output_norm.weight") - NORM_SHIFT.get(self.adapter.gguf_arch, 0.0)

    def lm_head_weight(self) -> torch.Tensor:
        return self.gguf_tensor("output.weight" if "output.weight" in self.tensors else "token_embd.weight")


def describe(path: Path) -> dict:
    readers = open_readers(path)
    reader = readers[0]
    rows, total_bytes, total_weights = [], 0, 0
    for t in (t for r in readers for t in r.tensors):
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        n = int(t.n_elements)
        rows.append({"name": t.name, "shape": [int(d) for d in t.shape.tolist()], "type": qtype.name,
                     "bpw": round(8 * int(t.n_bytes) / n, 4)})
        total_bytes += int(t.n_bytes)
        total_weights += n
    metadata = {}
    for key in reader.fields:
        if key.startswith("GGUF."):
            continue
        metadata[key] = field_value(reader, key)
    ftype = metadata.get("general.file_type")
    try:
        ftype_name = gguf.LlamaFileType(ftype).name if ftype is not None else None
    except ValueError:
        ftype_name = str(ftype)
    parts = all_parts(Path(path), metadata.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT))
    return {"kind": "gguf", "file": str(path), "file_size": sum(p.stat().st_size for p in parts),
            **({"split_parts": [p.name for p in parts]} if len(parts) > 1 else {}),
            "architecture": metadata.get("general.architecture"), "name": metadata.get("general.name"),
            "file_type": ftype_name, "tensor_count": len(rows), "parameters": total_weights,
            "bits_per_weight": round(8 * total_bytes / max(total_weights, 1), 4),
            "metadata": metadata, "tensors": rows}

"""What every quantized Hugging Face folder shares, whichever format wrote it (GPTQ, AWQ, bnb).

Writing: the file layout around the quantized linears (`checkpoint_specs`: embeddings, norms, head and
anything beside the language model in the source dtype, in transformers' order; `LayerJobWriter`: the
tensors a calibrated format's job does not quantize, layer by layer and at the end), and the side files —
config.json with the format's `quantization_config`, the tokenizer and generation config copied from the
source, and quantkit.json (what was done, from what, each weight file's sha256).
Reading: `QuantizedFolder`, the folder as a model whose quantized linears the format's reader dequantizes."""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from .. import __version__
from ..artifact import sha256_file
from ..calibration.jobs import PassJob
from ..model.adapters import adapter_for
from ..model.checkpoint import ModelFolder
from ..model.checkpoint import StoredLinear
from ..model.config import ModelConfig
from ..model.safetensors_reader import DTYPES, SafetensorsCheckpoint
from ..model.safetensors_writer import ShardedSafetensorsWriter, TensorSpec

# what the plans of GPTQ and AWQ say of a mixture of experts (the consumers' side, checked in the tests)
EXPERTS_NOTE = ("mixture of experts: experts stored one linear each under the checkpoint's names, as vLLM reads "
                "them; transformers 5 fuses experts and cannot load them quantized: use GPTQModel.load(folder) "
                "(checked for qwen2_moe; GPTQModel 7.7 does not map mixtral's w1/w2/w3 and reads it wrong)")

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                "generation_config.json")


def find_quantization_config(folder: Path, method: str, side_file: str) -> dict | None:
    """The `quantization_config` of config.json when its quant_method is `method`, else the format's own side
    file (quantize_config.json, quant_config.json) when it names that method; None when neither does."""
    for name, key in (("config.json", "quantization_config"), (side_file, None)):
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        q = data.get(key) if key else data
        if isinstance(q, dict) and str(q.get("quant_method", q.get("method", ""))).lower() == method:
            return q
    return None


def plan_rows(model, specs: list[TensorSpec], kind: str, note: Callable[[StoredLinear], str]) -> list:
    """`--dry-run` rows of a quantized folder: one per stored linear (the bytes of all its tensors, bias
    included), one per tensor kept as the source stores it; together, the bytes the folder's weights take."""
    from . import PlanRow
    by_name = {sp.name: sp for sp in specs}
    quantized = {lin.name: lin for row in model.stored_linears for lin in row}
    linear_bytes: dict[str, int] = {}
    for name, sp in by_name.items():
        base = name.rpartition(".")[0]
        if base in quantized:
            linear_bytes[base] = linear_bytes.get(base, 0) + sp.nbytes
    rows, seen = [], set()
    for name, sp in by_name.items():
        base = name.rpartition(".")[0]
        if base not in quantized:
            rows.append(PlanRow(name, sp.shape, str(sp.dtype).replace("torch.", ""), sp.nbytes, "kept"))
        elif base not in seen:
            seen.add(base)
            lin = quantized[base]
            rows.append(PlanRow(base, (lin.out_features, lin.in_features), kind, linear_bytes[base], note(lin)))
    return rows


def checkpoint_specs(model, quantized_specs: Callable[[StoredLinear], list[TensorSpec]]) -> list[TensorSpec]:
    """Every tensor of a quantized folder, in file order (by layer, as transformers lays them out): each stored
    linear of a decoder layer as `quantized_specs` gives it, everything else as the source stores it."""
    adapter, weights = model.adapter, model.weights

    def plain(name: str) -> TensorSpec:
        e = weights.entries[name]
        return TensorSpec(name, DTYPES[e.dtype], tuple(e.shape))

    specs = [plain(adapter.embed)]
    quantized = set()
    for i, row in enumerate(model.stored_linears):
        for lin in row:
            specs += quantized_specs(lin)
            quantized.add(lin.name)
        prefix = adapter.prefix(i)
        for rel in model.stored_names(i):
            base = (prefix + rel).rsplit(".", 1)[0]
            if base not in quantized:  # norms (q/k norms too)
                specs.append(plain(prefix + rel))
    specs.append(plain(adapter.final_norm))
    if not model.tied_embeddings:
        specs.append(plain(adapter.lm_head))
    return specs + [plain(n) for n in model.beside_language_model()]


class LayerJobWriter:
    """The sharded writer of a calibrated format's job, with the tensors every such format writes the same way:
    the embedding first, per layer the norms (as the job's layer context stores them: a folded AWQ scale
    changes a norm) in the source dtype and the quantized linears' biases in float16 (as the kernels take
    them), and at the end the final norm, the head and anything beside the language model."""

    def __init__(self, model, folder: Path, specs: list[TensorSpec], max_shard_bytes: int):
        self.model = model
        self.writer = ShardedSafetensorsWriter(folder, specs, max_shard_bytes)
        self.dtypes = {sp.name: sp.dtype for sp in specs}
        self.linears = {lin.name for row in model.stored_linears for lin in row}

    def open(self, written: set[str] | None = None) -> None:
        """`written`: resume the files a previous run left (quantkit.calibration.resume)."""
        self.writer.open(written)
        embed = self.model.adapter.embed
        if embed not in (written or ()):
            self.writer.put(embed, self.model.tensor(embed).to(self.dtypes[embed]))

    def put(self, name: str, tensor: torch.Tensor) -> None:
        self.writer.put(name, tensor)

    def put_layer_rest(self, ctx) -> None:
        prefix = self.model.adapter.prefix(ctx.layer)
        for rel in self.model.stored_names(ctx.layer):
            full = prefix + rel
            base, _, leaf = full.rpartition(".")
            if base in self.linears and leaf == "weight":
                continue   # the format's own tensors
            self.writer.put(full, ctx.stored(rel).to(self.dtypes[full]))

    def close(self) -> list[Path]:
        model, adapter = self.model, self.model.adapter
        self.writer.put(adapter.final_norm, model.final_norm_weight())
        if not model.tied_embeddings:
            self.writer.put(adapter.lm_head, model.lm_head_weight())
        for name in model.beside_language_model():    # a vision tower stays as it is
            self.writer.put(name, model.tensor(name))
        return self.writer.close()

    def abort(self) -> None:
        self.writer.abort()


class FolderJob(PassJob):
    """What the capture-pass job of every calibrated folder format shares (GPTQ, AWQ): settings, the writer, the
    life cycle (open, round-to-nearest without data, finish, abort) and the quantkit.json it writes.  A format
    sets `format` and `log_key`, implements the LayerJob methods and `quantization_config`, and may write
    files of its own in `write_format_files`."""
    format = ""
    log_key = "layers"        # quantkit.json's key for the per-layer (or per-group) log

    def __init__(self, model, settings, variant: str, folder: Path, specs: list[TensorSpec] | None, *,
                 rtn: bool = False, device: torch.device, calibration=None, notes: list[str] | None = None,
                 max_shard_bytes: int = 4 << 30):
        self.model, self.settings, self.variant, self.rtn = model, settings, variant, rtn
        self.folder, self.device, self.calibration = Path(folder), device, calibration
        self.label = f"{self.format}:{variant}"
        self.notes = notes or []
        self.max_shard_bytes = max_shard_bytes
        # specs None: the job plans its files later (EXL2 knows its layouts after measuring) and sets the writer
        self.writer = LayerJobWriter(model, self.folder, specs, max_shard_bytes) if specs is not None else None
        self.layer_log: list[dict] = []
        self.started = time.time()

    @property
    def needs_calibration(self) -> bool:
        return not self.rtn

    def open(self) -> None:
        self.writer.open(self.resumed_written)

    # --- crash resume (quantkit.calibration.resume): what the job carries from layer to layer ---------------
    resumed_written: set[str] | None = None

    def resume_state(self) -> dict:
        return {"layer_log": list(self.layer_log), "seconds": time.time() - self.started,
                "written": None if self.writer is None else sorted(self.writer.writer.written())}

    def restore(self, state: dict) -> None:
        self.layer_log = list(state["layer_log"])
        self.started = time.time() - state["seconds"]
        self.resumed_written = None if state["written"] is None else set(state["written"])

    def run_uncalibrated(self, progress_task=None) -> None:
        """Round to nearest: every layer through data-less contexts."""
        from ..calibration.context import LayerContext
        for i in range(self.model.num_layers):
            block = self.model.block(i)
            ctx = LayerContext(i, block, self.model.layer(i))
            for group in block.groups:
                self.quantize_group(ctx, group)
            self.finish_layer(ctx)
            if progress_task is not None:
                progress_task.advance()

    def quantization_config(self) -> dict:
        raise NotImplementedError

    def write_format_files(self, qconfig: dict) -> None:
        """Files of the format's own beside config.json (GPTQ's quantize_config.json)."""

    def summary(self) -> dict:
        """The format's own top-level entries of quantkit.json."""
        return {}

    def finish(self) -> Path:
        """Write the remaining tensors and the side files; return the folder."""
        return self.write_side_files(self.writer.close())

    def write_side_files(self, files: list[Path]) -> Path:
        qconfig = self.quantization_config()
        self.write_format_files(qconfig)
        write_side_files(self.model, self.folder, qconfig, {
            "format": self.format, "variant": self.variant,
            "method": "round-to-nearest" if self.rtn else self.format, "settings": asdict(self.settings),
            "calibration": self.calibration.to_json() if self.calibration is not None else None,
            "consumers": self.notes,
            "seconds": round(time.time() - self.started, 2),
            **self.summary(),
            self.log_key: self.layer_log,
        }, files)
        return self.folder

    def abort(self) -> None:
        self.writer.abort()


def write_side_files(model, folder: Path, quantization_config: dict, info: dict, weight_files: list[Path]) -> None:
    """Everything but the weights.  `info` is the format's part of quantkit.json; the version, the source and
    the file hashes are added here."""
    folder = Path(folder)
    config = json.loads((model.folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED_FILES:
        if (model.folder / name).exists():
            shutil.copyfile(model.folder / name, folder / name)
    record = {"quantkit_version": __version__, **info, "source": {"model": model.name, "revision": model.revision},
              "parameters": model.parameter_count(),   # the original's, so a card can give bits per weight
              "files": {p.name: sha256_file(p) for p in weight_files}}
    (folder / "quantkit.json").write_text(json.dumps(record, indent=2) + "\n")


class QuantizedFolder(ModelFolder):
    """A quantized folder as the harness sees a model: layer(i) returns float weights, the quantized linears
    dequantized by the format (`is_quantized` / `linear_weight`), everything else as stored."""

    def __init__(self, folder: Path, qconfig: dict):
        self.folder, self.qconfig = Path(folder), qconfig
        raw = json.loads((self.folder / "config.json").read_text())
        self.adapter = adapter_for(raw["model_type"])
        where = str(self.folder / "config.json")
        self.config = ModelConfig.from_dict(self.adapter.language_config(raw, where), where=where)
        self.weights = SafetensorsCheckpoint(self.folder)
        self.name = str(self.folder)
        self.num_layers = self.config.num_layers

    def is_quantized(self, name: str) -> bool:
        """Whether the linear `name` (full name, without ".weight") is stored quantized: packed codes in a
        `qweight`, as GPTQ and AWQ store them (a format that stores them otherwise overrides this)."""
        return f"{name}.qweight" in self.weights

    def linear_weight(self, name: str) -> torch.Tensor:
        """A quantized linear's float weight (N, K)."""
        raise NotImplementedError

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = self.adapter.prefix(i)

        def get(rel: str) -> torch.Tensor:
            base = prefix + rel.removesuffix(".weight")
            if rel.endswith(".weight") and self.is_quantized(base):
                return self.linear_weight(base)
            return self.weights.get(prefix + rel)
        return self.split_layer(i, get)

    def described(self, kind: str, **fields) -> dict:
        """`inspect`'s description: the format's fields between the common ones."""
        info_path = self.folder / "quantkit.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        return {"kind": kind, "folder": str(self.folder), "architecture": self.config.model_type, **fields,
                "layers": self.num_layers, "size_on_disk": sum(p.stat().st_size for p in self.folder.glob("*.safetensors")),
                "variant": info.get("variant"),
                "calibration": (info.get("calibration") or {}).get("token_hash"),
                "tensors": [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype} for e in self.weights.entries.values()]}

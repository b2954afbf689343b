"""`--error-feedback`: one GGUF file's decoder linears quantized in the shared capture pass (feedback.py), each
from the Hessian of its inputs as the file's own already-quantized layers produce them (true sequential, as
GPTQ), and after the last layer the output head from the Hessian of the final norm's output (when the head is
tied, that is the token embedding the file stores once for both uses); the rest of the file (embeddings,
norms, stacked experts) is encoded by the writer as usual, weighted by the same inputs' mean squares.

The pass reaches a layer long before the writer does, so each tensor's bytes wait in a scratch file beside the
output (`.partial-FILE.feedback`), appended layer by layer: memory stays at one layer.  A crash resume keeps the
file and its index up to the last finished layer; any other failure removes it, and so does the end of the run.
"""
from __future__ import annotations

from itertools import accumulate
from pathlib import Path

import gguf
import numpy as np
import torch

from ...calibration.jobs import PassJob
from ...calibration.stats import GroupStats, ReferenceHessian, output_projection
from ...errors import OutputError
from . import encoders, feedback
from .tensors import gguf_tensors, permute_qk


HEAD_ROWS = 16384


def head_tensor(types: dict[str, gguf.GGMLQuantizationType]) -> str | None:
    """The GGUF tensor llama.cpp reads the output head from (the token embedding when the file has no
    output.weight: a tied model stored once), when its type is one the feedback can round to."""
    name = "output.weight" if "output.weight" in types else "token_embd.weight"
    return name if types.get(name) in feedback.SUPPORTED else None


class FeedbackEncoder(PassJob):
    # aim at the unquantized model's outputs (feedback.py's target), estimated from half of the windows when
    # they hold more than 32 k tokens, from all of them below: the reference stream's walk and statistics cost about
    # what the rest of the pass does; on the demo (64 k tokens, Q4_K_M) half gives KLD 0.0190 at 1.46x GPTQ's time,
    # all 0.0178 at ~1.9x (bench/results/gguf_feedback.md); a few hundred tokens would give a noisy target
    reference = 0.5
    reference_tokens = 32768

    def __init__(self, model, file_type: str, output: Path, types: dict[str, gguf.GGMLQuantizationType],
                 device: torch.device, reference: float | None = None):
        self.model, self.types, self.device = model, types, device
        if reference is not None:    # --feedback-reference: 0 aims at W·x (GPTQ's target), 1 pairs every window
            self.reference = reference
        self.file_type = file_type
        self.label = f"gguf:{file_type} error feedback"
        self.spill = Path(output).parent / f".partial-{Path(output).name}.feedback"
        self.by_source = {t.source: t for t in gguf_tensors(model) if t.source and not t.stack}
        self.stats = GroupStats(ReferenceHessian, device=device)
        self.projections: dict[tuple, torch.Tensor | None] = {}   # input group -> its output_projection
        self.head = head_tensor(types)
        self.index: dict[str, tuple[int, int]] = {}      # GGUF name -> (offset, bytes) in the spill
        self.importance: dict[str, torch.Tensor] = {}    # HF weight name -> mean square of its inputs
        self.size = 0
        self.chunks = 0       # calibration samples seen (llama-imatrix's "chunks", for the file's keys)
        self.log: list[dict] = []
        self._mode = "wb"     # a fresh run replaces what a killed one left; a resumed run appends to it

    # --- the pass ---------------------------------------------------------------------------------
    def observe(self, ctx, group, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        if reference is None:
            self.stats.add(group, x)
            return
        if group.linears not in self.projections:
            self.projections[group.linears] = output_projection(ctx.source, group.linears, self.device)
        self.stats.add(group, x, reference=reference, project=self.projections[group.linears])

    def quantize_group(self, ctx, group) -> dict[str, torch.Tensor]:
        acc = self.stats.pop(group.linears, None)
        self.projections.pop(group.linears, None)
        if acc is None:        # an expert no calibration token reached: the writer encodes it as usual
            return {}
        H = acc.value()
        prefix = self.model.adapter.prefix(ctx.layer)
        for lin in group.linears:
            self.importance[f"{prefix}{lin}.weight"] = torch.diag(H).cpu()
        # Linears that read the same input share H and the update treats rows independently, so those of one
        # type are quantized stacked, in one run (as gptq/job.py does): same result, fewer and larger steps.
        by_type: dict[gguf.GGMLQuantizationType, list] = {}
        for stored in self.model.stored_linears[ctx.layer]:   # a joined linear (qkv_proj) is its parts' rows
            t = self.by_source.get(f"{stored.name}.weight")
            if t is not None and set(stored.parts) <= set(group.linears):
                by_type.setdefault(self.types[t.name], []).append((stored, t))
        heights = [ctx.source[f"{lin}.weight"].shape[0] for lin in group.linears]
        first = dict(zip(group.linears, accumulate(heights, initial=0)))   # rows of a projected D, by linear
        new = {}
        # the target's H, combined from the halves once for the group; none when it is H itself (every row
        # paired), which lets feedback_quantize reuse the column loop's factorisation for the target
        paired_H = None if acc.all_paired else acc.paired_value()
        for qtype, members in by_type.items():
            parts = [p for stored, _ in members for p in stored.parts]
            W = torch.cat([ctx.source[f"{p}.weight"].to(self.device, torch.float32) for p in parts])
            if qtype in feedback.SUPPORTED:
                rows = torch.cat([torch.arange(first[p], first[p] + ctx.source[f"{p}.weight"].shape[0])
                                  for p in parts])
                folds = acc.folds(W, rows)     # when both halves have rows, the shift comes from them
                shift = acc.shift(W, rows) if folds is None else None
                r = feedback.feedback_quantize(W, H, qtype, reference=shift, reference_hessian=paired_H, folds=folds)
                data, Wq = r.data, r.weight
                self.log.append({"layer": ctx.layer, "tensors": [t.name for _, t in members], "type": qtype.name,
                                 "damp": r.damp, "loss": r.loss, "rows": W.shape[0], "plain_rows": r.plain_rows,
                                 "trust": r.trust})
            else:                 # F16/BF16/F32 (a --tensor-type choice): nothing is rounded that feedback could fix
                data = encoders.quantize(W, qtype, imatrix=torch.diag(H))
                Wq = encoders.dequantize(data, qtype, W.shape).to(W.device)
            row = 0
            for stored, t in members:
                rows = slice(row, row + stored.out_features)
                part = data[rows]
                if t.permute_heads:   # rows are independent: the file's row order is applied to the finished rows
                    part = permute_qk(torch.from_numpy(part), t.permute_heads).numpy()
                self._put(t.name, part)
                for p in stored.parts:
                    n = ctx.source[f"{p}.weight"].shape[0]
                    new[f"{p}.weight"] = Wq[row:row + n]
                    row += n
        return new

    def finish_layer(self, ctx) -> None:
        self.chunks = ctx.stream.shape[0]
        if self.head is not None and ctx.layer == self.model.num_layers - 1:
            self._quantize_head(ctx)

    def _quantize_head(self, ctx) -> None:
        acc = ctx.head_statistics(self.model, self.device)
        H = acc.value()
        W, qtype = self.model.lm_head_weight(), self.types[self.head]
        # its rows are independent and the vocabulary is large: slices keep the float32 copies small
        loss, plain, trust = 0.0, 0, 0.0
        paired = isinstance(acc, ReferenceHessian)
        paired_H = acc.paired_value() if paired and not acc.all_paired else None
        for start in range(0, W.shape[0], HEAD_ROWS):
            rows = W[start:start + HEAD_ROWS].to(self.device, torch.float32)
            folds = acc.folds(rows) if paired else None
            shift = acc.shift(rows) if paired and folds is None else None
            r = feedback.feedback_quantize(rows, H, qtype, reference=shift, reference_hessian=paired_H, folds=folds)
            if start == 0:
                self._put(self.head, r.data)
            else:
                self._append(self.head, r.data)
            loss, plain, trust = loss + r.loss, plain + r.plain_rows, trust + r.trust * rows.shape[0]
        self.log.append({"layer": "head", "tensors": [self.head], "type": qtype.name, "damp": r.damp, "loss": loss,
                         "rows": W.shape[0], "plain_rows": plain, "trust": trust / W.shape[0]})

    def _put(self, name: str, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data)
        try:
            with open(self.spill, self._mode) as f:
                data.tofile(f)
            self._mode = "ab"
        except OSError as e:
            raise OutputError(f"{self.spill}: cannot write the error-feedback scratch file ({e.strerror or e})") from None
        self.index[name] = (self.size, data.nbytes)
        self.size += data.nbytes

    def _append(self, name: str, data: np.ndarray) -> None:
        """More rows of the tensor `_put` began (written right after it)."""
        offset, nbytes = self.index[name]
        assert offset + nbytes == self.size, f"{name}: rows appended after another tensor's bytes"
        self._put(name, data)
        self.index[name] = (offset, nbytes + self.index[name][1])

    def row_choices(self) -> tuple[int, int, float]:
        """(rows that kept the plain search, rows fed back in all, their mean trust): feedback.py's
        choices per row, over the file."""
        rows = sum(e.get("rows", 0) for e in self.log)
        plain = sum(e.get("plain_rows", 0) for e in self.log)
        trust = sum(e.get("trust", 1.0) * e.get("rows", 0) for e in self.log) / max(rows, 1)
        return plain, rows, trust

    # --- what the writer reads ------------------------------------------------------------------
    def encoded(self, name: str) -> np.ndarray | None:
        """The finished bytes of GGUF tensor `name`, or None when the writer encodes it."""
        where = self.index.get(name)
        if where is None:
            return None
        return np.fromfile(self.spill, dtype=np.uint8, count=where[1], offset=where[0])

    def discard(self) -> None:
        self.spill.unlink(missing_ok=True)

    # --- crash resume ---------------------------------------------------------------------------------
    def resume_state(self) -> dict:
        return {"index": self.index, "size": self.size, "importance": self.importance, "log": self.log,
                "chunks": self.chunks}

    def restore(self, state: dict) -> None:
        size = self.spill.stat().st_size if self.spill.exists() else -1
        if size < state["size"]:
            raise OutputError(f"{self.spill}: the previous run's error-feedback file is missing or short; "
                              f"rerun with --no-resume")
        with open(self.spill, "r+b") as f:
            f.truncate(state["size"])
        self.index, self.size, self.importance, self.log = (state["index"], state["size"], state["importance"],
                                                            state["log"])
        self.chunks = state["chunks"]
        self._mode = "ab"

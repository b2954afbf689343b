"""An artifact loaded in a runtime, behind one small interface the verify child drives: the logits of a prompt
(prompt processing), then greedy decoding from it (generation).  One class per runtime kind; which loader
makes one, and in which order a user would try them, is the format's (`Backend.runtime_loaders`)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch


def from_pretrained_plain(folder: Path):
    """What a user types first: `AutoModelForCausalLM.from_pretrained(folder)`, the quantization from config.json
    (on the CPU: device_map="cpu", or transformers would look for an accelerator)."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, os.cpu_count() or 1)))
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu")


PLAIN = "AutoModelForCausalLM.from_pretrained(folder)"


class TransformersSession:
    """A transformers model (any quantization its config names), on the CPU or where it was put."""

    def __init__(self, model, how: str):
        self.model, self.how = model.eval(), how
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self._past = None

    @torch.no_grad()
    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.compiler.set_stance("force_eager"):     # GPTQModel's torch kernel would recompile per shape
            out = self.model(torch.tensor([ids]), use_cache=True)
        self._past, self._last = out.past_key_values, out.logits[0, -1]
        return out.logits[0].float()

    @torch.no_grad()
    def decode(self, n: int) -> list[int]:
        """n greedy tokens after the prompt, each from the cache of the ones before."""
        made = []
        with torch.compiler.set_stance("force_eager"):
            for _ in range(n):
                tok = int(self._last.argmax())
                made.append(tok)
                out = self.model(torch.tensor([[tok]]), past_key_values=self._past, use_cache=True)
                self._past, self._last = out.past_key_values, out.logits[0, -1]
        return made


class LlamaCppSession:
    """A GGUF file in llama.cpp (llama-cpp-python), with llama.cpp's defaults but for the context size."""

    def __init__(self, path: Path, ctx: int, how: str):
        import llama_cpp
        self.how, self.dtype = how, "llama.cpp (activations in Q8 blocks)"
        self.ctx = ctx
        self.llm = llama_cpp.Llama(str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, verbose=False,
                                   n_threads=os.cpu_count() or 1)

    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids)
        self._n = len(ids)
        return torch.from_numpy(np.array(self.llm.scores[:len(ids)], dtype=np.float32))

    def decode(self, n: int) -> list[int]:
        made = []
        for _ in range(n):
            tok = int(np.argmax(self.llm.scores[self._n - 1]))
            made.append(tok)
            self.llm.eval([tok])
            self._n += 1
        return made

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


class ExLlamaV2Session:
    """A folder in exllamav2 (EXL2, or GPTQ through its own kernels) on the GPU, with a K/V cache of `ctx`.
    exllamav2 runs only on CUDA/ROCm: this is exercised by bench/gpu_check.py on a GPU machine."""

    def __init__(self, folder: Path, ctx: int, how: str):
        from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
        config = ExLlamaV2Config(str(folder))
        config.max_seq_len = max(ctx, 16)
        self.model = ExLlamaV2(config)
        self.model.load()
        self.cache = ExLlamaV2Cache(self.model, max_seq_len=config.max_seq_len)
        self.how, self.dtype = how, "float16"

    @torch.no_grad()
    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        self.cache.current_seq_len = 0
        # exllamav2 keeps the embedding table in CPU memory: input ids go in on the CPU
        logits = self.model.forward(torch.tensor([ids]), self.cache, last_id_only=False)
        self._last = logits[0, -1]
        return logits[0].float().cpu()

    @torch.no_grad()
    def decode(self, n: int) -> list[int]:
        made = []
        for _ in range(n):
            tok = int(self._last.argmax())
            made.append(tok)
            self._last = self.model.forward(torch.tensor([[tok]]), self.cache)[0, -1]
        return made


class VLLMSession:
    """A folder in vLLM (GPTQ or AWQ kernels) on the GPU, float16.  vLLM returns log-probabilities, not logits:
    the full vocabulary's log-probabilities of every prompt position stand in for them (the same softmax, so
    the same top-1 and KLD; max_logprobs=-1 needs a recent vLLM).  Turning every position's whole-vocabulary dict
    into a row is slow in Python (minutes for a long window and a large vocabulary): fine for verify's short text,
    slow for `eval --runtime vllm` over many windows.  Exercised by bench/gpu_check.py where vLLM is installed."""

    def __init__(self, folder: Path, ctx: int, how: str):
        from vllm import LLM
        # token ids in, no text out (no detokenizing of the vocabulary's log-probabilities); a prompt of ctx
        # tokens plus the one token vLLM must generate (it refuses a prompt that fills max_model_len)
        self.llm = LLM(model=str(folder), dtype="float16", enforce_eager=True, skip_tokenizer_init=True,
                       gpu_memory_utilization=0.4, max_model_len=max(ctx, 16) + 1, max_logprobs=-1)
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()
        self.how, self.dtype = how, "float16"

    def _row(self, logprobs: dict) -> torch.Tensor:
        row = torch.full((self.vocab,), float("-inf"))
        for tok, lp in logprobs.items():
            row[tok] = lp.logprob
        return row

    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=self.vocab, logprobs=self.vocab,
                                detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        self._ids = list(ids)
        # prompt_logprobs[k]: position k given the tokens before it (None at 0); the last position's is the output's
        rows = [self._row(d) for d in out.prompt_logprobs[1:]] + [self._row(out.outputs[0].logprobs[0])]
        return torch.stack(rows)

    def decode(self, n: int) -> list[int]:
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
        return list(self.llm.generate([{"prompt_token_ids": self._ids}], params, use_tqdm=False)[0].outputs[0].token_ids)


def first_session(loaders: list):
    """The session of the first loader that loads (the order a user would try them), for `quantkit eval
    --runtime R` on a runtime driven through sessions; the last error when none does."""
    error = None
    for _, load in loaders:
        try:
            return load()
        except Exception as e:     # this way does not load: try the next documented one
            error = e
    raise error


def session_window_logits(loaders: list, tokens: torch.Tensor):
    """Each window's logits (ctx, vocab) from the first session that loads."""
    session = first_session(loaders)
    for row in tokens:
        yield session.prompt_logits(row.tolist())

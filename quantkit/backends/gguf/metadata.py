"""GGUF metadata for a checkpoint: hyper-parameters with the exact types llama.cpp checks, and the tokenizer."""
from __future__ import annotations

import math
from hashlib import sha256
from pathlib import Path

import gguf

from ...errors import SourceError, UsageError
from ...model.checkpoint import Checkpoint
from .tensors import moe_op, sliding_layers

# llama.cpp picks its pre-tokenizer regex by name; its converter recognises a tokenizer by hashing the ids
# it gives for this probe text.  Probe and hashes are facts of llama.cpp's converter (conversion/base.py).
PRE_PROBE = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) '
             '✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
             '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
             '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
PRE_BY_HASH = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",     # Llama 3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",        # SmolLM / SmolLM2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",         # Qwen1.5 / Qwen2
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",         # Qwen3
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",        # Mistral Nemo
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",
}


def add_hparams(w: gguf.GGUFWriter, model: Checkpoint, name: str) -> None:
    """The hyper-parameter keys llama.cpp's converter writes for this model's architecture (checked against
    convert_hf_to_gguf.py in the tests)."""
    cfg, arch = model.config, model.adapter.gguf_arch
    attn = model.block(0).residuals[0].op
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    ropes = model.adapter.rope_by_layer_type(cfg) if model.adapter.rope_by_layer_type else {}
    rope = ropes.get("full_attention", attn.rope)
    if arch not in ("phi3", "gemma2"):
        w.add_rope_freq_base(rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _add_experts(w, model)
    if arch == "phi3":
        original = rope.param("original_max_position_embeddings") or cfg.raw.get("original_max_position_embeddings")
        w.add_rope_scaling_orig_ctx_len(int(original))
        w.add_rope_dimension_count(rope.dim * cfg.hidden_size // cfg.num_heads // cfg.head_dim)
        w.add_rope_freq_base(rope.theta)
        w.add_sliding_window(int(cfg.raw.get("sliding_window") or 0))
        if rope.kind == "longrope":
            scale = cfg.max_position_embeddings / int(original)
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0)
    elif arch == "gemma2":   # llama.cpp's gemma2 knows its RoPE; the softcaps and window are keys
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_attn_logit_softcapping(float(cfg.raw.get("attn_logit_softcapping") or 0.0))
        w.add_final_logit_softcapping(float(cfg.raw.get("final_logit_softcapping") or 0.0))
        w.add_sliding_window(int(cfg.raw["sliding_window"]))
    else:
        if arch == "llama":
            w.add_rope_dimension_count(cfg.head_dim)
        if arch == "gemma3":
            if "sliding_attention" in (cfg.raw.get("rope_parameters") or {}):   # as the converter: only when listed
                w.add_rope_freq_base_swa(ropes["sliding_attention"].theta)
            if cfg.raw.get("final_logit_softcapping"):
                w.add_final_logit_softcapping(float(cfg.raw["final_logit_softcapping"]))
            if cfg.raw.get("sliding_window_pattern") != 1 and cfg.raw.get("sliding_window"):
                w.add_sliding_window(int(cfg.raw["sliding_window"]))
                sliding = sliding_layers(model)
                if sliding != [i % 6 < 5 for i in range(cfg.num_layers)]:
                    # llama.cpp makes every sixth layer global unless the file lists them (its converter does not:
                    # quantkit writes the list where the checkpoint's layer_types differ, so llama.cpp runs them)
                    w.add_sliding_window_pattern(sliding)
        if cfg.head_dim != cfg.hidden_size // cfg.num_heads or cfg.raw.get("head_dim") is not None:
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)
        _add_rope_scaling(w, rope)
        if arch == "llama":
            w.add_vocab_size(cfg.vocab_size)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_experts(w: gguf.GGUFWriter, model: Checkpoint) -> None:
    op = moe_op(model, 0)
    if op is None:
        return
    w.add_expert_count(len(op.experts))
    w.add_expert_used_count(op.top_k)
    raw = model.config.raw
    if raw.get("moe_intermediate_size") is not None:            # Qwen's MoE: experts narrower than a dense MLP
        w.add_expert_feed_forward_length(int(raw["moe_intermediate_size"]))
    if raw.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(int(raw["shared_expert_intermediate_size"]))


def _add_rope_scaling(w: gguf.GGUFWriter, rope) -> None:
    p = rope.param
    if rope.kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(p("factor")))
    elif rope.kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(p("factor")))
        w.add_rope_scaling_orig_ctx_len(int(p("original_max_position_embeddings")))
        for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if p(key) is not None:
                add(float(p(key)))
    elif rope.kind == "longrope":
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)


def add_tokenizer(w: gguf.GGUFWriter, model: Checkpoint, pre_override: str | None = None) -> None:
    folder = model.folder
    if (folder / "tokenizer.model").is_file():
        _add_sentencepiece(w, model)
    elif (folder / "tokenizer.json").is_file():
        _add_bpe(w, model, pre_override)
    else:
        raise SourceError(f"{folder}: no tokenizer.json or tokenizer.model to put in the GGUF file")
    gguf.SpecialVocab(folder, load_merges=not (folder / "tokenizer.model").is_file(),
                      n_vocab=model.config.vocab_size).add_to_gguf(w, quiet=True)


def _looks_special(token: str) -> bool:
    return (token in ("<pad>", "<mask>") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>")) or (token.startswith("<unused") and token.endswith(">")))


def _add_bpe(w: gguf.GGUFWriter, model: Checkpoint, pre_override: str | None) -> None:
    # The `tokenizers` library reads tokenizer.json directly: the same ids as transformers' fast tokenizer,
    # without importing transformers (seconds of a conversion's wall time).
    from tokenizers import Tokenizer

    path = model.folder / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:      # the library's own message says what in the file it could not read
        raise SourceError(f"{path}: cannot read the tokenizer ({str(e).splitlines()[0] if str(e) else e})") from e
    if type(tok.model).__name__ != "BPE":
        raise SourceError(f"{model.folder}: tokenizer type {type(tok.model).__name__!r} is not supported for GGUF "
                          f"(byte-level BPE or SentencePiece)")
    pre = pre_override or PRE_BY_HASH.get(sha256(str(tok.encode(PRE_PROBE).ids).encode()).hexdigest())
    if pre is None:
        raise UsageError(f"{model.name}: llama.cpp's pre-tokenizer for this BPE tokenizer is not known to quantkit; "
                         f"name it with --tokenizer-pre (e.g. llama-bpe, qwen2, smollm, gpt-2)")
    vocab = tok.get_vocab(with_added_tokens=True)
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()      # what llama.cpp's converter reads from transformers
    n_vocab = model.config.vocab_size
    if max(vocab.values()) >= n_vocab:
        raise SourceError(f"{model.folder}: tokenizer has ids beyond the model's vocab_size {n_vocab}")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if i in added:
            if not added[i].normalized:  # llama.cpp expects added tokens in normalized form
                token = tok.decode(tok.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            if added[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)


def _add_sentencepiece(w: gguf.GGUFWriter, model: Checkpoint) -> None:
    vocab = gguf.SentencePieceVocab(Path(model.folder))
    tokens, scores, types = [], [], []
    for text, score, ttype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(ttype)
    n_vocab = model.config.vocab_size
    for i in range(len(tokens), n_vocab):  # embedding rows beyond the tokenizer
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    if len(tokens) > n_vocab:
        raise SourceError(f"{model.folder}: tokenizer has {len(tokens)} tokens, more than vocab_size {n_vocab}")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)

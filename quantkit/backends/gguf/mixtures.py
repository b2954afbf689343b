"""Per-tensor quantization types chosen by ``llama-quantize`` ("mixtures").

A llama.cpp file type such as ``Q4_K_M`` is not one tensor type: it is a
default type plus a set of per-tensor bumps (attention V and FFN down
projections of some layers get more bits, the output matrix gets Q6_K, ...)
and a shape fallback for rows that are not a multiple of the block size.
This module reproduces that choice for the llama family (llama, mistral,
qwen2, qwen3: all use ``blk.N.*`` tensor names) as data tables plus one pure
function, :func:`plan_types`.

Reference: llama.cpp ``src/llama-quant.cpp`` at ggml-org/llama.cpp@0c1e57098
(the copy vendored in llama-cpp-python 0.3.36); see also
``docs/formats/gguf.md`` section 5.  The recorded outputs of that version are
in ``tests/data/gguf_mixture_expected.json`` and checked by
``tests/test_gguf_mixtures.py``.

Behaviour worth knowing (all as in llama.cpp):

* Tensors are *visited* in llama.cpp's loader order (non-``blk.`` tensors
  first, then by numeric block index, then by name), whatever order the
  caller passes; the result list keeps the caller's order.
* The attention-V counter (``i_attention_wv``) and the FFN counters advance
  only for tensors that go through the mixture rules: a tensor matched by an
  ``overrides`` pattern (or any tensor under ``pure``) does not advance them,
  which shifts the layer index seen by the following tensors.  For dense
  models the FFN "layer" is that counter, not the number in the name; for
  MoE models (``n_expert > 1``) the layer is parsed from the name.
* Embeddings are tied exactly when no tensor named ``output.weight`` is
  present; then ``token_embd.weight`` gets the output tensor's rule.
* Overrides (``--tensor-type``) and all rules apply only when the file
  type's default type is a quantized type: F16/BF16/F32 files ignore them.
* Without ``has_imatrix`` the importance-matrix-dependent branches (IQ4,
  Q4_0/Q5_0 ``ffn_down``, IQ3_XXS) take their "no imatrix" side.
* The 70B bump (attn_v Q3_K/Q4_K -> Q5_K) is applied for 80-layer models
  with grouped-query attention and ``n_expert != 8`` (llama's rule; qwen2
  also marks 80-layer MHA models as 70B, which cannot be told apart here).
* Falcon-only rules and the MXFP4/NVFP4/Q1_0/Q2_0 file types are out of
  scope.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

__all__ = [
    "FILE_TYPES",
    "FILE_TYPE_ALIASES",
    "FileTypeSpec",
    "TensorChoice",
    "plan_types",
    "resolve_file_type",
    "parse_ggml_type",
    "tensor_category",
    "allows_quantization",
    "use_more_bits",
    "requires_imatrix",
]

Q = GGMLQuantizationType


# --------------------------------------------------------------------------
# File types
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class FileTypeSpec:
    """One ``llama-quantize`` file type."""

    name: str                   # CLI name, e.g. "Q4_K_M"
    default_type: GGMLQuantizationType
    file_type: LlamaFileType    # value written to general.file_type (u32)
    description: str

    @property
    def quantized(self) -> bool:
        """True when the default type is a block-quantized type (rules apply)."""
        return self.default_type not in (Q.F32, Q.F16, Q.BF16)


def _ft(name: str, default: Q, ftype: LlamaFileType, desc: str) -> tuple[str, FileTypeSpec]:
    return name, FileTypeSpec(name, default, ftype, desc)


FILE_TYPES: dict[str, FileTypeSpec] = dict([
    _ft("Q2_K", Q.Q2_K, LlamaFileType.MOSTLY_Q2_K, "2-bit K-quant mix: Q2_K, attn_v Q3_K/Q4_K, ffn_down and attn_output Q3_K"),
    _ft("Q3_K_S", Q.Q3_K, LlamaFileType.MOSTLY_Q3_K_S, "3-bit K-quant, Q3_K nearly everywhere"),
    _ft("Q3_K_M", Q.Q3_K, LlamaFileType.MOSTLY_Q3_K_M, "3-bit K-quant mix: attn_v/ffn_down/attn_output raised to Q4_K/Q5_K"),
    _ft("Q3_K_L", Q.Q3_K, LlamaFileType.MOSTLY_Q3_K_L, "3-bit K-quant mix: attn_v/ffn_down/attn_output Q5_K"),
    _ft("Q4_0", Q.Q4_0, LlamaFileType.MOSTLY_Q4_0, "legacy 4-bit, 32-element blocks with one scale"),
    _ft("Q4_1", Q.Q4_1, LlamaFileType.MOSTLY_Q4_1, "legacy 4-bit, 32-element blocks with scale and minimum"),
    _ft("Q5_0", Q.Q5_0, LlamaFileType.MOSTLY_Q5_0, "legacy 5-bit, 32-element blocks with one scale"),
    _ft("Q5_1", Q.Q5_1, LlamaFileType.MOSTLY_Q5_1, "legacy 5-bit, 32-element blocks with scale and minimum"),
    _ft("Q4_K_S", Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_S, "4-bit K-quant, first layers' attn_v/ffn_down Q5_K"),
    _ft("Q4_K_M", Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M, "4-bit K-quant mix: half of attn_v/ffn_down Q6_K"),
    _ft("Q5_K_S", Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_S, "5-bit K-quant, Q5_K nearly everywhere"),
    _ft("Q5_K_M", Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_M, "5-bit K-quant mix: half of attn_v/ffn_down Q6_K"),
    _ft("Q6_K", Q.Q6_K, LlamaFileType.MOSTLY_Q6_K, "6-bit K-quant everywhere"),
    _ft("Q8_0", Q.Q8_0, LlamaFileType.MOSTLY_Q8_0, "8-bit, 32-element blocks, output kept Q8_0"),
    _ft("IQ4_NL", Q.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL, "4-bit non-linear grid, 32-element blocks"),
    _ft("IQ4_XS", Q.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS, "4-bit non-linear grid, 256-element super-blocks"),
    _ft("Q2_K_S", Q.Q2_K, LlamaFileType.MOSTLY_Q2_K_S, "2-bit K-quant, first eighth's ffn_down Q4_K (importance matrix required)"),
    _ft("IQ3_M", Q.IQ3_S, LlamaFileType.MOSTLY_IQ3_M, "3.4-bit lattice mix: attn_v/attn_output/first ffn_down Q4_K"),
    _ft("IQ3_S", Q.IQ3_S, LlamaFileType.MOSTLY_IQ3_S, "3.4-bit lattice (IQ3_S) nearly everywhere"),
    _ft("IQ3_XS", Q.IQ3_S, LlamaFileType.MOSTLY_IQ3_XS, "3.3-bit lattice mix: IQ3_S with IQ3_XXS in the middle layers"),
    _ft("IQ3_XXS", Q.IQ3_XXS, LlamaFileType.MOSTLY_IQ3_XXS, "3.06-bit lattice (importance matrix required)"),
    _ft("IQ2_M", Q.IQ2_S, LlamaFileType.MOSTLY_IQ2_M, "2.7-bit lattice mix, IQ2_S (importance matrix required)"),
    _ft("IQ2_S", Q.IQ2_XS, LlamaFileType.MOSTLY_IQ2_S, "2.5-bit lattice mix, IQ2_XS (importance matrix required)"),
    _ft("IQ2_XS", Q.IQ2_XS, LlamaFileType.MOSTLY_IQ2_XS, "2.31-bit lattice (importance matrix required)"),
    _ft("IQ2_XXS", Q.IQ2_XXS, LlamaFileType.MOSTLY_IQ2_XXS, "2.06-bit lattice (importance matrix required)"),
    _ft("IQ1_M", Q.IQ1_M, LlamaFileType.MOSTLY_IQ1_M, "1.75-bit lattice (importance matrix required)"),
    _ft("IQ1_S", Q.IQ1_S, LlamaFileType.MOSTLY_IQ1_S, "1.56-bit lattice (importance matrix required)"),
    _ft("TQ1_0", Q.TQ1_0, LlamaFileType.MOSTLY_TQ1_0, "ternary 1.69 bpw, for ternary-trained models (BitNet b1.58, TriLM)"),
    _ft("TQ2_0", Q.TQ2_0, LlamaFileType.MOSTLY_TQ2_0, "ternary 2.06 bpw, for ternary-trained models (BitNet b1.58, TriLM)"),
    _ft("F16", Q.F16, LlamaFileType.MOSTLY_F16, "IEEE half precision, no quantization"),
    _ft("BF16", Q.BF16, LlamaFileType.MOSTLY_BF16, "bfloat16, no quantization"),
    _ft("F32", Q.F32, LlamaFileType.ALL_F32, "single precision, no quantization"),
])

# llama-quantize accepts these short names as well.
FILE_TYPE_ALIASES: dict[str, str] = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}


def resolve_file_type(file_type: str) -> FileTypeSpec:
    """Look a file type up by CLI name (case-insensitive, aliases allowed)."""
    key = str(file_type).strip().upper()
    key = FILE_TYPE_ALIASES.get(key, key)
    spec = FILE_TYPES.get(key)
    if spec is None:
        valid = ", ".join(FILE_TYPES)
        aliases = ", ".join(f"{a}={b}" for a, b in FILE_TYPE_ALIASES.items())
        raise ValueError(f"unknown GGUF file type {file_type!r}; valid: {valid} (aliases: {aliases})")
    return spec


def parse_ggml_type(name: str | GGMLQuantizationType) -> GGMLQuantizationType:
    """ggml type from its name, case-insensitively ("q4_k", "Q8_0", "bf16")."""
    if isinstance(name, GGMLQuantizationType):
        return name
    key = str(name).strip().upper()
    try:
        return Q[key]
    except KeyError:
        raise ValueError(f"unknown ggml type {name!r}; valid: {', '.join(t.name for t in Q)}") from None


def _block(t: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[t][0]


# --------------------------------------------------------------------------
# Which tensors are quantized at all
# --------------------------------------------------------------------------

# A 2-D+ tensor whose name ends in "weight" is quantized unless its name
# contains one of these pieces (llama.cpp tensor_allows_quantization; the
# GLM5-next specific exclusions are left out).
_NEVER_QUANTIZED_SUBSTRINGS: tuple[str, ...] = (
    "_norm.weight",              # norms
    "ffn_gate_inp.weight",       # MoE router
    "ffn_gate_tid2eid.weight",   # token-id -> expert table
    "altup", "laurel",           # tiny gemma3n matrices
    "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight",
    "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
    "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight",
    "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos",
    ".patch_embd", ".patch_merger",
    "a.rvq.codebook", "mm.a.code_embd",
)
# ... and these exact names (positional / token-type embeddings).
_NEVER_QUANTIZED_NAMES: frozenset[str] = frozenset({"position_embd.weight", "token_types.weight"})


def _n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims: trailing dimensions of size 1 do not count (minimum 1)."""
    n = len(shape)
    while n > 1 and int(shape[n - 1]) == 1:
        n -= 1
    return max(n, 1)


def allows_quantization(name: str, shape: Sequence[int]) -> bool:
    """Whether llama-quantize converts this tensor at all (else it is copied)."""
    if _n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    if name in _NEVER_QUANTIZED_NAMES:
        return False
    return not any(s in name for s in _NEVER_QUANTIZED_SUBSTRINGS)


# --------------------------------------------------------------------------
# Tensor categories (first match wins, substring tests on the name)
# --------------------------------------------------------------------------

_CATEGORY_BY_SUBSTRING: tuple[tuple[str, str], ...] = (
    ("attn_qkv.weight", "attn_v"),     # fused QKV is treated like attn_v
    ("attn_kv_b.weight", "attn_v"),    # MLA kv_b is treated like attn_v
    ("attn_v.weight", "attn_v"),
    ("attn_k.weight", "attn_k"),
    ("attn_q.weight", "attn_q"),
    ("attn_output.weight", "attn_output"),
    ("ffn_up", "ffn_up"),
    ("ffn_gate", "ffn_gate"),
    ("ffn_down", "ffn_down"),
)
_TOKEN_EMBD_NAMES = frozenset({"token_embd.weight", "per_layer_token_embd.weight"})


def tensor_category(name: str) -> str:
    """Coarse role of a tensor: output, token_embd, attn_v, attn_k, attn_q,
    attn_output, ffn_up, ffn_gate, ffn_down or other."""
    if name == "output.weight":
        return "output"
    if name in _TOKEN_EMBD_NAMES:
        return "token_embd"
    for piece, cat in _CATEGORY_BY_SUBSTRING:
        if piece in name:
            return cat
    return "other"


# types whose rounding is garbage without an importance matrix, so that llama-quantize refuses them without one
_NEEDS_IMATRIX = frozenset({Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M, Q.IQ1_S})


def requires_imatrix(name: str, qtype: GGMLQuantizationType, file_type: str) -> bool:
    """Whether llama-quantize refuses to write tensor `name` as `qtype` without its importance vector
    (llama-quant.cpp, tensor_requires_imatrix): the very low-bit IQ types, and Q2_K inside a Q2_K_S file;
    never the embedding or the output head."""
    if tensor_category(name) in ("output", "token_embd"):
        return False
    return qtype in _NEEDS_IMATRIX or (qtype == Q.Q2_K and file_type.upper() == "Q2_K_S")


# --------------------------------------------------------------------------
# Mixture rules
# --------------------------------------------------------------------------


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's "give this layer more bits" pattern: the first and last
    eighth of the layers and every third layer in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(frozen=True)
class _Ctx:
    i_layer: int        # layer index as llama.cpp sees it (counter or parsed)
    n_layer: int
    i_wv: int           # attention-V counter before this tensor
    n_wv: int           # number of attention-V-like tensors in the model
    n_gqa: int
    n_expert: int
    is_70b: bool
    has_imatrix: bool = False   # llama-quantize given an importance matrix
    i_count: int = -1   # the category's own counter before this tensor (ffn_*: llama.cpp's i_ffn_down ...)


# condition label -> predicate; the label is what ends up in TensorChoice.reason
_CONDITIONS: dict[str, Callable[[_Ctx], bool]] = {
    "always": lambda c: True,
    "n_gqa>=4": lambda c: c.n_gqa >= 4,
    "i_attention_wv<2": lambda c: c.i_wv < 2,
    "i_attention_wv<4": lambda c: c.i_wv < 4,
    "use_more_bits(i_attention_wv)": lambda c: use_more_bits(c.i_wv, c.n_wv),
    "layer<n/8": lambda c: c.i_layer < c.n_layer // 8,
    "layer<n/8 without imatrix": lambda c: c.i_layer < c.n_layer // 8 and not c.has_imatrix,
    "layer<n/8 with imatrix": lambda c: c.i_layer < c.n_layer // 8 and c.has_imatrix,
    "layer<n/16": lambda c: c.i_layer < c.n_layer // 16,
    "use_more_bits(layer)": lambda c: use_more_bits(c.i_layer, c.n_layer),
    "n_expert==8": lambda c: c.n_expert == 8,
    "n_expert!=8": lambda c: c.n_expert != 8,
    "n_gqa>=4 or n_expert>=4": lambda c: c.n_gqa >= 4 or c.n_expert >= 4,
    "without imatrix": lambda c: not c.has_imatrix,
    "count<n/8": lambda c: c.i_count < c.n_layer // 8,
    "n/8<=layer<7n/8": lambda c: c.n_layer // 8 <= c.i_layer < 7 * c.n_layer // 8,
    "layer<n/8 or 8 experts and use_more_bits(layer)":
        lambda c: c.i_layer < c.n_layer // 8 or (c.n_expert == 8 and use_more_bits(c.i_layer, c.n_layer)),
}

_ANY = frozenset(FILE_TYPES)

def _describe(cond: str, c: _Ctx) -> str:
    """Condition label with the values it was evaluated on (for reasons)."""
    if cond == "always":
        return ""
    if "attention_wv" in cond:
        return f"{cond} [{c.i_wv}/{c.n_wv}] "
    if "layer" in cond:
        return f"{cond} [{c.i_layer}/{c.n_layer}] "
    if "count" in cond:
        return f"{cond} [{c.i_count}/{c.n_layer}] "
    return f"{cond} "


# category -> ordered rows (file types, condition, new type).  The first row
# whose file type set contains the file type and whose condition holds wins;
# when no row matches the default type is kept.
_Rows = tuple[tuple[frozenset[str], str, GGMLQuantizationType], ...]
# an untied token_embd (a tied one follows the output rule)
_TOKEN_EMBD: _Rows = (
    (frozenset({"IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"}), "always", Q.Q2_K),
    (frozenset({"IQ2_S", "IQ2_M", "IQ3_XXS"}), "always", Q.IQ3_S),
    (frozenset({"TQ1_0", "TQ2_0"}), "always", Q.Q4_K),
)
_RULES: dict[str, _Rows] = {
    "token_embd": _TOKEN_EMBD,
    "attn_v": (
        (frozenset({"Q2_K"}), "n_gqa>=4", Q.Q4_K),
        (frozenset({"Q2_K"}), "always", Q.Q3_K),
        (frozenset({"Q2_K_S", "IQ3_XXS", "IQ3_XS", "IQ3_S"}), "n_gqa>=4", Q.Q4_K),
        (frozenset({"IQ3_XXS"}), "without imatrix", Q.IQ3_S),
        (frozenset({"IQ3_M"}), "always", Q.Q4_K),
        (frozenset({"Q3_K_M"}), "i_attention_wv<2", Q.Q5_K),
        (frozenset({"Q3_K_M"}), "always", Q.Q4_K),
        (frozenset({"Q3_K_L"}), "always", Q.Q5_K),
        (frozenset({"IQ4_NL", "IQ4_XS"}), "n_gqa>=4", Q.Q5_K),
        (frozenset({"Q4_K_M", "Q5_K_M"}), "use_more_bits(i_attention_wv)", Q.Q6_K),
        (frozenset({"Q4_K_S"}), "i_attention_wv<4", Q.Q5_K),
    ),
    "attn_k": (
        (_ANY, "n_expert==8", Q.Q8_0),
        (frozenset({"IQ3_XS"}), "always", Q.IQ3_XXS),
        (frozenset({"IQ3_XXS"}), "always", Q.IQ2_S),
    ),
    "attn_q": (
        (frozenset({"IQ3_XS"}), "always", Q.IQ3_XXS),
        (frozenset({"IQ3_XXS"}), "always", Q.IQ2_S),
    ),
    "ffn_down": (
        (frozenset({"Q2_K"}), "always", Q.Q3_K),
        (frozenset({"Q2_K_S"}), "layer<n/8", Q.Q4_K),
        (frozenset({"IQ3_XXS"}), "layer<n/8 without imatrix", Q.Q4_K),
        (frozenset({"IQ3_XXS"}), "without imatrix", Q.Q3_K),
        (frozenset({"IQ3_M"}), "layer<n/8 or 8 experts and use_more_bits(layer)", Q.Q4_K),
        (frozenset({"Q3_K_M"}), "layer<n/16", Q.Q5_K),
        (frozenset({"Q3_K_M"}), "always", Q.Q4_K),
        (frozenset({"Q3_K_L"}), "always", Q.Q5_K),
        (frozenset({"Q4_K_M", "Q5_K_M"}), "use_more_bits(layer)", Q.Q6_K),
        (frozenset({"IQ4_NL", "IQ4_XS"}), "layer<n/8 without imatrix", Q.Q5_K),
        (frozenset({"Q4_K_S"}), "layer<n/8", Q.Q5_K),
        # with an importance matrix llama-quantize guards the first eighth's ffn_down with the type's min variant
        (frozenset({"Q4_0"}), "layer<n/8 with imatrix", Q.Q4_1),
        (frozenset({"Q5_0"}), "layer<n/8 with imatrix", Q.Q5_1),
    ),
    "attn_output": (
        (frozenset({"Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ3_M",
                    "IQ4_XS"}), "n_expert==8", Q.Q5_K),
        (frozenset({"Q2_K"}), "n_expert!=8", Q.Q3_K),
        (frozenset({"IQ3_XXS"}), "n_expert!=8", Q.IQ3_S),
        (frozenset({"IQ3_M"}), "n_expert!=8", Q.Q4_K),
        (frozenset({"Q3_K_M"}), "n_expert!=8", Q.Q4_K),
        (frozenset({"Q3_K_L"}), "n_expert!=8", Q.Q5_K),
    ),
    "ffn_gate": ((frozenset({"IQ3_XS"}), "n/8<=layer<7n/8", Q.IQ3_XXS),),
    "ffn_up": ((frozenset({"IQ3_XS"}), "n/8<=layer<7n/8", Q.IQ3_XXS),),
}

# The lowest-bit file types have rules of their own, which replace the table above (llama-quant.cpp's branch
# for them); attn_v then gets neither the 70B nor the 8-expert bump, and ffn_down counts its tensors.
_LOW_BIT = frozenset({"IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"})
_LOW_BIT_RULES: dict[str, _Rows] = {
    "token_embd": _TOKEN_EMBD,
    "attn_v": (
        (_LOW_BIT, "n_gqa>=4 or n_expert>=4", Q.Q4_K),
        (frozenset({"IQ2_S", "IQ2_M"}), "always", Q.IQ3_S),
        (_LOW_BIT, "always", Q.Q2_K),
    ),
    "attn_k": ((_LOW_BIT, "n_expert==8", Q.Q4_K),),
    "ffn_down": (
        (frozenset({"IQ2_S", "IQ2_M"}), "count<n/8", Q.IQ3_S),
        (_LOW_BIT, "count<n/8", Q.Q2_K),
    ),
    "attn_output": (
        (_LOW_BIT, "n_expert==8", Q.Q5_K),
        (frozenset({"IQ1_S", "IQ1_M"}), "always", Q.IQ2_XXS),
        (frozenset({"IQ2_S", "IQ2_M"}), "always", Q.IQ3_S),
    ),
}
# an output tensor (or tied token_embd) of these file types is Q5_K rather than Q6_K
_OUTPUT_Q5_K = _LOW_BIT | {"IQ3_XXS"}

# Applied to attn_v-like tensors after the table above, in this order:
# (condition, types it applies to (None = any), new type, label)
_ATTN_V_AFTER: tuple[tuple[Callable[[_Ctx], bool], frozenset[GGMLQuantizationType] | None, GGMLQuantizationType, str], ...] = (
    (lambda c: c.is_70b, frozenset({Q.Q3_K, Q.Q4_K}), Q.Q5_K, "70B attn_v"),
    (lambda c: c.n_expert == 8, None, Q.Q8_0, "8-expert attn_v"),
)

# Categories whose layer index comes from a per-category counter (dense) or
# from the tensor name (MoE).
_LAYER_COUNTED = ("ffn_down", "ffn_gate", "ffn_up")

# Shape fallback when ne[0] is not a multiple of the chosen type's block.
_FALLBACK: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    Q.IQ1_S: Q.IQ4_NL, Q.IQ1_M: Q.IQ4_NL, Q.IQ2_XXS: Q.IQ4_NL, Q.IQ2_XS: Q.IQ4_NL,
    Q.IQ2_S: Q.IQ4_NL, Q.IQ3_XXS: Q.IQ4_NL, Q.IQ3_S: Q.IQ4_NL, Q.IQ4_XS: Q.IQ4_NL,
    Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.TQ1_0: Q.Q4_0, Q.TQ2_0: Q.Q4_0,
    Q.Q4_K: Q.Q5_0,
    Q.Q5_K: Q.Q5_1,
    Q.Q6_K: Q.Q8_0,
}


def _shape_fallback(qtype: GGMLQuantizationType, ne0: int) -> tuple[GGMLQuantizationType, str | None]:
    block = _block(qtype)
    if ne0 % block == 0:
        return qtype, None
    if qtype in _FALLBACK:
        new = _FALLBACK[qtype]
    elif block <= 32:
        new = qtype      # nothing smaller to fall back to: goes to F16 below
    else:
        raise ValueError(f"no shape fallback defined for type {qtype.name}")
    if ne0 % _block(new) != 0:
        new = Q.F16
    return new, f"fallback {ne0} % {block} -> {new.name}"


# --------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------


@dataclass
class TensorChoice:
    name: str
    qtype: GGMLQuantizationType
    reason: str


# llama.cpp reads the block number with sscanf("blk.%d."), which yields the
# number even when the dot after it is missing.
_BLK_RE = re.compile(r"blk\.([+-]?\d+)")


def _loader_layer(name: str) -> int:
    m = _BLK_RE.match(name)
    return int(m.group(1)) if m else -1


def _compile_overrides(overrides: Iterable[tuple[str, str]]) -> list[tuple[str, re.Pattern[str], GGMLQuantizationType]]:
    compiled = []
    for item in overrides or ():
        if isinstance(item, str):
            pattern, sep, tname = item.partition("=")
            if not sep:
                raise ValueError(f"malformed tensor type override {item!r}; expected REGEX=TYPE")
        else:
            pattern, tname = item
        if not pattern:
            raise ValueError("tensor type override with an empty pattern")
        # llama-quantize lower-cases the pattern before compiling it
        pat = pattern.lower()
        try:
            rx = re.compile(pat)
        except re.error as exc:
            raise ValueError(f"invalid tensor type override pattern {pattern!r}: {exc}") from None
        compiled.append((pattern, rx, parse_ggml_type(tname)))
    return compiled


def plan_types(
    tensors: list[tuple[str, tuple[int, ...]]],
    file_type: str,
    *,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    n_expert: int = 0,
    tied_embeddings: bool = False,
    overrides: list[tuple[str, str]] = (),
    pure: bool = False,
    has_imatrix: bool = False,
) -> list[TensorChoice]:
    """Per-tensor ggml types that ``llama-quantize`` picks for ``file_type``.

    ``tensors``: every tensor of the file as (GGUF name, GGUF shape with
    ne[0] = row length first).  The whole list is needed: the attention-V
    count and the presence of ``output.weight`` influence other tensors.
    ``overrides``: ``--tensor-type`` pairs (regex, type name); the first
    pattern found (``re.search``) in a name wins.  ``pure``: ``--pure``.  ``has_imatrix``: an importance
    matrix is given (some ffn_down choices depend on it).

    Tensors that are not quantized (1-D, norms, routers, ...) are reported as
    F32 (what the converter writes for them).  Returns one
    :class:`TensorChoice` per input tensor, in input order.
    """
    spec = resolve_file_type(file_type)
    ftype = spec.name
    default = spec.default_type
    if n_layer <= 0:
        raise ValueError(f"n_layer must be positive, got {n_layer}")

    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dup}")
    has_output = "output.weight" in names
    if tied_embeddings and has_output:
        raise ValueError("tied_embeddings=True but an output.weight tensor is present; "
                         "llama-quantize would treat the embeddings as untied")
    # llama.cpp decides from the tensor list alone
    tied = not has_output

    rules_on = spec.quantized
    # parsed (and so validated) always, applied only to quantized file types
    patterns = _compile_overrides(overrides)

    n_gqa = n_head // n_head_kv if n_head_kv else 0
    is_70b = n_layer == 80 and n_head != n_head_kv and n_expert != 8
    n_wv = sum(1 for n in names if tensor_category(n) == "attn_v")
    i_wv = 0
    counters = {c: 0 for c in _LAYER_COUNTED}

    order = sorted(range(len(tensors)), key=lambda k: (_loader_layer(names[k]), names[k]))
    result: list[TensorChoice | None] = [None] * len(tensors)

    for k in order:
        name, shape = tensors[k]
        shape = tuple(int(x) for x in shape)
        if not allows_quantization(name, shape):
            why = "1-D" if _n_dims(shape) < 2 else "excluded"
            result[k] = TensorChoice(name, Q.F32, f"not quantized ({why})")
            continue
        if not rules_on:
            result[k] = TensorChoice(name, default, "default")
            continue

        ne0 = shape[0]
        qtype = default
        reasons: list[str] = []

        manual = None
        for pattern, rx, t in patterns:
            if rx.search(name):
                manual = (pattern, t)
                break
        if manual is not None:
            qtype = manual[1]
            reasons.append(f"override {manual[0]!r}")
        elif pure:
            reasons.append("pure")
        else:
            cat = tensor_category(name)
            # layer index as llama.cpp's per-category logic sees it
            i_count = counters.get(cat, -1)
            if cat in counters:
                if n_expert > 1:
                    m = _BLK_RE.match(name)
                    if m is None:
                        raise ValueError(f"cannot determine layer of tensor {name!r}")
                    i_layer = int(m.group(1))
                    if not 0 <= i_layer < n_layer:
                        raise ValueError(f"layer {i_layer} of tensor {name!r} outside [0, {n_layer})")
                else:
                    i_layer = counters[cat]
                counters[cat] += 1
            else:
                i_layer = -1
            ctx = _Ctx(i_layer, n_layer, i_wv, n_wv, n_gqa, n_expert, is_70b, has_imatrix, i_count)

            if cat == "output" or (cat == "token_embd" and tied):
                role = "output" if cat == "output" else "output (tied token_embd)"
                if ne0 % _block(default) != 0:
                    qtype = Q.Q8_0
                    reasons.append(f"{role}: {ne0} % {_block(default)} -> Q8_0")
                elif ftype in _OUTPUT_Q5_K:
                    qtype = Q.Q5_K
                    reasons.append(f"{role} -> Q5_K")
                elif default != Q.Q8_0:
                    qtype = Q.Q6_K
                    reasons.append(f"{role} -> Q6_K")
                else:
                    reasons.append(role)
            else:
                low_bit = ftype in _LOW_BIT
                for ftypes, cond, new in (_LOW_BIT_RULES if low_bit else _RULES).get(cat, ()):
                    if ftype in ftypes and _CONDITIONS[cond](ctx):
                        qtype = new
                        reasons.append(f"{cat} {_describe(cond, ctx)}-> {new.name}")
                        break
                if cat == "attn_v":
                    for cond_fn, only, new, label in () if low_bit else _ATTN_V_AFTER:
                        if cond_fn(ctx) and (only is None or qtype in only):
                            qtype = new
                            reasons.append(f"{label} -> {new.name}")
                    i_wv += 1
            if not reasons:
                reasons.append("default")

        qtype, fb = _shape_fallback(qtype, ne0)
        if fb:
            reasons.append(fb)
        result[k] = TensorChoice(name, qtype, ", ".join(reasons))

    return [c for c in result if c is not None]

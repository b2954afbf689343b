"""Llama family: Llama 2/3, Mistral, SmolLM and other models that share the llama layout."""
from .base import ArchAdapter, InputGroup

ATTN_IN = InputGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
ATTN_OUT = InputGroup(None, ("self_attn.o_proj",))
MLP_IN = InputGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))
MLP_OUT = InputGroup(None, ("mlp.down_proj",))

ADAPTER = ArchAdapter(
    family="llama",
    model_types=("llama", "mistral"),
    input_groups=(ATTN_IN, ATTN_OUT, MLP_IN, MLP_OUT),
    norms=("input_layernorm", "post_attention_layernorm"),
)

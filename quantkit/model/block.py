"""The block description: a decoder layer written down as data.

A family's adapter turns a config into one `Block` per layer: an ordered tuple of `Residual` sub-blocks, each
a pre-norm, one operation (attention, a gated MLP or a mixture of experts) and optionally a norm of the
operation's output, added back to the residual stream.  Everything a family does differently — RoPE kind,
biases, q/k norms, sliding windows, softcaps, the activation, `1 + w` norms, router settings — is a field
here, so the engine (`quantkit.model.engine`) is one piece of code for every family, and every consumer of a
layer (eval, the capture pass, the formats' writers and readers) sees the same list of linears.

Names are relative to the layer prefix and carry no ".weight" suffix ("self_attn.q_proj").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class Norm:
    """RMSNorm over the last dimension: x / rms(x) · w, or · (1 + w) with `unit_offset` (Gemma)."""
    weight: str
    eps: float
    unit_offset: bool = False


@dataclass(frozen=True)
class InputGroup:
    """Linears that read the same input.  `producer` makes that input: a `Norm`'s weight, or the linear whose
    output channels become the input's channels (v_proj for o_proj, up_proj for down_proj), or None where no
    single op does (routed expert inputs share the MoE block's norm with every other expert)."""
    linears: tuple[str, ...]
    producer: str | None = None
    producer_kind: str = "none"   # "norm", "norm+1" (a unit-offset norm), "linear" or "none"


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding: `theta`, the rotated width `dim` (≤ head_dim, partial rotary), and a scaling
    rule as sorted (key, value) pairs of the config's rope parameters (rope_type default/linear/llama3/yarn/
    longrope/dynamic)."""
    theta: float
    dim: int
    scaling: tuple[tuple[str, object], ...] = ()
    max_positions: int = 2048

    @property
    def kind(self) -> str:
        return str(dict(self.scaling).get("rope_type", "default"))

    def param(self, key: str, default=None):
        return dict(self.scaling).get(key, default)


@dataclass(frozen=True)
class Attention:
    q: str
    k: str
    v: str
    o: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Rope
    qkv_bias: bool = False
    o_bias: bool = False
    q_norm: Norm | None = None            # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma3)
    k_norm: Norm | None = None
    window: int | None = None             # sliding-window attention: a token sees the last `window` positions
    softcap: float | None = None          # attention logits → softcap · tanh(logits / softcap) (Gemma2)
    scale: float | None = None            # query scaling; None = head_dim ** -0.5

    @property
    def stages(self) -> tuple[tuple[InputGroup, ...], ...]:
        return ((InputGroup((self.q, self.k, self.v)),), (InputGroup((self.o,), self.v, "linear"),))

    def tensors(self) -> list[str]:
        names = [f"{n}.weight" for n in (self.q, self.k, self.v, self.o)]
        if self.qkv_bias:
            names += [f"{n}.bias" for n in (self.q, self.k, self.v)]
        if self.o_bias:
            names.append(f"{self.o}.bias")
        names += [f"{n.weight}.weight" for n in (self.q_norm, self.k_norm) if n is not None]
        return names


@dataclass(frozen=True)
class GatedMLP:
    """down(act(gate(x)) · up(x)); act is "silu" or "gelu_tanh"."""
    gate: str
    up: str
    down: str
    act: str = "silu"

    @property
    def stages(self) -> tuple[tuple[InputGroup, ...], ...]:
        return ((InputGroup((self.gate, self.up)),), (InputGroup((self.down,), self.up, "linear"),))

    def tensors(self) -> list[str]:
        return [f"{n}.weight" for n in (self.gate, self.up, self.down)]


@dataclass(frozen=True)
class MoE:
    """A mixture of experts: `router` (a linear to one logit per expert, kept unquantized) picks `top_k` experts
    per token from the softmax of its logits (renormalised over the chosen ones when `renormalize`); each chosen
    expert's output is weighted by its probability.  An optional `shared` expert sees every token, scaled by
    sigmoid(`shared_gate`(x)) (Qwen2-MoE)."""
    router: str
    experts: tuple[GatedMLP, ...]
    top_k: int
    renormalize: bool
    shared: GatedMLP | None = None
    shared_gate: str | None = None

    @property
    def _all(self) -> tuple[GatedMLP, ...]:
        return self.experts + ((self.shared,) if self.shared else ())

    @property
    def stages(self) -> tuple[tuple[InputGroup, ...], ...]:
        """Every expert's gate/up (routed tokens), then every expert's down; the shared expert last in each."""
        return (tuple(InputGroup((e.gate, e.up)) for e in self._all),
                tuple(InputGroup((e.down,), e.up, "linear") for e in self._all))

    def tensors(self) -> list[str]:
        names = [f"{self.router}.weight"] + [n for e in self._all for n in e.tensors()]
        return names + ([f"{self.shared_gate}.weight"] if self.shared_gate else [])


@dataclass(frozen=True)
class Residual:
    """h ← h + post_norm(op(norm(h)))."""
    norm: Norm
    op: Attention | GatedMLP | MoE
    post_norm: Norm | None = None
    name: str = ""                        # "attention", "mlp", "moe": how reports and jobs refer to it

    @cached_property
    def stages(self) -> tuple[tuple[InputGroup, ...], ...]:
        """The op's input groups in true-sequential order, stage by stage; a first stage's groups read the
        pre-norm's output, so the norm is their producer."""
        kind = "norm+1" if self.norm.unit_offset else "norm"
        first, *rest = self.op.stages
        if isinstance(self.op, MoE):   # the norm feeds every expert: no one group's input is its alone to scale
            return (first, *rest)
        first = tuple(InputGroup(g.linears, self.norm.weight, kind) if g.producer is None else g for g in first)
        return (first, *rest)

    def tensors(self) -> list[str]:
        norms = [self.norm] + ([self.post_norm] if self.post_norm else [])
        return self.op.tensors() + [f"{n.weight}.weight" for n in norms]


@dataclass(frozen=True)
class Block:
    residuals: tuple[Residual, ...]

    @cached_property
    def groups(self) -> tuple[InputGroup, ...]:
        return tuple(g for r in self.residuals for stage in r.stages for g in stage)

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for g in self.groups for name in g.linears)

    def tensor_names(self) -> list[str]:
        return [n for r in self.residuals for n in r.tensors()]

    def expected_shapes(self, hidden: int) -> dict[str, tuple[int | str, ...]]:
        """Each tensor's shape as the description implies it; a str is a width the config does not fix (an
        MLP's intermediate size) that must be the same wherever it appears."""
        want: dict[str, tuple[int | str, ...]] = {}

        def mlp(m: GatedMLP) -> None:
            width = f"intermediate size of {m.up}"
            want.update({f"{m.gate}.weight": (width, hidden), f"{m.up}.weight": (width, hidden),
                         f"{m.down}.weight": (hidden, width)})
        for r in self.residuals:
            for norm in (r.norm, r.post_norm):
                if norm is not None:
                    want[f"{norm.weight}.weight"] = (hidden,)
            op = r.op
            if isinstance(op, Attention):
                q, kv = op.num_heads * op.head_dim, op.num_kv_heads * op.head_dim
                want.update({f"{op.q}.weight": (q, hidden), f"{op.k}.weight": (kv, hidden),
                             f"{op.v}.weight": (kv, hidden), f"{op.o}.weight": (hidden, q),
                             f"{op.q}.bias": (q,), f"{op.k}.bias": (kv,), f"{op.v}.bias": (kv,), f"{op.o}.bias": (hidden,)})
                for norm in (op.q_norm, op.k_norm):
                    if norm is not None:
                        want[f"{norm.weight}.weight"] = (op.head_dim,)
            elif isinstance(op, GatedMLP):
                mlp(op)
            else:
                want[f"{op.router}.weight"] = (len(op.experts), hidden)
                for e in op._all:
                    mlp(e)
                if op.shared_gate:
                    want[f"{op.shared_gate}.weight"] = (1, hidden)
        return want

    def shape_problem(self, shapes: dict[str, tuple[int, ...]], hidden: int) -> str | None:
        """The first tensor (name -> shape) whose shape contradicts the description (and so the config), in words."""
        widths: dict[str, int] = {}
        for name, shape in self.expected_shapes(hidden).items():
            got = shapes.get(name)
            if got is None:
                continue
            got = tuple(got)
            fixed = tuple(widths.setdefault(d, g) if isinstance(d, str) else d for d, g in zip(shape, got))
            if len(got) != len(shape) or got != fixed:
                return f"{name} has shape {list(got)} where the config implies {list(fixed) if len(got) == len(shape) else list(shape)}"
        return None

    def residual_of(self, group: InputGroup) -> Residual:
        for r in self.residuals:
            if any(group in stage for stage in r.stages):
                return r
        raise KeyError(group.linears)


@dataclass(frozen=True)
class ModelPieces:
    """What sits outside the decoder layers: the embedding (times `embed_scale`, Gemma's √hidden), the final
    norm, the head (tied to the embedding when the checkpoint has none) and a final logit softcap."""
    embed: str
    final_norm: Norm
    lm_head: str
    embed_scale: float | None = None
    logit_softcap: float | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

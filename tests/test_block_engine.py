"""The block description and its engine, held to transformers: every family's forward, the inputs the capture
pass hands each group (with earlier groups replaced), and the layer context's abilities (re-run a sub-block,
fold a scale into the producer of an input, passes)."""
import pytest
import torch

from conftest import LLAMA3_ROPE, make_checkpoint
from quantkit.calibration.capture import run_capture
from quantkit.calibration.context import paired_spans, reference_samples, reference_share
from quantkit.calibration.jobs import ArtifactJob, LayerJob, PassJob
from quantkit.calibration.stats import ReferenceHessian, output_projection
from quantkit.eval.harness import window_logits
from quantkit.model.adapters import supported_model_types
from quantkit.model.checkpoint import Checkpoint
from quantkit.model.block import MoE
from quantkit.model.engine import Runtime, run_block

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}

# (model_type, config extras): several layers; sliding/global alternation where the family has it
FAMILIES = {
    "llama": ("llama", {}),
    "llama-bias": ("llama", {"attention_bias": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama-yarn": ("llama", {"rope_parameters": YARN}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                               "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}}}),
    "gemma3-multimodal": ("gemma3", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "phi3-longrope-partial": ("phi3", {"pad_token_id": 0,
                                       "original_max_position_embeddings": 32, "rope_parameters": {
                                           "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                           "long_factor": [2.0 + 0.5 * i for i in range(6)]}}),
    "phi3-window": ("phi3", {"pad_token_id": 0, "sliding_window": 8}),
    # mixtures of experts: >= 4 experts, top-2
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1,
                                "mlp_only_layers": [1]}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "norm_topk_prob": True, "head_dim": 32}),
}


def family_checkpoint(tmp_path, key, **kw):
    model_type, extra = FAMILIES[key]
    return make_checkpoint(tmp_path / key, model_type=model_type, layers=3, tokenizer=False, dtype=torch.float32,
                           **{**extra, **kw})


def hf_model(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def test_every_supported_type_has_a_forward_test():
    assert {FAMILIES[k][0] for k in FAMILIES} == set(supported_model_types())


@pytest.mark.parametrize("key", list(FAMILIES))
def test_forward_matches_transformers(tmp_path, key):
    folder = family_checkpoint(tmp_path, key)
    model = Checkpoint(folder)
    tokens = torch.randint(0, 64, (4, 80), generator=torch.Generator().manual_seed(0))  # 320 tokens
    ours = torch.stack(list(window_logits(model, tokens)))
    with torch.no_grad():
        ref = hf_model(folder)(tokens).logits
    assert (ours - ref).abs().max().item() <= 1e-3


class Recorder(PassJob):
    """Records what it observes and swaps in scaled weights, to see them propagate."""
    label = "recorder"

    def __init__(self, factor):
        self.factor, self.seen = factor, {}

    def observe(self, ctx, group, x):
        self.seen.setdefault((ctx.layer, group.linears), []).append(x.clone())

    def quantize_group(self, ctx, group):
        return {f"{n}.weight": ctx.source[f"{n}.weight"].float() * self.factor for n in group.linears}


def recorded_capture(tmp_path, key, *, factor: float, seed: int):
    """A family's checkpoint, 3 × 24 random tokens, and a Recorder that went through the capture pass on them."""
    folder = family_checkpoint(tmp_path, key)
    model = Checkpoint(folder)
    tokens = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(seed))
    rec = Recorder(factor)
    run_capture(model, tokens, [rec], device=torch.device("cpu"), compute_dtype=torch.float32)
    return folder, model, tokens, rec


def hf_layers(hf, model):
    """transformers' stack of decoder layers (the language model's, in an image-text-to-text model)."""
    return hf.get_submodule(model.adapter.layers_module or "model.layers")


def hf_group_inputs(hf, layers, tokens, layer, linear):
    """What a forward pre-hook on transformers' own module records as that linear's input."""
    module = layers[layer].get_submodule(linear)
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        hf(tokens)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("key", ["llama", "mistral-window", "qwen2-window", "qwen3", "gemma2", "gemma3",
                                 "gemma3-multimodal", "phi3-window"])
def test_capture_pass_sees_what_transformers_modules_see_with_earlier_groups_replaced(tmp_path, key):
    """Each group's inputs are those of the transformers model whose earlier groups (this layer's and every
    earlier layer's) already carry the job's weights."""
    folder, model, tokens, rec = recorded_capture(tmp_path, key, factor=0.9, seed=1)
    hf = hf_model(folder)
    layers = hf_layers(hf, model)
    # transformers' module of a linear: itself, or the joined one it is a part of (Phi-3's qkv_proj)
    module_of = lambda lin: model.fused_parts.get(f"{lin}.weight", (f"{lin}.weight",))[0].removesuffix(".weight")
    for i in range(model.num_layers):
        for group in model.block(i).groups:
            expected = hf_group_inputs(hf, layers, tokens, i, module_of(group.linears[0]))
            got = torch.cat(rec.seen[(i, group.linears)])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=f"{i} {group.linears}")
            with torch.no_grad():
                for name in {module_of(lin) for lin in group.linears}:
                    layers[i].get_submodule(name).weight.mul_(0.9)


class ReferenceRecorder(Recorder):
    """A Recorder that asks for the unquantized model's inputs beside its own."""
    reference = True

    def __init__(self, factor):
        super().__init__(factor)
        self.references = {}

    def observe(self, ctx, group, x, reference=None):
        super().observe(ctx, group, x)
        self.references.setdefault((ctx.layer, group.linears), []).append(None if reference is None else reference.clone())


@pytest.mark.parametrize("key", ["llama", "qwen2_moe"])
def test_a_reference_job_also_sees_the_unquantized_models_inputs(tmp_path, key):
    """Its own inputs are those of the model with its weights in place; the reference, for the same tokens, those
    of the untouched model — except inside a routed MoE block, where the two route tokens differly (None)."""
    folder = family_checkpoint(tmp_path, key)
    model = Checkpoint(folder)
    tokens = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(2))
    rec = ReferenceRecorder(0.9)
    run_capture(model, tokens, [rec], device=torch.device("cpu"), compute_dtype=torch.float32)
    hf = hf_model(folder)
    layers = hf_layers(hf, model)
    routed = 0
    for i in range(model.num_layers):
        for group in model.block(i).groups:
            refs = rec.references[(i, group.linears)]
            if any(r is None for r in refs):
                assert all(r is None for r in refs), "a group is paired for every batch or for none"
                assert isinstance(model.block(i).residual_of(group).op, MoE)
                routed += 1
                continue
            expected = hf_group_inputs(hf, layers, tokens, i, group.linears[0])
            torch.testing.assert_close(torch.cat(refs), expected, atol=1e-4, rtol=1e-4, msg=f"{i} {group.linears}")
    in_moe = sum(len(stage) for i in range(model.num_layers) for sub in model.block(i).residuals
                 if isinstance(sub.op, MoE) for stage in sub.stages)
    assert routed == in_moe and (in_moe > 0) == (key == "qwen2_moe")
    # and the job's own stream did move away from it (its weights were scaled)
    last = model.num_layers - 1, model.block(model.num_layers - 1).groups[0].linears
    assert not torch.allclose(torch.cat(rec.seen[last]), torch.cat(rec.references[last]), atol=1e-3)


def test_a_reference_share_pairs_the_first_windows_of_every_batch(tmp_path, monkeypatch):
    """With `reference = 0.5` the reference stream carries the first half (rounded up) of every batch's windows:
    each group's reference inputs are the unquantized model's for exactly those windows, batch after batch, while
    the job's own inputs still cover every window."""
    from quantkit.calibration import capture
    monkeypatch.setattr(capture, "batch_for", lambda seqlen: 2)
    folder = family_checkpoint(tmp_path, "llama")
    model = Checkpoint(folder)
    tokens = torch.randint(0, 64, (5, 24), generator=torch.Generator().manual_seed(4))
    rec = ReferenceRecorder(0.9)
    rec.reference = 0.5
    run_capture(model, tokens, [rec], device=torch.device("cpu"), compute_dtype=torch.float32)
    hf = hf_model(folder)
    layers = hf_layers(hf, model)
    paired = torch.tensor([0, 2, 4])        # batches {0, 1}, {2, 3}, {4}: the first window of each
    for i in range(model.num_layers):
        for group in model.block(i).groups:
            refs = rec.references[(i, group.linears)]
            assert [r.shape[0] for r in refs] == [24, 24, 24]
            assert sum(x.shape[0] for x in rec.seen[(i, group.linears)]) == 5 * 24
            expected = hf_group_inputs(hf, layers, tokens[paired], i, group.linears[0])
            torch.testing.assert_close(torch.cat(refs), expected, atol=1e-4, rtol=1e-4, msg=f"{i} {group.linears}")


def test_how_a_reference_share_is_laid_out_and_raised_for_few_tokens():
    assert [p for _, p in paired_spans(11, 4, 0.5)] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert reference_samples(11, 4, 0.5).tolist() == [0, 1, 4, 5, 8, 9]
    assert reference_samples(3, 8, 0.01).tolist() == [0]            # at least one window of each batch
    assert reference_samples(5, 2, 1.0).tolist() == [0, 1, 2, 3, 4]

    class Job(PassJob):
        reference, reference_tokens = 0.5, 1000
    assert reference_share(Job, 40, 100) == 0.5
    assert reference_share(Job, 16, 100) == 1000 / 1600               # raised to pair 1000 tokens
    assert reference_share(Job, 4, 100) == 1.0                        # fewer than that: all of them
    assert reference_share(PassJob(), 40, 100) == 0


def test_a_reference_hessian_averages_d_over_the_paired_rows_only():
    """A reference for the first rows of a batch (or none) counts every row in H and only the paired ones in D."""
    g = torch.Generator().manual_seed(1)
    K = 12
    acc = ReferenceHessian(K, "cpu", bf16_products=False)
    xs, pairs = [], []
    for paired in (4, 0, 10, 7):
        x = torch.randn(10, K, generator=g)
        ref = x[:paired] + 0.1 * torch.randn(paired, K, generator=g)
        acc.add(x, reference=ref if paired else None)
        xs.append(x)
        pairs.append((x[:paired], ref))
    X = torch.cat(xs)
    torch.testing.assert_close(acc.value(), X.T @ X / X.shape[0])
    Xp, R = (torch.cat(t) for t in zip(*pairs))
    torch.testing.assert_close(acc.D, (R - Xp).T @ Xp / Xp.shape[0])
    assert acc.rows == 40 and acc.paired_rows == 21
    torch.testing.assert_close(acc.paired_value(), Xp.T @ Xp / Xp.shape[0])
    # the two halves `folds` gives: the first half of each batch's paired rows, and the rest
    first = torch.cat([torch.arange(i * 10, i * 10 + p // 2) for i, p in enumerate((4, 0, 10, 7))])
    rest = torch.cat([torch.arange(i * 10 + p // 2, i * 10 + p) for i, p in enumerate((4, 0, 10, 7))])
    Xall, Rall = torch.cat(xs), torch.zeros(40, K)
    Rall[torch.cat([torch.arange(i * 10, i * 10 + p) for i, p in enumerate((4, 0, 10, 7))])] = R
    W = torch.randn(5, K, generator=g)
    folds = acc.folds(W)
    for (WD, H, rows), part in zip(folds, (first, rest)):
        x, r = Xall[part], Rall[part]
        assert rows == len(part)
        torch.testing.assert_close(H, x.T @ x / len(part), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(WD, W @ ((r - x).T @ x / len(part)), rtol=1e-4, atol=1e-5)
    # W·D is the folds' mean by rows (what feedback.trusted_shift relies on); not every row is paired
    combined = sum(fold.WD * (fold.rows / acc.paired_rows) for fold in folds)
    torch.testing.assert_close(combined, acc.shift(W), rtol=1e-4, atol=1e-5)
    assert len(folds) == 2 and not acc.all_paired
    only_paired = ReferenceHessian(K, "cpu")
    only_paired.add(xs[2], reference=xs[2] + 0.1)
    assert only_paired.all_paired and torch.equal(only_paired.paired_value(), only_paired.value())


class Folder(PassJob):
    """An AWQ-style job: folds a per-channel scale into each group's producer and keeps the scaled weights."""
    label = "folder"

    def __init__(self, scales_for):
        self.scales_for, self.outputs, self.reran = scales_for, [], []

    def quantize_group(self, ctx, group):
        if ctx.layer == 0 and group.producer_kind != "linear":
            before = ctx.run(group)
            scale = self.scales_for(ctx.source[f"{group.linears[0]}.weight"].shape[1])
            weights = ctx.fold(group, scale)
            self.reran.append(torch.equal(ctx.run(group, overrides=weights), before))
            return weights
        if ctx.layer == 0 and group.linears == ("mlp.down_proj",):
            scale = self.scales_for(ctx.source["mlp.down_proj.weight"].shape[1])
            return ctx.fold(group, scale)   # into up_proj's rows
        return {}

    def finish_layer(self, ctx):
        self.outputs.append(ctx.stream.clone())


def test_d_from_bf16_products_is_float32_d_to_bf16_rounding():
    """Where the CPU multiplies bf16 natively, D's products take bf16 factors: D, a projected W·D and W·D from
    D then differ from the float32 ones by about bf16's rounding, far below their sampling noise; H is untouched.
    A bf16 stream skips float32 (its difference is float32's, rounded once): the same D to the bit."""
    g = torch.Generator().manual_seed(2)
    K, O = 256, 64
    W = torch.randn(O, K, generator=g)
    accs = {(low, proj): ReferenceHessian(K, "cpu", bf16_products=low) for low in (False, True) for proj in (None, 1)}
    streamed = ReferenceHessian(K, "cpu", bf16_products=True)
    for _ in range(3):
        x = torch.randn(512, K, generator=g).bfloat16()
        ref = (x.float() @ (torch.eye(K) + 0.1 * torch.randn(K, K, generator=g) / K ** 0.5)).bfloat16()
        for (low, proj), acc in accs.items():
            acc.add(x.float(), reference=ref.float(), project=W if proj else None)
        streamed.add(x, reference=ref)
    assert torch.equal(streamed.D, accs[True, None].D)
    torch.testing.assert_close(streamed.value(), accs[True, None].value())   # exact products, summed otherwise
    for proj in (None, 1):
        exact, low = accs[False, proj], accs[True, proj]
        assert low.bf16_products and not exact.bf16_products
        assert torch.equal(low.value(), exact.value())
        for a, b in ((low.D, exact.D), (low.shift(W), exact.shift(W))):
            rel = float((a - b).norm() / b.norm())
            assert 1e-5 < rel < 1e-2, rel          # rounded (not silently float32), and only rounded


def test_a_projected_reference_hessian_keeps_the_same_w_times_d():
    """For a group whose inputs are wider than twice its outputs (a down projection) the reference term is kept
    as W·D (O × K) rather than D (K × K): the same values, batches before the first reference included."""
    g = torch.Generator().manual_seed(0)
    K, O = 96, 40
    W = torch.randn(O, K, generator=g)
    full, projected = (ReferenceHessian(K, "cpu", bf16_products=False) for _ in range(2))
    for paired in (False, True, True):
        x = torch.randn(2, 50, K, generator=g)
        ref = x + 0.1 * torch.randn(x.shape, generator=g) if paired else None
        full.add(x, reference=ref)
        projected.add(x, reference=ref, project=W if paired else None)
    assert projected.projected and projected.D.shape == (O, K) and full.D.shape == (K, K)
    assert torch.allclose(projected.value(), full.value())
    rows = torch.arange(10, 30)
    assert torch.allclose(projected.shift(W[rows], rows), full.shift(W[rows]), rtol=1e-4, atol=1e-5)
    # the choice: W·D where it is cheaper to keep (2·O < K), D otherwise
    source = {"down.weight": W, "up.weight": torch.randn(2 * K, K, generator=g)}
    assert torch.equal(output_projection(source, ("down",), "cpu"), W)
    assert output_projection(source, ("up",), "cpu") is None and output_projection(source, ("down", "down"), "cpu") is None
    assert ReferenceHessian(K, "cpu").shift(W) is None


def test_a_scale_folded_into_the_producer_leaves_the_layer_output_unchanged(tmp_path):
    model = Checkpoint(family_checkpoint(tmp_path, "qwen2"))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    powers_of_two = lambda n: 2.0 ** torch.randint(-3, 4, (n,), generator=gen).float()
    plain, folded = Folder(lambda n: torch.ones(n)), Folder(powers_of_two)
    run_capture(model, tokens, [plain, folded], device=torch.device("cpu"), compute_dtype=torch.float32)
    assert folded.reran == [True, True]                       # re-running the sub-block sees the same output
    for a, b in zip(plain.outputs, folded.outputs):
        assert torch.equal(a, b)


def test_fold_scales_the_norm_and_the_linears_inversely(tmp_path):
    from quantkit.calibration.context import LayerContext
    model = Checkpoint(family_checkpoint(tmp_path, "llama"))
    block, source = model.block(0), model.layer(0)
    ctx = LayerContext(0, block, source)
    qkv = block.groups[0]
    s = torch.full((64,), 2.0)
    weights = ctx.fold(qkv, s)
    assert torch.equal(ctx.replaced["input_layernorm.weight"], source["input_layernorm.weight"] / 2)
    assert torch.equal(weights["self_attn.q_proj.weight"], source["self_attn.q_proj.weight"] * 2)
    assert ctx.stored("self_attn.k_proj.weight") is weights["self_attn.k_proj.weight"]
    o = block.groups[1]
    with pytest.raises(Exception, match="grouped-query"):   # v has 2 kv heads, o reads 4 heads
        ctx.fold(o, torch.ones(64))


class TwoPass(PassJob):
    label = "two-pass"
    passes = 2

    def __init__(self):
        self.events = []

    def observe(self, ctx, group, x):
        self.events.append(("observe", ctx.pass_index, ctx.layer))

    def quantize_group(self, ctx, group):
        self.events.append(("quantize", ctx.pass_index, ctx.layer))
        return {} if ctx.pass_index == 0 else {f"{n}.weight": ctx.source[f"{n}.weight"] * 0 for n in group.linears}

    def end_pass(self, index):
        self.events.append(("end", index, None))


def test_a_two_pass_job_sees_every_layer_before_quantizing_anything(tmp_path):
    model = Checkpoint(family_checkpoint(tmp_path, "llama"))
    tokens = torch.randint(0, 64, (2, 16))
    job, one = TwoPass(), Recorder(1.0)
    run_capture(model, tokens, [job, one], device=torch.device("cpu"), compute_dtype=torch.float32)
    first_end = job.events.index(("end", 0, None))
    assert {e[2] for e in job.events[:first_end]} == set(range(model.num_layers))
    assert all(e[1] == 0 for e in job.events[:first_end]) and all(e[1] == 1 for e in job.events[first_end + 1:-1])
    assert job.events[-1] == ("end", 1, None)
    # the one-pass job ran once, next to pass 0
    assert len(one.seen) == model.num_layers * 4


def test_jobs_follow_the_typed_protocol(tmp_path, tiny_gguf_source):
    from quantkit.backends.gptq.job import GPTQJob
    from quantkit.backends.gptq.algorithm import GPTQSettings
    from quantkit.calibration.imatrix import ImatrixCollector
    model = Checkpoint(tiny_gguf_source)
    assert isinstance(ImatrixCollector(model, torch.device("cpu")), LayerJob)
    job = GPTQJob(model, GPTQSettings(), "4bit", tmp_path / "x", device=torch.device("cpu"))
    assert isinstance(job, ArtifactJob)


def test_block_lists_every_layer_tensor_and_the_groups_producers(tmp_path):
    model = Checkpoint(family_checkpoint(tmp_path, "qwen3"))
    block = model.block(0)
    in_file = {n[len("model.layers.0."):] for n in model.weights.names() if n.startswith("model.layers.0.")}
    assert set(block.tensor_names()) == in_file
    assert [(g.linears, g.producer, g.producer_kind) for g in block.groups] == [
        (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm", "norm"),
        (("self_attn.o_proj",), "self_attn.v_proj", "linear"),
        (("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "norm"),
        (("mlp.down_proj",), "mlp.up_proj", "linear")]


def test_sliding_window_follows_the_layer_pattern(tmp_path):
    model = Checkpoint(family_checkpoint(tmp_path, "qwen2-window"))
    windows = [model.block(i).residuals[0].op.window for i in range(3)]
    assert windows == [None, 8, 8]


def test_runtime_rope_tables_are_shared_between_layers(tmp_path):
    model = Checkpoint(family_checkpoint(tmp_path, "llama"))
    rt = Runtime(16, "cpu")
    h = torch.randn(1, 16, 64)
    for i in range(3):
        h = run_block(model.block(i), h, {k: v for k, v in model.layer(i).items()}, rt)
    assert len(rt._rope) == 1


@pytest.mark.parametrize("key", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_each_expert_sees_the_tokens_transformers_routes_to_it(tmp_path, key):
    """Routing runs on the job's own stream as the model would run it: expert e's gate/up inputs are exactly the
    rows of the tokens transformers' router sends to e (compared with a pre-hook on its experts module)."""
    folder, model, tokens, rec = recorded_capture(tmp_path, key, factor=1.0, seed=4)
    hf = hf_model(folder)
    for i in range(model.num_layers):
        sub = model.block(i).residuals[1]
        if sub.name != "moe":
            continue
        moe, seen = sub.op, []
        layer = hf.get_submodule(f"model.layers.{i}")   # transformers 5 names Mixtral's block `mlp` in memory
        experts = getattr(layer, "mlp", None) or layer.block_sparse_moe
        experts = experts.experts
        handle = experts.register_forward_pre_hook(lambda m, args: seen.append((args[0], args[1])))
        with torch.no_grad():
            hf(tokens)
        handle.remove()
        hidden, chosen = seen[0]
        counts = []
        for e, expert in enumerate(moe.experts):
            expected = hidden[(chosen == e).any(-1)]
            got = rec.seen.get((i, (expert.gate, expert.up)))
            counts.append(expected.shape[0])
            if expected.shape[0] == 0:
                assert got is None
                continue
            torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)
        assert sum(counts) == tokens.numel() * moe.top_k


# A process that calibrates the demo's first layer: GPTQ's Cholesky runs before the first RoPE table is built.
_FRESH_PROCESS = """
import hashlib, torch
from quantkit.backends.gptq.algorithm import GPTQSettings, gptq_quantize
from quantkit.calibration.capture import working_weights
from quantkit.calibration.stats import HessianAccumulator
from quantkit.model.engine import Runtime, run_residual
from quantkit.model.source import open_model
m = open_model("demo:smollm2-135m")
src, block = m.layer(0), m.block(0)
w = working_weights(block, src, torch.device("cpu"), torch.bfloat16)
rt = Runtime(128, torch.device("cpu"), torch.bfloat16)
h = torch.randn(8, 128, 576, generator=torch.Generator().manual_seed(0))
acc = HessianAccumulator(576, "cpu")
run_residual(block.residuals[0], h, w, rt, observe=lambda g, x: acc.add(x), stop=0)
gptq_quantize(torch.cat([src[f"self_attn.{p}_proj.weight"].float() for p in "qkv"]), acc.value(), GPTQSettings())
cos, sin = rt.rope(block.residuals[0].op.rope)
print(hashlib.sha256(cos.float().numpy().tobytes() + sin.float().numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_every_fresh_process_builds_the_same_rope_tables():
    """Unsettled, MKL's vector math set itself up differently in about 1 in 10 such processes (started from
    one that had run torch, as pytest has) and kept last-bit-other cos values, so a resumed run could end with
    other bytes.  quantkit.model.vector_math settles it: 30 processes agree (unsettled, odds of ~4 %)."""
    import subprocess
    import sys
    torch.randn(256, 256) @ torch.randn(256, 256)
    seen = set()
    for _ in range(30):
        run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        seen.add(run.stdout.split()[-1])
    assert len(seen) == 1, seen

"""quantkit's bitsandbytes encodings against bitsandbytes itself (CPU): the same bytes for NF4, FP4, double
quantization, every block size and LLM.int8, on awkward tensors (odd element counts, partial last blocks,
zero and constant blocks, values exactly on a midpoint between two codes)."""
import pytest
import torch

from quantkit.backends.bnb import encoders

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes (quantkit[bnb]) not installed")
F = bnb.functional


def awkward_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"demo-shaped bf16": (torch.randn(96, 576, generator=g) * 0.02).bfloat16(),
           "odd count": torch.randn(7, 13, generator=g),
           "partial last block": torch.randn(3, 100, generator=g).half(),
           "heavy tails": torch.distributions.StudentT(2.0).sample((32, 128)) * 0.1}
    blocks = torch.randn(8, 64, generator=g)
    blocks[1] = 0.0                 # a zero block
    blocks[2] = 0.37                # a constant block
    blocks[3, :32] = -2.5           # the absmax negative
    out["zero and constant blocks"] = blocks
    for name, table in (("nf4", encoders.NF4), ("fp4", encoders.FP4)):
        levels = sorted(table)
        mids = torch.tensor([(a + b) / 2 for a, b in zip(levels[:-1], levels[1:])], dtype=torch.float32)
        row = torch.cat([torch.tensor([1.0]), mids, -mids, torch.zeros(64 - 1 - 2 * len(mids))])
        out[f"{name} midpoints"] = row[None].repeat(2, 1)
    return out


TENSORS = awkward_tensors()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 4096])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("name", list(TENSORS))
def test_4bit_bytes_equal_bitsandbytes(name, quant_type, blocksize, double_quant):
    w = TENSORS[name]
    ref, state = F.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=double_quant)
    got = encoders.quantize_4bit(w, quant_type, blocksize, double_quant)
    assert torch.equal(got.weight, ref)
    assert got.weight.dtype == torch.uint8 and got.weight.shape == ref.shape
    assert torch.equal(got.quant_map, state.code)
    assert torch.equal(got.absmax, state.absmax) and got.absmax.dtype == state.absmax.dtype
    if double_quant:
        assert torch.equal(got.nested_absmax, state.state2.absmax)
        assert torch.equal(encoders.dynamic_map(), state.state2.code)
        assert got.nested_offset == state.offset.item()
    assert torch.equal(encoders.dequantize_4bit(got, tuple(w.shape), blocksize, w.dtype), reference_dequant(ref, state))


def reference_dequant(packed, state):
    """bitsandbytes' own 4-bit dequantization, its pure-torch kernel (the CPU one reads a block that spans two rows
    wrongly: 576-wide rows in blocks of 128 decode to other values; the CUDA kernel and this one agree)."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return _dequantize_4bit_compute.__wrapped__(packed.reshape(-1), absmax, state.code, state.blocksize,
                                                tuple(state.shape), state.dtype)


@pytest.mark.parametrize("name", list(TENSORS))
def test_int8_bytes_equal_bitsandbytes(name):
    w = TENSORS[name]
    if name == "zero and constant blocks":
        w = w[[0, 2, 3]]   # bitsandbytes divides a zero row by its zero absmax: no defined codes to compare
    cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16).contiguous())
    got_cb, got_scb = encoders.quantize_int8(w)
    assert torch.equal(got_cb, cb) and torch.equal(got_scb, scb)
    assert torch.equal(encoders.dequantize_int8(got_cb, got_scb), F.int8_vectorwise_dequant(cb, scb))


def test_tables_are_bitsandbytes_tables():
    for quant_type in ("nf4", "fp4"):
        # bit for bit: torch.equal would take -0.0 for +0.0, and the stored quant_map would differ
        assert torch.equal(encoders.code_table(quant_type).view(torch.int32), F.get_4bit_type(quant_type, device="cpu").view(torch.int32))
    assert torch.equal(encoders.dynamic_map(), F.create_dynamic_map(signed=True))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="block size 48"):
        encoders.quantize_4bit(torch.ones(4, 64), "nf4", 48)
    with pytest.raises(ValueError, match="nf4 or fp4"):
        encoders.quantize_4bit(torch.ones(4, 64), "int4", 64)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_lookup_nearest_equals_a_binary_search_on_every_awkward_value(quant_type):
    # the encoder finds the nearest level with a table on each float32's top 16 bits; a binary search over the
    # midpoints (torch.bucketize, a tie to the lower level) is the slow reference: at each midpoint and the
    # floats either side of it, at both ends of every 16-bit prefix interval in [-1, 1], and on random values
    table = encoders.code_table(quant_type)
    order = torch.argsort(table)
    levels = table[order]
    mids = (levels[:-1] + levels[1:]) / 2
    prefixes = torch.arange(1 << 16, dtype=torch.int64) << 16
    ends = torch.cat([prefixes, prefixes | 0xFFFF])
    ends = torch.where(ends >= 1 << 31, ends - (1 << 32), ends).to(torch.int32).view(torch.float32)
    ends = ends[torch.isfinite(ends) & (ends.abs() <= 1)]
    x = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0)), ends,
                   torch.rand(100_000, generator=torch.Generator().manual_seed(1)) * 2 - 1,
                   torch.tensor([0.0, -0.0, 1.0, -1.0])])
    expected = order[torch.bucketize(x, mids)].to(torch.uint8)
    assert torch.equal(encoders._nearest(x, table), expected)

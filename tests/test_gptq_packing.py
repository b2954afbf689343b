"""GPTQ int32 packing: exact round trips on random shapes, and the bit layout the consumers read."""
import random

import pytest
import torch

from quantkit.backends.gptq.algorithm import GPTQSettings, gptq_quantize, rtn_quantize
from quantkit.backends.gptq.packing import pack, pack_zeros, unpack, unpack_zeros
from quantkit.backends.gptq.reader import dequantize


def _reference_words(codes: torch.Tensor, bits: int) -> list[list[int]]:
    """Pack one column the slow way: the column's values form one little-endian bit string."""
    out = []
    for col in codes.T.tolist():
        stream = 0
        for k, v in enumerate(col):
            stream |= int(v) << (bits * k)
        n_words = len(col) * bits // 32
        out.append([(stream >> (32 * w)) & 0xFFFFFFFF for w in range(n_words)])
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_round_trip_on_random_shapes(bits):
    rng = random.Random(bits)
    for _ in range(20):
        rows, cols = 32 * rng.randint(1, 9), rng.randint(1, 70)
        codes = torch.randint(0, 2 ** bits, (rows, cols), dtype=torch.uint8)
        packed = pack(codes, bits)
        assert packed.dtype == torch.int32 and packed.shape == (rows * bits // 32, cols)
        assert torch.equal(unpack(packed, bits), codes)
        zeros = torch.randint(0, 2 ** bits, (rng.randint(1, 6), rows), dtype=torch.uint8)
        qz = pack_zeros(zeros, bits)
        assert qz.shape == (zeros.shape[0], rows * bits // 32)
        assert torch.equal(unpack_zeros(qz, bits), zeros)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bit_layout_is_a_little_endian_bit_string_per_column(bits):
    # 2/4/8 bits: value k of a word at bits b·k; 3 bits: 32 values over 3 words, two straddling words.
    codes = torch.randint(0, 2 ** bits, (64, 5), dtype=torch.uint8)
    words = (pack(codes, bits).to(torch.int64) & 0xFFFFFFFF).T.tolist()
    expected = []
    for col in range(5):
        per_run = []
        for run in range(2):  # runs of 32 values are independent
            per_run += _reference_words(codes[run * 32:(run + 1) * 32, col:col + 1], bits)[0]
        expected.append(per_run)
    assert words == expected


@pytest.mark.parametrize("bits,word", [(2, 0x55555555), (3, None), (4, 0x77777777), (8, 0x7F7F7F7F)])
def test_symmetric_v1_zero_words(bits, word):
    stored = torch.full((1, 32), 2 ** (bits - 1) - 1)  # v1 stores zero − 1
    packed = pack_zeros(stored, bits).to(torch.int64) & 0xFFFFFFFF
    if word is not None:
        assert set(packed.flatten().tolist()) == {word}
    else:  # 3-bit: 3 in every field of the 96-bit string
        stream = sum(int(w) << (32 * i) for i, w in enumerate(packed[0].tolist()))
        assert all((stream >> (3 * k)) & 7 == 3 for k in range(32))


def test_sign_bit_survives():
    codes = torch.full((32, 1), 15, dtype=torch.uint8)
    packed = pack(codes, 4)
    assert packed.flatten().tolist() == [-1] * 4  # 0xFFFFFFFF as int32
    assert torch.equal(unpack(packed, 4), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group,act,static,sym", [(32, False, False, True), (64, True, False, True),
                                                  (64, True, True, True), (128, True, False, False),
                                                  (-1, False, False, False), (128, False, False, True)])
def test_codes_survive_pack_and_dequantize_exactly(bits, group, act, static, sym):
    """Pack -> unpack returns the integer codes, and the reader's dequantization equals the algorithm's
    weights bit for bit, for every bit width, group size (incl. a partial last group) and act-order layout."""
    torch.manual_seed(bits * 7 + max(group, 0))
    k, n = 320, 64  # 320 = 2.5 groups of 128: a partial last group
    x = torch.randn(512, k) * torch.rand(k) * 3
    h = x.T @ x / 512
    w = torch.randn(n, k) * 0.05
    s = GPTQSettings(bits=bits, group_size=group, act_order=act, static_groups=static, sym=sym)
    r = gptq_quantize(w, h, s)
    qweight = pack(r.codes.T.contiguous(), bits)
    stored = r.zeros.T - 1 if sym else r.zeros.T
    qzeros = pack_zeros(stored, bits)
    assert torch.equal(unpack(qweight, bits).T, r.codes)
    assert torch.equal(unpack_zeros(qzeros, bits).to(torch.int64), stored)
    back = dequantize(qweight, qzeros, r.scales.T.to(torch.float16), r.g_idx, bits, v2=not sym)
    assert torch.equal(back, r.weight)


def test_rtn_uses_the_same_storage():
    w = torch.randn(64, 256)
    s = GPTQSettings(bits=4, group_size=64, sym=True)
    r = rtn_quantize(w, s)
    back = dequantize(pack(r.codes.T.contiguous(), 4), pack_zeros(r.zeros.T - 1, 4), r.scales.T.half(), r.g_idx, 4,
                      v2=False)
    assert torch.equal(back, r.weight)
    per_element_scale = r.scales[:, r.g_idx.long()]
    assert ((back - w).abs() <= per_element_scale * 0.505).all()  # nearest level (fp16 scale: a hair over ½)

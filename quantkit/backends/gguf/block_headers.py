"""The grid a block's header sets, read straight from its bytes: for each value, the (offset, scale) under which
code c decodes to offset + scale · levels[c] (encoders.CODE_LAYOUTS).  feedback.py reads it once per block of
columns; decoding whole blocks through gguf-py's numpy dequantizer to find it took 4 % of a demo run.

Each type is data: its block's bytes hold an fp16 `d` (and for some an fp16 minimum) and per sub-block a scale
(and minimum) packed as ggml-quants.c's dequantize_row_* reads them (gguf.md in ../shared/docs/formats):

    type      sub-block  value
    Q8_0      32         d·(c − 128)            (c = the stored int8 + 128)
    Q4_0/Q5_0 32         d·(c − 8) / d·(c − 16)
    Q4_1/Q5_1 32         d·c + m
    IQ4_NL    32         d·kvalues[c]
    Q2_K      16         d·(sc & 15)·c − dmin·(sc >> 4)
    Q3_K      16         d·(sc − 32)·(c − 4)     (6-bit sc, split in 4 + 2 bits)
    Q4_K/Q5_K 32         d·sc·c − dmin·m        (6-bit sc and m, ggml's get_scale_min_k4)
    Q6_K      16         d·sc·(c − 32)           (int8 sc)
    IQ4_XS    32         d·(ls − 32)·kvalues[c] (6-bit ls: 4 bits in scales_l, 2 in scales_h)

The products are taken in float32 in ggml's order (d · sub-scale first), so the grid is what llama.cpp decodes.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16)[:, 0].astype(np.float32)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minimums of a Q4_K / Q5_K block's 12 scale bytes (get_scale_min_k4)."""
    s = s.astype(np.int32)
    lo, hi = s[:, 0:4], s[:, 4:8]
    sc = np.concatenate([lo & 63, (s[:, 8:12] & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([hi & 63, (s[:, 8:12] >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc, mn


def _q3_scales(s: np.ndarray) -> np.ndarray:
    """The 16 six-bit scales of a Q3_K block's 12 scale bytes: low 4 bits from bytes 0–7 (low nibbles, then high),
    high 2 bits from bytes 8–11, two bits per group of four."""
    s = s.astype(np.int32)
    i = np.arange(16)
    low = (s[:, i % 8] >> (4 * (i // 8))) & 15
    high = (s[:, 8 + i % 4] >> (2 * (i // 4))) & 3
    return low | (high << 4)


def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    h = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)[:, 0].astype(np.int32)
    i = np.arange(8)
    low = (b[:, 4 + i // 2].astype(np.int32) >> (4 * (i % 2))) & 15
    return low | (((h[:, None] >> (2 * i)) & 3) << 4)


def _legacy(shift: float, with_min: bool):
    def grid(b):
        d = _f16(b, 0)
        offset = _f16(b, 2) if with_min else d * np.float32(-shift)
        return offset[:, None], d[:, None]
    return grid


def _q2_k(b):
    sc = b[:, 0:16].astype(np.float32)
    d, dmin = _f16(b, 80)[:, None], _f16(b, 82)[:, None]
    return -(dmin * np.floor(sc / 16)), d * (sc % 16)


def _q3_k(b):
    dl = _f16(b, 108)[:, None] * (_q3_scales(b[:, 96:108]) - 32).astype(np.float32)
    return dl * np.float32(-4), dl


def _q45_k(b):
    sc, mn = _k4_scales(b[:, 4:16])
    return -(_f16(b, 2)[:, None] * mn.astype(np.float32)), _f16(b, 0)[:, None] * sc.astype(np.float32)


def _q6_k(b):
    dl = _f16(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    return dl * np.float32(-32), dl


def _iq4_nl(b):
    d = _f16(b, 0)[:, None]
    return np.zeros_like(d), d


def _iq4_xs(b):
    dl = _f16(b, 0)[:, None] * (_iq4_xs_scales(b) - 32).astype(np.float32)
    return np.zeros_like(dl), dl


# type -> (values per sub-block, header reader: block bytes (blocks, type size) -> (offset, scale) per sub-block)
HEADERS = {
    QT.Q8_0: (32, _legacy(128, False)), QT.Q4_0: (32, _legacy(8, False)), QT.Q5_0: (32, _legacy(16, False)),
    QT.Q4_1: (32, _legacy(0, True)), QT.Q5_1: (32, _legacy(0, True)), QT.IQ4_NL: (32, _iq4_nl),
    QT.Q2_K: (16, _q2_k), QT.Q3_K: (16, _q3_k), QT.Q4_K: (32, _q45_k), QT.Q5_K: (32, _q45_k),
    QT.Q6_K: (16, _q6_k), QT.IQ4_XS: (32, _iq4_xs),
}


def block_grid(data: np.ndarray, qtype: QT, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset, scale), each float32 of `shape` (rows, row length), for the GGUF rows `data` (rows, bytes)."""
    qtype = QT(qtype)
    sub, read = HEADERS[qtype]
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, ts)
    offset, scale = (torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32))
                     .repeat_interleave(sub, dim=1).reshape(tuple(shape)) for t in read(blocks))
    return offset, scale

"""Fuzz of the two readers a user's file meets first: a safetensors checkpoint and a GGUF file, cut short at
random offsets or with random bytes flipped.  Each mutant is read the whole way (every tensor of the
checkpoint; the GGUF's model, every layer and the head).  Allowed outcomes: it reads, or a QuantkitError (one
line for the user).  Anything else is a traceback the user would see; a mutant that takes more than a few
seconds is a hang; a tensor handed back from bytes past the end of the file is a read past it."""
from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path

import pytest

from conftest import make_checkpoint
from quantkit.errors import QuantkitError

CASES = int(os.environ.get("QUANTKIT_FUZZ_CASES", 150))   # per reader; 150: ~15 s in all on 2 cores
SECONDS_PER_CASE = 10


class Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise Hang()


def mutants(data: bytes, seed: int, header_end: int):
    """Truncations at random offsets (a third near the header, where the structure is) and byte flips (most
    of them inside the header: flips in tensor data only change numbers)."""
    rng = random.Random(seed)
    for k in range(CASES):
        kind = k % 3
        if kind == 0:
            cut = rng.randrange(0, header_end + 64) if rng.random() < 0.5 else rng.randrange(0, len(data))
            yield f"truncated at {cut}", data[:cut]
        else:
            b = bytearray(data)
            for _ in range(rng.choice((1, 1, 2, 4, 16))):
                at = rng.randrange(0, header_end) if rng.random() < 0.85 else rng.randrange(0, len(b))
                b[at] = rng.randrange(256) if kind == 1 else b[at] ^ (1 << rng.randrange(8))
            yield f"{'bytes set' if kind == 1 else 'bits flipped'} (case {k})", bytes(b)


def fuzz(read, original: Path, seed: int, header_end: int) -> dict:
    data = original.read_bytes()
    outcomes = {"read": 0, "refused": 0}
    failures = []
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for what, blob in mutants(data, seed, header_end):
            original.write_bytes(blob)
            signal.alarm(SECONDS_PER_CASE)
            try:
                read(original, len(blob))
                outcomes["read"] += 1
            except QuantkitError as e:
                assert "\n" not in e.message, (what, e.message)
                outcomes["refused"] += 1
            except Hang:
                failures.append(f"{what}: no answer within {SECONDS_PER_CASE} s")
            except Exception as e:   # noqa: BLE001 - what the fuzz looks for
                failures.append(f"{what}: {type(e).__name__}: {e}"[:300])
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, previous)
        original.write_bytes(data)
    assert not failures, "\n".join(failures[:20])
    assert outcomes["refused"] > CASES // 3, outcomes   # the mutations do reach the checks
    return outcomes


def test_safetensors_reader_survives_truncation_and_flips(tmp_path):
    from quantkit.model.safetensors_reader import SafetensorsCheckpoint
    folder = make_checkpoint(tmp_path / "m", hidden=32, intermediate=64, layers=1, vocab=64)
    file = folder / "model.safetensors"
    header_end = 8 + int.from_bytes(file.read_bytes()[:8], "little")

    def read(path: Path, size: int):
        ckpt = SafetensorsCheckpoint(path.parent)
        for name in ckpt.names():
            entry = ckpt.entries[name]
            assert entry.start + entry.nbytes <= size, f"{name} lies past the end of the file"
            ckpt.get(name)

    fuzz(read, file, seed=1, header_end=header_end)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from quantkit import api
    work = tmp_path_factory.mktemp("fuzz-gguf")
    src = make_checkpoint(work / "m", hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, vocab=320,
                           bpe=True)
    (path,) = api.convert(str(src), ["gguf:Q8_0"], work / "out", options={"tokenizer_pre": "gpt-2"})
    return Path(path)


def test_gguf_reader_survives_truncation_and_flips(tiny_gguf, tmp_path):
    import gguf
    from quantkit.backends.gguf.reader import GGUFModel
    file = tmp_path / tiny_gguf.name
    shutil.copy(tiny_gguf, file)
    reader = gguf.GGUFReader(str(file))
    header_end = min(int(t.data_offset) for t in reader.tensors)
    del reader

    def read(path: Path, size: int):
        model = GGUFModel(path)
        for t in model.tensors.values():
            assert int(t.data_offset) + int(t.n_bytes) <= size, f"{t.name} lies past the end of the file"
        for i in range(model.num_layers):
            model.layer(i)
        model.embed_weight(), model.final_norm_weight(), model.lm_head_weight()

    fuzz(read, file, seed=2, header_end=header_end)

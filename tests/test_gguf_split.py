"""llama.cpp's split GGUF layout: --split-max-size writes NAME-0000k-of-0000N.gguf parts with the split keys,
the same tensors as the unsplit file, read back by quantkit and loaded by llama.cpp as one model."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from quantkit import api
from quantkit.backends.gguf import llamacpp
from quantkit.backends.gguf.split import parse_size, partition
from quantkit.errors import SourceError, UsageError

OPTS = {"device": "cpu", "tokenizer_pre": "gpt-2"}


@pytest.fixture(scope="module")
def files(tiny_gguf_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("split")
    (whole,) = api.convert(str(tiny_gguf_source), ["gguf:Q8_0"], out / "whole", options=OPTS)
    (first,) = api.convert(str(tiny_gguf_source), ["gguf:Q8_0"], out / "split",
                           options={**OPTS, "split_max_size": "300K"})
    return whole, first


def test_parts_names_keys_and_tensors(files):
    whole, first = files
    parts = sorted(first.parent.glob("*.gguf"))
    n = len(parts)
    assert n >= 3 and first == parts[0]
    assert [p.name for p in parts] == [f"{whole.stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    readers = [gguf.GGUFReader(str(p)) for p in parts]
    total = len(gguf.GGUFReader(str(whole)).tensors)
    for i, r in enumerate(readers):
        assert r.fields["split.no"].contents() == i and r.fields["split.count"].contents() == n
        assert r.fields["split.tensors.count"].contents() == total
        assert sum(int(t.n_bytes) for t in r.tensors) <= 300_000 or len(r.tensors) == 1
    # the first part carries the metadata (as llama-gguf-split writes it), the others only the split keys
    whole_keys = [k for k in gguf.GGUFReader(str(whole)).fields if not k.startswith("GGUF.")]
    assert [k for k in readers[0].fields if not k.startswith("GGUF.")] == whole_keys + ["split.no", "split.count",
                                                                                       "split.tensors.count"]
    assert all({k for k in r.fields if not k.startswith("GGUF.")} == {"split.no", "split.count", "split.tensors.count"}
               for r in readers[1:])
    split_tensors = [(t.name, np.asarray(t.data).tobytes()) for r in readers for t in r.tensors]
    assert split_tensors == [(t.name, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(whole)).tensors]


def test_quantkit_reads_a_split_file_as_one(files, tiny_text, tiny_gguf_source):
    whole, first = files
    info = api.inspect(str(first))
    assert info["file_size"] == sum(p.stat().st_size for p in first.parent.glob("*.gguf"))
    assert len(info["split_parts"]) >= 3 and info["tensor_count"] == api.inspect(str(whole))["tensor_count"]
    a = api.evaluate(str(whole), tiny_text, base=str(tiny_gguf_source), ctx=32, windows=4, device="cpu")
    b = api.evaluate(str(first), tiny_text, base=str(tiny_gguf_source), ctx=32, windows=4, device="cpu")
    assert a.perplexity == b.perplexity and a.mean_kld == b.mean_kld
    with pytest.raises(SourceError, match="first part"):
        api.inspect(str(sorted(first.parent.glob("*.gguf"))[1]))


def test_a_missing_part_is_one_line(files, tmp_path):
    import shutil
    _, first = files
    for p in sorted(first.parent.glob("*.gguf"))[:-1]:
        shutil.copyfile(p, tmp_path / p.name)
    with pytest.raises(SourceError, match="missing"):
        api.inspect(str(tmp_path / first.name))


@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python (quantkit[llamacpp]) not installed")
def test_llama_cpp_loads_the_split_file_with_the_same_logits(files):
    whole, first = files
    tokens = torch.randint(0, 300, (1, 24))
    (a,) = list(llamacpp.window_logits(whole, tokens))
    (b,) = list(llamacpp.window_logits(first, tokens))
    assert torch.equal(a, b)


def test_sizes_and_partition_rule():
    assert parse_size("48G") == 48 * 10**9 and parse_size("500M") == 500 * 10**6 and parse_size("1234") == 1234
    with pytest.raises(UsageError):
        parse_size("lots")
    # a new part when the next padded tensor would pass the maximum; an oversized tensor alone in its part
    assert partition([96, 96, 96], 250) == [0, 0, 1]
    assert partition([100, 100], 250) == [0, 1]                  # padded to 32: 128 + 128 > 250
    assert partition([500, 10, 10], 250) == [0, 1, 1]
    assert partition([10, 10], None) == [0, 0]


def test_dry_run_names_the_parts(tiny_gguf_source, tmp_path):
    (p,) = api.plan(str(tiny_gguf_source), ["gguf:Q8_0"], tmp_path, {**OPTS, "split_max_size": "300K"})
    assert p.output.endswith("-00001-of-0000" + p.extra["split"].split(" files")[0] + ".gguf")


def test_splitting_a_written_file_gives_the_same_parts(files, tmp_path):
    from quantkit.backends.gguf.split import split_file
    whole, first = files
    parts = split_file(whole, parse_size("300K"), tmp_path)
    written = sorted(first.parent.glob("*.gguf"))
    assert [p.name for p in parts] == [p.name for p in written]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(parts, written))

"""Calibration data: source strings, each source kind, reproducible non-overlapping windows, the errors a user
sees (too little text, missing column, offline Hub, missing package, the evaluation text), self-generation."""
from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_TEXT, WIKI_TEST, WIKI_VALID, needs_shared_data
from quantkit.calibration import (CalibrationSet, CalibrationSpec, draw_windows, load_calibration,
                                  parse_calibration_source, token_hash)
from quantkit.calibration import hub as calib_hub
from quantkit.calibration.data import SEPARATOR, tokenize_documents
from quantkit.errors import DataError, DependencyError, NetworkError, UsageError
from quantkit.model.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def model(tiny_llama):
    return Checkpoint(tiny_llama)


def ids_of(model, documents):
    return tokenize_documents(model.tokenizer, documents)


def expected_rows(ids, spec):
    starts = draw_windows(len(ids), spec.samples, spec.seqlen, spec.seed)
    return torch.tensor([ids[s:s + spec.seqlen] for s in starts], dtype=torch.int64)


DOCS = [f"the quick brown fox jumps over the lazy dog . {'a stitch in time saves nine ; ' * (i % 5 + 1)}"
        f"all that glitters is not gold ." for i in range(60)]


# --- source strings --------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expect", [
    ("self", {"kind": "self"}),
    ("data/calib.txt", {"kind": "file", "format": "txt"}),
    ("data/CALIB.JSONL", {"kind": "file", "format": "jsonl"}),
    ("x.parquet", {"kind": "file", "format": "parquet"}),
    ("hf:wikitext:train", {"kind": "hf", "dataset": "wikitext", "config": None, "split": "train", "column": None}),
    ("hf:Salesforce/wikitext:wikitext-2-raw-v1:train",
     {"dataset": "Salesforce/wikitext", "config": "wikitext-2-raw-v1", "split": "train", "column": None}),
    ("hf:allenai/c4@1588ec4:en:validation[:2000]:text",
     {"dataset": "allenai/c4", "revision": "1588ec4", "config": "en", "split": "validation[:2000]", "column": "text"}),
    ("hf:org/ds::train:content", {"dataset": "org/ds", "config": None, "split": "train", "column": "content"}),
])
def test_accepted_source_strings(text, expect):
    parsed = parse_calibration_source(text)
    for k, v in expect.items():
        assert getattr(parsed, k) == v, k


@pytest.mark.parametrize("text", ["", "   ", "calib.csv", "calib", "hf:", "hf:wikitext", "hf:a:b:c:d:e",
                                  "hf:bad name:train", "hf:wikitext:cfg:", "hf:wikitext::train",
                                  "hf:wikitext:cfg:train:", "hf:/x:train", "selfish"])
def test_bad_source_strings_name_the_accepted_forms(text):
    with pytest.raises(UsageError) as e:
        parse_calibration_source(text)
    msg = str(e.value)
    assert "\n" not in msg and ".txt, .jsonl or .parquet" in msg and "hf:NAME[:CONFIG]:SPLIT[:COLUMN]" in msg
    assert "self" in msg


@pytest.mark.parametrize("kw,flag", [({"samples": 0}, "--calib-samples"), ({"seqlen": 1}, "--calib-seqlen"),
                                     ({"seed": -1}, "--calib-seed"), ({"samples": 2.5}, "--calib-samples")])
def test_bad_numbers_are_usage_errors(kw, flag):
    with pytest.raises(UsageError, match=flag):
        CalibrationSpec("x.txt", **kw)


def test_column_rules():
    with pytest.raises(UsageError, match="--calib-column applies to"):
        CalibrationSpec("x.txt", column="text")
    with pytest.raises(UsageError, match="--calib-column applies to"):
        CalibrationSpec("self", column="text")
    with pytest.raises(UsageError, match="given twice and different"):
        CalibrationSpec("hf:org/ds::train:content", column="text")
    assert CalibrationSpec("x.jsonl").text_column == "text"
    assert CalibrationSpec("x.parquet", column="body").text_column == "body"
    assert CalibrationSpec("hf:org/ds::train:content", column="content").text_column == "content"
    assert CalibrationSpec("x.txt").text_column is None


@pytest.mark.parametrize("text", [str(WIKI_TEST), "out/wikitext2-test.raw.txt", "my_WikiText_test.jsonl",
                                  "hf:Salesforce/wikitext:wikitext-2-raw-v1:test",
                                  "hf:wikitext:wikitext-103-raw-v1:test[:100]:text"])
def test_evaluation_text_is_refused(text):
    with pytest.raises(UsageError, match="evaluation text.*contaminate"):
        parse_calibration_source(text)


def test_other_wikitext_splits_are_fine():
    assert parse_calibration_source(str(WIKI_VALID)).kind == "file"
    assert parse_calibration_source("hf:Salesforce/wikitext:wikitext-2-raw-v1:validation").split == "validation"


# --- windows and hash ------------------------------------------------------------------------------
def test_windows_are_disjoint_in_range_and_reproducible():
    rng = random.Random(1)
    for _ in range(300):
        seqlen, samples = rng.randint(1, 20), rng.randint(1, 20)
        total = samples * seqlen + rng.randint(0, 60)
        seed = rng.randint(0, 2 ** 32)
        starts = draw_windows(total, samples, seqlen, seed)
        assert starts == draw_windows(total, samples, seqlen, seed)
        assert len(starts) == samples and min(starts) >= 0 and max(starts) + seqlen <= total
        ordered = sorted(starts)
        assert all(b - a >= seqlen for a, b in zip(ordered, ordered[1:]))
    assert sorted(draw_windows(40, 5, 8, 3)) == [0, 8, 16, 24, 32]  # no slack: the windows tile the stream
    # offsets are not confined to multiples of seqlen, and the rows come out shuffled
    many = [draw_windows(10_000, 8, 100, s) for s in range(20)]
    assert any(s % 100 for row in many for s in row)
    assert any(row != sorted(row) for row in many)
    with pytest.raises(ValueError):
        draw_windows(39, 5, 8, 0)


def test_token_hash_is_sha256_of_little_endian_int32_rows():
    tokens = torch.tensor([[1, 2, 3], [256, 70000, 2 ** 31 - 1]], dtype=torch.int64)
    raw = struct.pack("<6i", 1, 2, 3, 256, 70000, 2 ** 31 - 1)
    assert token_hash(tokens) == hashlib.sha256(raw).hexdigest()
    assert token_hash(tokens.T.contiguous().T) == token_hash(tokens)  # layout does not matter, row-major order does
    assert token_hash(tokens.reshape(3, 2)) == token_hash(tokens)  # the shape is recorded beside it, not in it
    base = torch.randint(0, 1000, (4, 16))
    h = token_hash(base)
    for i in range(4):
        for j in range(16):
            changed = base.clone()
            changed[i, j] += 1
            assert token_hash(changed) != h


# --- .txt ------------------------------------------------------------------------------------------
def test_txt_windows_are_non_overlapping_slices_of_the_whole_text(model, tiny_text):
    spec = CalibrationSpec(str(tiny_text), samples=12, seqlen=32, seed=5)
    cs = load_calibration(spec, model)
    ids = ids_of(model, [tiny_text.read_text()])
    assert cs.tokens.dtype == torch.int64 and cs.tokens.shape == (12, 32)
    assert torch.equal(cs.tokens, expected_rows(ids, spec))
    p = cs.provenance
    assert p["kind"] == "file" and p["format"] == "txt" and p["path"] == str(tiny_text.resolve())
    assert p["sha256"] == hashlib.sha256(tiny_text.read_bytes()).hexdigest() and p["tokens_available"] == len(ids)
    assert cs.token_hash == token_hash(cs.tokens)
    doc = cs.to_json()
    assert json.loads(json.dumps(doc)) == doc
    assert {k: doc[k] for k in ("source", "samples", "seqlen", "seed", "token_hash")} == {
        "source": str(tiny_text), "samples": 12, "seqlen": 32, "seed": 5, "token_hash": cs.token_hash}
    assert doc["provenance"]["sha256"] == p["sha256"]


def test_same_seed_same_tokens_other_seed_other_tokens(model, tiny_text):
    a = load_calibration(CalibrationSpec(str(tiny_text), samples=8, seqlen=24, seed=0), model)
    b = load_calibration(CalibrationSpec(str(tiny_text), samples=8, seqlen=24, seed=0), model)
    c = load_calibration(CalibrationSpec(str(tiny_text), samples=8, seqlen=24, seed=1), model)
    assert torch.equal(a.tokens, b.tokens) and a.token_hash == b.token_hash
    assert not torch.equal(a.tokens, c.tokens) and a.token_hash != c.token_hash


def test_too_little_text_says_how_many_tokens_there_are(model, tiny_text):
    total = len(ids_of(model, [tiny_text.read_text()]))
    with pytest.raises(DataError) as e:
        load_calibration(CalibrationSpec(str(tiny_text), samples=100, seqlen=16), model)
    msg = str(e.value)
    assert f"{total} tokens of text" in msg and "1600 are needed" in msg
    assert "fewer --calib-samples or a shorter --calib-seqlen" in msg and "\n" not in msg


def test_bad_files_are_data_errors(model, tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_calibration(CalibrationSpec(str(tmp_path / "missing.txt"), samples=1, seqlen=4), model)
    (tmp_path / "empty.txt").write_text(" \n\n ")
    with pytest.raises(DataError, match="no text"):
        load_calibration(CalibrationSpec(str(tmp_path / "empty.txt"), samples=1, seqlen=4), model)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    with pytest.raises(DataError, match="not UTF-8"):
        load_calibration(CalibrationSpec(str(tmp_path / "latin1.txt"), samples=1, seqlen=4), model)
    (tmp_path / "dir.txt").mkdir()
    with pytest.raises((DataError, UsageError), match="folder"):
        load_calibration(CalibrationSpec(str(tmp_path / "dir.txt"), samples=1, seqlen=4), model)


def test_seqlen_longer_than_the_context_is_refused(model, tiny_text):
    with pytest.raises(UsageError, match="longer than the model's context"):
        load_calibration(CalibrationSpec(str(tiny_text), samples=1, seqlen=model.config.max_position_embeddings + 1),
                         model)


# --- .jsonl ----------------------------------------------------------------------------------------
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_are_documents_joined_with_the_separator(model, tmp_path):
    rows = [{"id": i, "body": d} for i, d in enumerate(DOCS)]
    rows[3]["body"] = None
    rows[7]["body"] = "   "
    path = write_jsonl(tmp_path / "calib.jsonl", rows)
    spec = CalibrationSpec(str(path), samples=6, seqlen=20, seed=2, column="body")
    cs = load_calibration(spec, model)
    kept = [d for i, d in enumerate(DOCS) if i not in (3, 7)]
    assert torch.equal(cs.tokens, expected_rows(ids_of(model, kept), spec))
    p = cs.provenance
    assert (p["format"], p["column"], p["rows"], p["documents"], p["rows_skipped"]) == ("jsonl", "body", 60, 58, 2)
    assert p["separator"] == SEPARATOR == "\n\n"


def test_jsonl_missing_or_empty_column_names_the_columns(model, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": 1, "content": "x y z"}, {"id": 2, "content": "a b"}])
    with pytest.raises(DataError, match=r"no column 'text' \(columns: id, content\)"):
        load_calibration(CalibrationSpec(str(path), samples=1, seqlen=2), model)
    path = write_jsonl(tmp_path / "e.jsonl", [{"id": 1, "text": ""}, {"id": 2, "text": None}])
    with pytest.raises(DataError, match=r"column 'text' has no text in any of its 2 rows \(columns: id, text\)"):
        load_calibration(CalibrationSpec(str(path), samples=1, seqlen=2), model)
    path = write_jsonl(tmp_path / "n.jsonl", [{"text": "a b c"}, {"text": 5}])
    with pytest.raises(DataError, match="row 2: column 'text' holds int, not text"):
        load_calibration(CalibrationSpec(str(path), samples=1, seqlen=2), model)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match="line 2 is not JSON"):
        load_calibration(CalibrationSpec(str(tmp_path / "bad.jsonl"), samples=1, seqlen=2), model)


# --- .parquet --------------------------------------------------------------------------------------
@pytest.fixture
def parquet_file(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install pyarrow)")
    import pyarrow.parquet as pq
    path = tmp_path / "calib.parquet"
    texts = list(DOCS)
    texts[5] = None
    pq.write_table(pa.table({"text": texts, "n": list(range(len(DOCS)))}), path)
    return path


def test_parquet_rows_are_documents(model, parquet_file):
    spec = CalibrationSpec(str(parquet_file), samples=6, seqlen=20, seed=4)
    cs = load_calibration(spec, model)
    kept = [d for i, d in enumerate(DOCS) if i != 5]
    assert torch.equal(cs.tokens, expected_rows(ids_of(model, kept), spec))
    p = cs.provenance
    assert (p["format"], p["column"], p["documents"], p["rows_skipped"]) == ("parquet", "text", 59, 1)
    assert p["sha256"] == hashlib.sha256(parquet_file.read_bytes()).hexdigest()


def test_parquet_missing_or_non_text_column(model, parquet_file, tmp_path):
    with pytest.raises(DataError, match=r"no column 'body' \(columns: text, n\)"):
        load_calibration(CalibrationSpec(str(parquet_file), samples=1, seqlen=2, column="body"), model)
    with pytest.raises(DataError, match=r"column 'n' is int64, not text \(columns: text, n\)"):
        load_calibration(CalibrationSpec(str(parquet_file), samples=1, seqlen=2, column="n"), model)
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match="cannot read as parquet"):
        load_calibration(CalibrationSpec(str(tmp_path / "junk.parquet"), samples=1, seqlen=2), model)


def test_parquet_without_pyarrow_is_a_dependency_error(model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DependencyError, match="pip install pyarrow"):
        load_calibration(CalibrationSpec(str(tmp_path / "x.parquet"), samples=1, seqlen=2), model)


# --- hf: -------------------------------------------------------------------------------------------
def test_hf_without_datasets_is_a_dependency_error(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DependencyError, match=r"pip install 'quantkit\[datasets\]'"):
        load_calibration(CalibrationSpec("hf:Salesforce/wikitext:wikitext-2-raw-v1:train", samples=1, seqlen=2), model)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 with empty caches (the libraries read the variable at import, so patch their copies)."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install 'quantkit[datasets]')")
    import huggingface_hub.constants as hf_constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(datasets.config, "HF_MODULES_CACHE", tmp_path / "modules-cache")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return datasets


def test_hf_offline_with_nothing_cached_is_a_network_error(model, offline):
    with pytest.raises(NetworkError) as e:
        load_calibration(CalibrationSpec("hf:quantkit-test/no-such-dataset:train", samples=1, seqlen=2), model)
    msg = str(e.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE is set" in msg and "hf:quantkit-test/no-such-dataset" in msg


def test_hf_loading_path_on_a_local_parquet(model, offline, parquet_file, tmp_path, monkeypatch):
    """The real hf: code path (builder, download_and_prepare, as_dataset, column, provenance) with the Hub
    replaced by the packaged parquet builder over a local file."""
    datasets = offline
    real = datasets.load_dataset_builder
    asked = {}

    def local_builder(path, name=None, **kw):
        asked.update(path=path, name=name, **kw)
        return real("parquet", data_files=str(parquet_file), cache_dir=str(tmp_path / "ds-cache"))

    monkeypatch.setattr(datasets, "load_dataset_builder", local_builder)
    spec = CalibrationSpec("hf:org/calib@v1:default:train[:40]", samples=5, seqlen=16, seed=3)
    cs = load_calibration(spec, model)
    assert asked == {"path": "org/calib", "name": "default", "revision": "v1"}
    kept = [d for i, d in enumerate(DOCS[:40]) if i != 5]
    assert torch.equal(cs.tokens, expected_rows(ids_of(model, kept), spec))
    p = cs.provenance
    assert (p["kind"], p["dataset"], p["config"], p["split"], p["column"]) == ("hf", "org/calib", "default",
                                                                               "train[:40]", "text")
    assert (p["rows"], p["documents"], p["rows_skipped"], p["requested_revision"]) == (40, 39, 1, "v1")
    assert p["revision"] is None  # a packaged builder's hash is no commit, and the Hub is not asked offline
    with pytest.raises(DataError, match=r"no column 'body' in split 'train\[:40\]' \(columns: text, n\)"):
        load_calibration(CalibrationSpec("hf:org/calib:default:train[:40]:body", samples=1, seqlen=2), model)
    with pytest.raises(DataError, match="hf:org/calib: .*nosuchsplit"):
        load_calibration(CalibrationSpec("hf:org/calib:default:nosuchsplit", samples=1, seqlen=2), model)


def test_hf_revision_is_the_builders_commit_when_it_has_one():
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert calib_hub.resolve_revision("org/ds", sha, None) == sha


# --- self ------------------------------------------------------------------------------------------
def test_self_generation_shape_determinism_and_vocabulary(model):
    spec = CalibrationSpec("self", samples=5, seqlen=12, seed=7)
    state = torch.random.get_rng_state()
    a = load_calibration(spec, model, batch_size=2, device="cpu")
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
    b = load_calibration(spec, model, batch_size=2, device="cpu")
    c = load_calibration(CalibrationSpec("self", samples=5, seqlen=12, seed=8), model, batch_size=2, device="cpu")
    assert a.tokens.shape == (5, 12) and a.tokens.dtype == torch.int64
    assert torch.equal(a.tokens, b.tokens) and a.token_hash == b.token_hash
    assert not torch.equal(a.tokens, c.tokens) and a.token_hash != c.token_hash
    tok = model.tokenizer
    assert int(a.tokens.max()) < len(tok) and not set(a.tokens.flatten().tolist()) & set(tok.all_special_ids)
    p = a.provenance
    assert p["kind"] == "self" and p["temperature"] == 1.0 and p["top_k"] == 50
    assert (p["device"], p["dtype"], p["batch_size"]) == ("cpu", "float32", 2)
    assert json.loads(json.dumps(a.to_json()))["provenance"]["kind"] == "self"


# --- the project's calibration text ----------------------------------------------------------------
def _demo_folder():
    from quantkit.model.source import cache_dir
    folder = cache_dir() / "demo" / "smollm2-135m"
    return folder if (folder / "tokenizer.json").is_file() and (folder / "config.json").is_file() else None


@needs_shared_data(WIKI_VALID)
@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_wikitext_valid_gives_128_windows_of_512(which, tiny_llama):
    if which == "demo":
        folder = _demo_folder()
        if folder is None:
            pytest.skip("the demo checkpoint is not built yet (quantkit builds it on first use of demo:smollm2-135m)")
        model = Checkpoint(folder, name="demo:smollm2-135m")
    else:  # the tiny model's context is 256: only its tokenizer is used here
        model = SimpleNamespace(name="tiny-tokenizer", tokenizer=Checkpoint(tiny_llama).tokenizer, config=None)
    spec = CalibrationSpec(str(WIKI_VALID), samples=128, seqlen=512, seed=0)
    cs = load_calibration(spec, model)
    assert cs.tokens.shape == (128, 512) and cs.tokens.dtype == torch.int64
    assert cs.provenance["tokens_available"] >= 128 * 512
    assert cs.provenance["sha256"] == hashlib.sha256(WIKI_VALID.read_bytes()).hexdigest()
    assert cs.token_hash == token_hash(cs.tokens) and isinstance(cs, CalibrationSet)
    starts = sorted(draw_windows(cs.provenance["tokens_available"], 128, 512, 0))
    assert all(b - a >= 512 for a, b in zip(starts, starts[1:]))

"""Calibration bundles: bundle:NAME and a bundle's folder stand for their pinned text, checked by sha256."""
from __future__ import annotations

import shutil

import pytest

from conftest import ROOT
from quantkit.calibration import CalibrationSpec, load_calibration
from quantkit.calibration.bundles import PROJECT_BUNDLES
from quantkit.calibration.spec import parse_calibration_source
from quantkit.errors import DataError, UsageError
from quantkit.model.source import open_model


def test_shipped_bundle_resolves_to_its_text():
    s = parse_calibration_source("bundle:wikitext2-en")
    assert s.kind == "file" and s.path == PROJECT_BUNDLES / "wikitext2-en" / "wikitext2-valid.txt"
    assert s.bundle["bundle"] == "wikitext2-en" and s.bundle["license"].startswith("CC BY-SA")
    assert parse_calibration_source(str(ROOT / "calibration" / "wikitext2-en")).path == s.path


def test_changed_text_unknown_name_and_search_path(tmp_path, monkeypatch):
    copy = tmp_path / "mine"
    shutil.copytree(PROJECT_BUNDLES / "wikitext2-en", copy)
    monkeypatch.setenv("QUANTKIT_BUNDLES", str(tmp_path))
    assert parse_calibration_source("bundle:mine").path == copy / "wikitext2-valid.txt"
    (copy / "wikitext2-valid.txt").write_text("edited\n")
    with pytest.raises(DataError, match="sha256"):
        parse_calibration_source("bundle:mine")
    with pytest.raises(UsageError, match="not found; known: .*wikitext2-en"):
        parse_calibration_source("bundle:nope")


def test_bundle_provenance_is_recorded(tiny_gguf_source):
    model = open_model(str(tiny_gguf_source))
    cal = load_calibration(CalibrationSpec(source="bundle:wikitext2-en", samples=4, seqlen=32), model)
    record = cal.to_json()
    assert record["source"] == "bundle:wikitext2-en"
    assert record["provenance"]["bundle"]["manifest_sha256"] and record["provenance"]["kind"] == "file"
    direct = load_calibration(CalibrationSpec(source=str(PROJECT_BUNDLES / "wikitext2-en" / "wikitext2-valid.txt"),
                                              samples=4, seqlen=32), model)
    assert direct.token_hash == cal.token_hash

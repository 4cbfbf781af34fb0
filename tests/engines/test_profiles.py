import pytest

from engines.config import EngineBuildConfig
from engines.errors import EngineConfigError, EngineLimitError
from engines.profiles import DECODE, PREFILL, Profile, ShapeRange, choose_profile, dim_ranges, graph_profiles
from runtime.manifest import GraphSpec, TensorSpec, load_manifest

SMALL = EngineBuildConfig(max_batch=4, max_seq=32, max_prompt=16)


@pytest.fixture
def manifest(artifact_dir):
    return load_manifest(artifact_dir, check_hashes=False)  # hidden 32, 4 heads of 8, vocab 512


def table(profile: Profile) -> dict:
    return {name: (r.min, r.opt, r.max) for name, r in profile.shapes.items()}


def test_dim_ranges_default_limits():
    prefill, decode = dim_ranges(EngineBuildConfig())  # batch 8, sequence 1024, prompt = sequence
    assert prefill == {"batch": (1, 4, 8), "sequence": (1, 512, 1024), "past_sequence": (0, 0, 0),
                       "total_sequence": (1, 512, 1024)}
    assert decode == {"batch": (1, 4, 8), "sequence": (1, 1, 1), "past_sequence": (0, 512, 1023),
                      "total_sequence": (1, 513, 1024)}


def test_dim_ranges_edge_limits():
    prefill, decode = dim_ranges(EngineBuildConfig(max_batch=1, max_seq=1))
    assert prefill["batch"] == (1, 1, 1) and prefill["sequence"] == (1, 1, 1)
    assert decode["past_sequence"] == (0, 0, 0) and decode["total_sequence"] == (1, 1, 1)


def test_embed_profiles(manifest):
    prefill, decode = graph_profiles(manifest.embed, SMALL)
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert table(prefill) == {"input_ids": ((1, 1), (2, 8), (4, 16)),
                              "attention_mask": ((1, 1), (2, 8), (4, 16))}
    assert table(decode) == {"input_ids": ((1, 1), (2, 1), (4, 1)),
                             "attention_mask": ((1, 1), (2, 17), (4, 32))}


def test_layer_profiles(manifest):
    for spec in manifest.layers:
        prefill, decode = graph_profiles(spec, SMALL)
        assert table(prefill) == {
            "hidden_states": ((1, 1, 32), (2, 8, 32), (4, 16, 32)),
            "attention_mask": ((1, 1), (2, 8), (4, 16)),
            "past_key": ((1, 4, 0, 8), (2, 4, 0, 8), (4, 4, 0, 8)),
            "past_value": ((1, 4, 0, 8), (2, 4, 0, 8), (4, 4, 0, 8))}
        assert table(decode) == {
            "hidden_states": ((1, 1, 32), (2, 1, 32), (4, 1, 32)),
            "attention_mask": ((1, 1), (2, 17), (4, 32)),
            "past_key": ((1, 4, 0, 8), (2, 4, 16, 8), (4, 4, 31, 8)),
            "past_value": ((1, 4, 0, 8), (2, 4, 16, 8), (4, 4, 31, 8))}


def test_head_profiles(manifest):
    prefill, decode = graph_profiles(manifest.head, SMALL)
    assert table(prefill) == {"hidden_states": ((1, 1, 32), (2, 8, 32), (4, 16, 32))}
    assert table(decode) == {"hidden_states": ((1, 1, 32), (2, 1, 32), (4, 1, 32))}


def test_opt_shapes_are_consistent(manifest):
    """At opt, total = past + sequence, so TensorRT tunes for a shape that can really occur."""
    for spec in manifest.layers[:1]:
        for profile in graph_profiles(spec, SMALL):
            hidden, mask, past = (profile.shapes[n].opt for n in ("hidden_states", "attention_mask", "past_key"))
            assert mask[1] == past[2] + hidden[1]


def test_unknown_dim_is_refused():
    spec = GraphSpec("layer_00", "layer_00.onnx", [TensorSpec("x", "float32", ["batch", "beams"])], [])
    with pytest.raises(EngineConfigError,
                       match="graph layer_00 input x has dim 'beams', which no optimization profile knows"):
        graph_profiles(spec, SMALL)


def test_profile_round_trip(manifest):
    for profile in graph_profiles(manifest.layers[0], SMALL):
        assert Profile.from_dict(profile.to_dict()) == profile


def test_shape_range_contains():
    r = ShapeRange((1, 0), (2, 4), (4, 8))
    assert r.contains((1, 0)) and r.contains((4, 8)) and r.contains([2, 3])
    assert not r.contains((5, 1)) and not r.contains((1, 9)) and not r.contains((1, 1, 1))


def layer_shapes(batch, sequence, past):
    kv = (batch, 4, past, 8)
    return {"hidden_states": (batch, sequence, 32), "attention_mask": (batch, past + sequence),
            "past_key": kv, "past_value": kv}


def test_choose_profile(manifest):
    profiles = graph_profiles(manifest.layers[0], SMALL)
    prompt, step, first = layer_shapes(3, 7, 0), layer_shapes(3, 1, 7), layer_shapes(3, 1, 0)
    assert choose_profile(profiles, prompt) == PREFILL
    assert choose_profile(profiles, step, current=PREFILL) == DECODE
    assert choose_profile(profiles, first) == PREFILL  # both hold it: the first wins
    assert choose_profile(profiles, first, current=DECODE) == DECODE  # ... unless already active


def test_choose_profile_out_of_range(manifest):
    profiles = graph_profiles(manifest.layers[0], SMALL)
    too_long = layer_shapes(1, 1, 32)
    with pytest.raises(EngineLimitError) as info:
        choose_profile(profiles, too_long, graph="layer_00")
    message = str(info.value)
    assert message.startswith("layer_00: input shapes hidden_states [1, 1, 32], attention_mask [1, 33]")
    assert "decode: hidden_states [1, 1, 32]..[4, 1, 32], attention_mask [1, 1]..[4, 32]" in message
    assert message.endswith("rebuild the engines with larger --max-batch / --max-seq / --max-prompt")

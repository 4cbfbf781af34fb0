import pytest

from engines.config import EngineBuildConfig
from engines.errors import EngineConfigError, EngineLimitError
from engines.profiles import (DECODE, PREFILL, Profile, ShapeRange, choose_profile, dim_ranges, graph_profiles,
                             max_pages)
from runtime.manifest import GraphSpec, TensorSpec, load_manifest

SMALL = EngineBuildConfig(max_batch=4, max_seq=48, max_prompt=16)  # 2 pages of 32


@pytest.fixture
def manifest(artifact_dir):
    return load_manifest(artifact_dir, check_hashes=False)  # hidden 32, 4 heads of 8, vocab 512


def table(profile: Profile) -> dict:
    return {name: (r.min, r.opt, r.max) for name, r in profile.shapes.items()}


def test_dim_ranges_default_limits():
    prefill, decode = dim_ranges(EngineBuildConfig(), 32)  # batch 8, sequence 1024, prompt = sequence
    assert prefill == {"batch": (1, 4, 8), "sequence": (1, 512, 1024), "past_pages": (1, 1, 1),
                       "total_sequence": (33, 544, 1056)}  # the zero page's 32 columns + the prompt
    assert decode == {"batch": (1, 4, 8), "sequence": (1, 1, 1), "past_pages": (1, 16, 32),
                      "total_sequence": (33, 513, 1025)}  # pages * 32 + 1


def test_dim_ranges_unpaged_graph_and_edges():
    prefill, decode = dim_ranges(EngineBuildConfig(), 32, paged=False)  # the embedding
    assert prefill["total_sequence"] == (1, 512, 1024)  # the prompt's own mask
    assert decode["total_sequence"] == (33, 513, 1025)  # the layers' mask at decode
    prefill, decode = dim_ranges(EngineBuildConfig(max_batch=1, max_seq=1), 32)
    assert prefill["batch"] == (1, 1, 1) and prefill["sequence"] == (1, 1, 1)
    assert decode["past_pages"] == (1, 1, 1) and decode["total_sequence"] == (33, 33, 33)
    assert dim_ranges(EngineBuildConfig(max_seq=33), 32)[1]["past_pages"] == (1, 1, 2)  # a partial page
    assert max_pages(64, 32) == 2 and max_pages(65, 32) == 3


def test_embed_profiles(manifest):
    prefill, decode = graph_profiles(manifest.embed, SMALL, manifest.page_size)
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert table(prefill) == {"input_ids": ((1, 1), (2, 8), (4, 16)),
                              "attention_mask": ((1, 1), (2, 8), (4, 16))}
    assert table(decode) == {"input_ids": ((1, 1), (2, 1), (4, 1)),
                             "attention_mask": ((1, 33), (2, 33), (4, 65))}


def test_layer_profiles(manifest):
    assert manifest.page_size == 32
    for spec in manifest.layers:
        prefill, decode = graph_profiles(spec, SMALL, manifest.page_size)
        assert table(prefill) == {
            "hidden_states": ((1, 1, 32), (2, 8, 32), (4, 16, 32)),
            "attention_mask": ((1, 33), (2, 40), (4, 48)),
            "past_key": ((1, 1, 4, 8, 32), (1, 2, 4, 8, 32), (1, 4, 4, 8, 32)),
            "past_value": ((1, 1, 4, 32, 8), (1, 2, 4, 32, 8), (1, 4, 4, 32, 8))}
        assert table(decode) == {
            "hidden_states": ((1, 1, 32), (2, 1, 32), (4, 1, 32)),
            "attention_mask": ((1, 33), (2, 33), (4, 65)),
            "past_key": ((1, 1, 4, 8, 32), (1, 2, 4, 8, 32), (2, 4, 4, 8, 32)),
            "past_value": ((1, 1, 4, 32, 8), (1, 2, 4, 32, 8), (2, 4, 4, 32, 8))}


def test_head_profiles(manifest):
    prefill, decode = graph_profiles(manifest.head, SMALL, manifest.page_size)
    assert table(prefill) == {"hidden_states": ((1, 1, 32), (2, 8, 32), (4, 16, 32))}
    assert table(decode) == {"hidden_states": ((1, 1, 32), (2, 1, 32), (4, 1, 32))}


def test_total_sequence_is_the_bound_pages_plus_the_new_positions(manifest):
    """At min, opt and max, total = past_pages * page + sequence, so TensorRT tunes for shapes that
    really occur and accepts every one the runtime makes."""
    for config in (SMALL, EngineBuildConfig(max_batch=3, max_seq=64, max_prompt=40)):
        for profile in graph_profiles(manifest.layers[0], config, 32):
            for point in ("min", "opt", "max"):
                hidden, mask, past = (getattr(profile.shapes[n], point)
                                      for n in ("hidden_states", "attention_mask", "past_key"))
                assert mask[1] == past[0] * 32 + hidden[1]


def test_unknown_dim_is_refused():
    spec = GraphSpec("layer_00", "layer_00.onnx", [TensorSpec("x", "float32", ["batch", "beams"])], [])
    with pytest.raises(EngineConfigError,
                       match="graph layer_00 input x has dim 'beams', which no optimization profile knows"):
        graph_profiles(spec, SMALL, 32)


def test_profile_round_trip(manifest):
    for profile in graph_profiles(manifest.layers[0], SMALL, 32):
        assert Profile.from_dict(profile.to_dict()) == profile


def test_shape_range_contains():
    r = ShapeRange((1, 0), (2, 4), (4, 8))
    assert r.contains((1, 0)) and r.contains((4, 8)) and r.contains([2, 3])
    assert not r.contains((5, 1)) and not r.contains((1, 9)) and not r.contains((1, 1, 1))


def layer_shapes(batch, sequence, pages):
    return {"hidden_states": (batch, sequence, 32), "attention_mask": (batch, pages * 32 + sequence),
            "past_key": (pages, batch, 4, 8, 32), "past_value": (pages, batch, 4, 32, 8)}


def test_choose_profile(manifest):
    profiles = graph_profiles(manifest.layers[0], SMALL, 32)
    prompt, step, late = layer_shapes(3, 7, 1), layer_shapes(3, 1, 1), layer_shapes(3, 1, 2)
    assert choose_profile(profiles, prompt) == PREFILL
    assert choose_profile(profiles, late, current=PREFILL) == DECODE
    assert choose_profile(profiles, step) == PREFILL  # both hold it: the first wins
    assert choose_profile(profiles, step, current=DECODE) == DECODE  # ... unless already active
    assert choose_profile(profiles, step, current=PREFILL, prefer=DECODE) == DECODE  # ... or preferred
    assert choose_profile(profiles, prompt, current=PREFILL, prefer=DECODE) == PREFILL  # if it holds


def test_choose_profile_out_of_range(manifest):
    profiles = graph_profiles(manifest.layers[0], SMALL, 32)
    too_long = layer_shapes(1, 1, 3)
    with pytest.raises(EngineLimitError) as info:
        choose_profile(profiles, too_long, graph="layer_00")
    message = str(info.value)
    assert message.startswith("layer_00: input shapes hidden_states [1, 1, 32], attention_mask [1, 97]")
    assert "decode: hidden_states [1, 1, 32]..[4, 1, 32], attention_mask [1, 33]..[4, 65]" in message
    assert message.endswith("rebuild the engines with larger --max-batch / --max-seq / --max-prompt")

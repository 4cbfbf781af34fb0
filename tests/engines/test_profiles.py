import pytest

from engines.config import EngineBuildConfig
from engines.errors import EngineConfigError, EngineLimitError
from engines.profiles import DECODE, PREFILL, Profile, ShapeRange, choose_profile, dim_ranges, graph_profiles
from runtime.artifact.manifest import GraphSpec, TensorSpec, load_manifest
from runtime.kvcache import pages_width

SMALL = EngineBuildConfig(max_batch=4, max_seq=48, max_prompt=16)  # 2 pages of 32


@pytest.fixture
def manifest(artifact_dir):
    return load_manifest(artifact_dir, check_hashes=False)  # hidden 32, 4 heads of 8, vocab 512


def table(profile: Profile) -> dict:
    return {name: (r.min, r.opt, r.max) for name, r in profile.shapes.items()}


def test_dim_ranges_default_limits():
    prefill, decode = dim_ranges(EngineBuildConfig(), 32)  # batch 8, sequence 1024, prompt = sequence
    # the bound past + the prompt; opt: a prompt of 512 into fresh rows binds one page of zeros
    assert prefill == {"batch": (1, 4, 8), "sequence": (1, 512, 1024), "past_sequence": (32, 32, 1024),
                       "total_sequence": (33, 544, 2048)}
    assert decode == {"batch": (1, 4, 8), "sequence": (1, 1, 1), "past_sequence": (32, 512, 1024),
                      "total_sequence": (33, 513, 1025)}  # whole pages + 1


def test_dim_ranges_edges():
    prefill, decode = dim_ranges(EngineBuildConfig(max_batch=1, max_seq=1), 32)
    assert prefill == {"batch": (1, 1, 1), "sequence": (1, 1, 1), "past_sequence": (32, 32, 32),
                       "total_sequence": (33, 33, 33)}  # even one position binds a whole page
    assert decode["past_sequence"] == (32, 32, 32) and decode["total_sequence"] == (33, 33, 33)
    prefill, decode = dim_ranges(EngineBuildConfig(max_seq=33), 32)  # a partial page is bound whole
    assert prefill["past_sequence"] == decode["past_sequence"] == (32, 32, 64)
    assert prefill["total_sequence"] == (33, 49, 97) and decode["total_sequence"] == (33, 33, 65)
    assert dim_ranges(EngineBuildConfig(max_seq=160), 32)[1]["past_sequence"] == (32, 96, 160)  # opt 3 of 5 pages
    assert dim_ranges(EngineBuildConfig(max_seq=10, max_prompt=4), 4)[0]["past_sequence"] == (4, 4, 12)
    prefill = dim_ranges(EngineBuildConfig(max_seq=160, max_prompt=100), 32)[0]  # opt prompt 50: one page
    assert prefill["past_sequence"] == (32, 32, 160) and prefill["total_sequence"] == (33, 82, 260)
    assert pages_width(64, 32) == 64 and pages_width(65, 32) == 96


def test_embed_profiles(manifest):
    prefill, decode = graph_profiles(manifest.embed, SMALL, manifest.page_size)
    assert (prefill.name, decode.name) == ("prefill", "decode")
    # the layers' mask: the bound past (one page at min and opt, two at max) + the new positions
    assert table(prefill) == {"input_ids": ((1, 1), (2, 8), (4, 16)),
                              "attention_mask": ((1, 33), (2, 40), (4, 80))}
    assert table(decode) == {"input_ids": ((1, 1), (2, 1), (4, 1)),
                             "attention_mask": ((1, 33), (2, 33), (4, 65))}


def test_layer_profiles(manifest):
    assert manifest.page_size == 32
    for spec in manifest.layers:
        prefill, decode = graph_profiles(spec, SMALL, manifest.page_size)
        assert table(prefill) == {
            "hidden_states": ((1, 1, 32), (2, 8, 32), (4, 16, 32)),
            "attention_mask": ((1, 33), (2, 40), (4, 80)),
            "past_key": ((1, 4, 8, 32), (2, 4, 8, 32), (4, 4, 8, 64)),
            "past_value": ((1, 4, 32, 8), (2, 4, 32, 8), (4, 4, 64, 8))}
        assert table(decode) == {
            "hidden_states": ((1, 1, 32), (2, 1, 32), (4, 1, 32)),
            "attention_mask": ((1, 33), (2, 33), (4, 65)),
            "past_key": ((1, 4, 8, 32), (2, 4, 8, 32), (4, 4, 8, 64)),
            "past_value": ((1, 4, 32, 8), (2, 4, 32, 8), (4, 4, 64, 8))}


def test_head_profiles(manifest):
    prefill, decode = graph_profiles(manifest.head, SMALL, manifest.page_size)
    assert table(prefill) == {"hidden_states": ((1, 1, 32), (2, 8, 32), (4, 16, 32))}
    assert table(decode) == {"hidden_states": ((1, 1, 32), (2, 1, 32), (4, 1, 32))}


def test_total_sequence_is_the_bound_past_plus_the_new_positions(manifest):
    """At min, opt and max, total = past_sequence + sequence, and past_sequence is whole pages, so
    TensorRT tunes for shapes that really occur and accepts every one the runtime makes; the
    embedding's mask ranges are the layers'."""
    for config in (SMALL, EngineBuildConfig(max_batch=3, max_seq=64, max_prompt=40),
                   EngineBuildConfig(max_batch=2, max_seq=100, max_prompt=7)):
        layer = graph_profiles(manifest.layers[0], config, 32)
        embed = graph_profiles(manifest.embed, config, 32)
        for profile, embed_profile in zip(layer, embed):
            assert embed_profile.shapes["attention_mask"] == profile.shapes["attention_mask"]
            for point in ("min", "opt", "max"):
                hidden, mask, key, value = (getattr(profile.shapes[n], point)
                                            for n in ("hidden_states", "attention_mask", "past_key", "past_value"))
                assert key[3] == value[2] and key[3] % 32 == 0 and key[3] >= 32
                assert mask[1] == key[3] + hidden[1]
            r = profile.shapes["past_key"]
            assert r.min[3] <= r.opt[3] <= r.max[3] == -(-config.max_seq // 32) * 32


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


def layer_shapes(batch, sequence, width):
    return {"hidden_states": (batch, sequence, 32), "attention_mask": (batch, width + sequence),
            "past_key": (batch, 4, 8, width), "past_value": (batch, 4, width, 8)}


def test_choose_profile(manifest):
    profiles = graph_profiles(manifest.layers[0], SMALL, 32)
    prompt, step, late = layer_shapes(3, 7, 32), layer_shapes(3, 1, 32), layer_shapes(3, 1, 64)
    chunk = layer_shapes(3, 7, 64)  # a prompt's second chunk, over a past two pages wide
    assert choose_profile(profiles, prompt) == PREFILL
    assert choose_profile(profiles, chunk, current=DECODE) == PREFILL  # only prefill holds it
    assert choose_profile(profiles, late, current=DECODE) == DECODE
    assert choose_profile(profiles, late, prefer=DECODE) == DECODE
    assert choose_profile(profiles, step) == PREFILL  # both hold it: the first wins
    assert choose_profile(profiles, step, current=DECODE) == DECODE  # ... unless already active
    assert choose_profile(profiles, step, current=PREFILL, prefer=DECODE) == DECODE  # ... or preferred
    assert choose_profile(profiles, prompt, current=PREFILL, prefer=DECODE) == PREFILL  # if it holds


def test_choose_profile_out_of_range(manifest):
    profiles = graph_profiles(manifest.layers[0], SMALL, 32)
    too_long = layer_shapes(1, 1, 96)  # three pages: max_seq 48 binds at most two
    with pytest.raises(EngineLimitError) as info:
        choose_profile(profiles, too_long, graph="layer_00")
    message = str(info.value)
    assert message.startswith("layer_00: input shapes hidden_states [1, 1, 32], attention_mask [1, 97]")
    assert "decode: hidden_states [1, 1, 32]..[4, 1, 32], attention_mask [1, 33]..[4, 65]" in message
    assert message.endswith("rebuild the engines with larger --max-batch / --max-seq / --max-prompt")

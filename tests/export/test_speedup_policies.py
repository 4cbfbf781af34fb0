"""A model's own policy per speedup target: skipdecode.json's ``speedup_policies`` reaches the
manifest, checked; ``speedup=S`` runs it for exactly that S and SkipPolicy.for_speedup's pick for
any other; a table that lies about its speedup stops the build, a tampered one the load."""

import json
import shutil

import pytest

import runtime
from export.build import BuildOptions, build
from runtime.errors import ArtifactError, PolicyError
from runtime.policy import SkipPolicy

HORIZON = 47


def _flatter_2x(num_layers: int) -> dict:
    """A 2x policy over HORIZON steps other than for_speedup's pick (a flatter one)."""
    picked = SkipPolicy.for_speedup(num_layers, 2, HORIZON)
    for hi in range(num_layers, 0, -1):
        for lo in range(hi, 0, -1):
            p = SkipPolicy(num_layers, hi, lo, horizon=HORIZON)
            if (hi, lo) != (picked.max_layers, picked.min_layers) and abs(p.theoretical_speedup() - 2) <= 0.05:
                return {"max_layers": hi, "min_layers": lo}
    pytest.skip(f"no second 2x policy for {num_layers} layers")


def _trained(checkpoint_dir, tmp_path, table) -> object:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir, ckpt)
    (ckpt / "skipdecode.json").write_text(json.dumps({"format": "skipdecode-finetune", "horizon": HORIZON,
                                                      "warmup_layers": 1, "speedups": [1.0, 2.0],
                                                      "speedup_policies": table}))
    return ckpt


def test_the_table_reaches_the_manifest_and_speedup_2_runs_it(checkpoint_dir, tmp_path):
    num_layers = json.loads((checkpoint_dir / "config.json").read_text())["num_hidden_layers"]
    own = _flatter_2x(num_layers)
    out = tmp_path / "art"
    manifest = build(BuildOptions(model=str(_trained(checkpoint_dir, tmp_path, {"2": own})), out=str(out),
                                  progress=False), log=lambda *_: None)
    assert manifest.policy["speedup_policies"] == {"2": own}
    g = runtime.load(out, threads=1, check_hashes=False)
    try:
        for kwargs in ({"speedup": 2}, {"policy": {"speedup": 2.0}}):
            policy = g.policy_for(16, **kwargs)
            assert (policy.max_layers, policy.min_layers, policy.horizon) == (own["max_layers"], own["min_layers"], HORIZON)
        assert g.generate("Hello", 4, speedup=2).policy.max_layers == own["max_layers"]
        other = g.policy_for(16, speedup=1.5)  # no entry: for_speedup's pick
        assert (other.max_layers, other.min_layers) == (lambda p: (p.max_layers, p.min_layers))(
            SkipPolicy.for_speedup(num_layers, 1.5, HORIZON))
        # a call that sets more than the target keeps for_speedup's choice for its own settings
        assert g.policy_for(16, speedup=2, decay="power").decay == "power"
    finally:
        g.close()

    text = (out / "manifest.json").read_text()
    data = json.loads(text)
    data["policy"]["speedup_policies"] = {"2": {"max_layers": num_layers, "min_layers": num_layers}}
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=r"not a valid skip policy .*speedup_policies\['2'\].* not 2x"):
        runtime.load(out, threads=1, check_hashes=False)


def test_a_table_whose_speedup_is_wrong_stops_the_build(checkpoint_dir, tmp_path):
    num_layers = json.loads((checkpoint_dir / "config.json").read_text())["num_hidden_layers"]
    table = {"2": {"max_layers": num_layers, "min_layers": num_layers}}
    with pytest.raises(PolicyError, match=r"speedup_policies\['2'\]: .* is a 1\.00x policy over 47 steps, not 2x"):
        build(BuildOptions(model=str(_trained(checkpoint_dir, tmp_path, table)), out=str(tmp_path / "art"),
                           progress=False), log=lambda *_: None)
    assert not (tmp_path / "art").exists()  # nothing written


@pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True)
def test_deep_copies_reach_the_manifest_and_a_bad_entry_stops_the_build(checkpoint_dir, tmp_path):
    """skipdecode.json's ``deep_copies`` (runtime.decoding.copying) is the artifact's default."""
    ckpt = _trained(checkpoint_dir, tmp_path, {})
    meta = json.loads((ckpt / "skipdecode.json").read_text())
    meta.pop("speedup_policies")
    (ckpt / "skipdecode.json").write_text(json.dumps({**meta, "deep_copies": {"layers": 2, "common_words": ["b", "a"]}}))
    manifest = build(BuildOptions(model=str(ckpt), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    assert manifest.policy["deep_copies"] == {"layers": 2, "common_words": ["a", "b"]}
    (ckpt / "skipdecode.json").write_text(json.dumps({**meta, "deep_copies": {"layers": 0}}))
    with pytest.raises(ArtifactError, match=r"deep_copies.layers must lie in \[1, "):
        build(BuildOptions(model=str(ckpt), out=str(tmp_path / "art2"), progress=False), log=lambda *_: None)
    assert not (tmp_path / "art2" / "manifest.json").exists()

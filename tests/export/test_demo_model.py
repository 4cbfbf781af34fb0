"""The demo model that ships in models/ and is the default of `python -m export build`."""

from __future__ import annotations

import json

import pytest

import runtime
from export.build import BuildOptions, build
from export.checkpoint import DEMO_MODEL_DIR
from tools.evaluate.slots import slot_errors

MR = "name[The Eagle], eatType[coffee shop], food[French], area[riverside]"


def test_demo_model_is_small_and_records_its_skipdecode_training():
    size = sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir())
    assert size <= 20 * 2**20, f"{size / 2**20:.1f} MB: the demo model must stay <= 20 MB"
    meta = json.loads((DEMO_MODEL_DIR / "skipdecode.json").read_text())
    assert meta["horizon"] == 32 and meta["speedups"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert (DEMO_MODEL_DIR / "README.md").read_text().count("CC BY-SA 4.0") >= 1


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    return out, build(BuildOptions(out=str(out), progress=False), log=lambda *_: None)


def test_default_build_exports_the_demo_model_and_it_describes_the_restaurant(demo):
    directory, manifest = demo
    assert manifest.model.num_layers == 12
    assert manifest.policy == {"max_layers": 12, "min_layers": 12, "warmup_layers": 1, "horizon": 32}
    gen = runtime.load(directory, threads=1)
    for speedup in (1, 2, 5):
        result = gen.generate(MR, max_new_tokens=48, speedup=speedup)
        errors = slot_errors(MR, result.texts[0])  # README's example must be described faithfully
        assert errors.errors == 0, (speedup, result.texts[0], errors)
        assert result.token_ids[0][-1] == manifest.model.eos_token_id, "a finished description"


def test_verify_passes_on_the_demo_model(demo):
    """A trained model ends rows early (EOS): verify compares logits of running rows only."""
    from export.verify import verify

    report = verify(demo[0], progress=False)
    assert report.passed, report.lines
    assert any(line.startswith("[  ok] full depth logits: max |diff|") for line in report.lines)

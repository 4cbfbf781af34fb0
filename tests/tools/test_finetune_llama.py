"""tools.finetune on the Llama family: the same per-(row, position, layer) mask as OPT, equal to
step-by-step decoding; training resumes exactly and writes a checkpoint export build accepts."""

from __future__ import annotations

import pytest
import torch

from runtime.models import skip_model
from runtime.policy import SkipPolicy
from tests.families import VARIANTS, save_tiny_checkpoint, tiny_model
from tests.tools.test_finetune import _config, assert_equals_step_by_step
from tools.finetune.skip import layer_mask, skip_forward
from tools.finetune.train import train


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_masked_parallel_pass_equals_step_by_step_decoding(variant):
    """At every target position the training pass gives the logits of decoding the same tokens step
    by step under the row's policy (teacher forcing), RoPE positions and GQA included."""
    model = skip_model(tiny_model(variant))
    policies = [SkipPolicy(5, 4, 2, horizon=5), SkipPolicy(5, 3, 3, horizon=8, prefill="policy")]
    prompt_lens, lengths = [4, 7], [12, 10]  # different prompts, right padding in the batch
    T = max(lengths)
    ids = torch.randint(4, 512, (2, T), generator=torch.Generator().manual_seed(0))
    attention = torch.zeros(2, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        attention[b, :n] = 1
    with torch.no_grad():
        parallel = skip_forward(model, ids, attention, layer_mask(policies, torch.tensor(prompt_lens), T))

    assert_equals_step_by_step(model, ids, parallel, policies, prompt_lens, lengths)


def _weights(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def test_training_resumes_exactly_and_export_build_accepts_the_result(tmp_path):
    import runtime
    from export.build import BuildOptions, build

    tiny = save_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    out = train(_config(tiny, tmp_path, epochs=2, speedups=(1.0, 2.0), horizon=6))
    meta = (out / "skipdecode.json").read_text()
    assert '"horizon": 6' in meta
    resumed = train(_config(tiny, tmp_path, epochs=2, speedups=(1.0, 2.0), horizon=6,
                            out=str(tmp_path / "out2"), resume=str(out / "checkpoint-4")))
    a, b = _weights(out), _weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6, msg=name)

    manifest = build(BuildOptions(model=str(out), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    assert (manifest.model.architecture, manifest.policy["horizon"]) == ("qwen3", 6)
    gen = runtime.load(tmp_path / "art", threads=1)
    try:
        assert gen.policy_for(max_new_tokens=40, speedup=2.0) == SkipPolicy.for_speedup(5, 2.0, horizon=6)
        assert len(gen.generate("name[Place 1]", 4, ignore_eos=True).token_ids[0]) == 4
    finally:
        gen.close()


def test_fine_tuning_starts_from_a_gguf_file(tmp_path):
    """--model takes what export build takes: a GGUF file (here a tiny Qwen3 written as llama.cpp
    lays it out) trains, and the checkpoint it writes exports."""
    from export.build import BuildOptions, build
    from export.checkpoint import build_tokenizer
    from tools.bench.gguf_file import write_checkpoint_gguf

    gguf = write_checkpoint_gguf(tiny_model("qwen3"), build_tokenizer(), tmp_path / "tiny.gguf")
    out = train(_config(gguf, tmp_path, epochs=1, speedups=(1.0, 2.0), horizon=6))
    assert '"horizon": 6' in (out / "skipdecode.json").read_text()
    manifest = build(BuildOptions(model=str(out), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    assert manifest.model.architecture == "qwen3" and manifest.source["kind"] == "local"

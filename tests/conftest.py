"""Tiny random OPT checkpoints built from OPTConfig (nothing is downloaded), and their exports."""

from __future__ import annotations

import os
import re

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from export.build import BuildOptions, build
from export.checkpoint import build_tokenizer

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over", "Paris"]  # different lengths
# A wide init keeps the top logits apart, so greedy choices do not hinge on float rounding.
VARIANTS = {
    # pre-LayerNorm with a final layer norm, like OPT-125m and OPT-1.3b and up
    "pre_ln": dict(do_layer_norm_before=True, word_embed_proj_dim=32),
    # post-LayerNorm, project_in/project_out, no final layer norm, like OPT-350m
    "post_ln_350m": dict(do_layer_norm_before=False, word_embed_proj_dim=16),
}


@pytest.fixture(autouse=True)
def _auto_spin_finds_the_cores_taken(monkeypatch):
    """The tests share one process, and spin="auto" (the command lines' default) on free cores makes
    ONNX Runtime's process-wide spinning pool, on which every later session of the process would then
    run. Here "auto" finds the cores taken (sleeping workers, as a library load's); the free case runs
    in processes of their own (tests/runtime/test_cpu_idle.py)."""
    import runtime.platform.cpu_idle

    monkeypatch.setattr(runtime.platform.cpu_idle, "cores_free", lambda *args, **kwargs: False)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """The torch backend sets PyTorch's threads process-wide (``runtime.load(backend="torch",
    threads=N)``); a later test that compares torch in this process with torch in a child (export's
    reference side) then summed in another order and missed its 1e-6 (tests/export/test_reference.py
    after tests/export/test_fused.py's torch load with threads=1). Each test leaves the count as it found it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def _torch_threads_restored_per_module():
    """The same for a module-scoped generator (tests/runtime/test_engine.py's torch ``engine_gen``
    at threads=1): made before a test's own fixture looks, it left the count at 1 for the modules
    after it (tests/export/test_reference.py then missed its 1e-6 when run after it)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def first_logits(gen, prompts, **kwargs):
    """(B, V): each prompt's first token's logits from ``gen.stream``, whose events carry the rows
    at one step each (an int8/int4 artifact prefills its rows one at a time: batch_invariant)."""
    import numpy as np

    rows = {}
    for event in gen.stream(prompts, 1, **kwargs):
        rows.update({b: event.logits[b] for b, t in enumerate(event.token_ids) if t is not None})
    return np.stack([rows[b] for b in range(len(prompts))])


def tiny_config(variant: str, **overrides) -> OPTConfig:
    fields = dict(vocab_size=512, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                  ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=2,
                  eos_token_id=2, init_std=0.2, **VARIANTS[variant])
    fields.update(overrides)
    return OPTConfig(**fields)


def save_tiny_checkpoint(directory, variant: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = OPTForCausalLM(tiny_config(variant, **overrides)).eval()
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session", params=list(VARIANTS))
def checkpoint_dir(request, tmp_path_factory):
    """A saved Hugging Face OPT checkpoint directory, once per variant."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def hf_model(checkpoint_dir):
    return OPTForCausalLM.from_pretrained(checkpoint_dir).eval()


@pytest.fixture(scope="session")
def tokenizer(checkpoint_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint_dir)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def artifact_dir(checkpoint_dir, tmp_path_factory):
    """The fp32 export of ``checkpoint_dir``."""
    out = tmp_path_factory.mktemp("artifact") / "model"
    build(BuildOptions(model=str(checkpoint_dir), out=str(out), progress=False), log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def fp16_artifact_dir(checkpoint_dir, tmp_path_factory):
    """The fp16 export of ``checkpoint_dir``."""
    out = tmp_path_factory.mktemp("fp16-artifact") / "model"
    build(BuildOptions(model=str(checkpoint_dir), out=str(out), dtype="float16", progress=False),
          log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def generator(artifact_dir):
    import runtime

    gen = runtime.load(artifact_dir, threads=1)
    yield gen
    gen.close()


# Skips a CI run accepts (SKIPDECODE_CI=1, set by .ci/run): what the machine lacks and no set-up can
# install (a GPU, TensorRT, a CPU feature, an OS facility), or a parametrized case with nothing to
# test. Any other skip there, an optional package the set-up installs but that failed to install
# above all, fails the run: it would otherwise turn green with hundreds of tests skipped.
EXPECTED_SKIPS = re.compile(
    r"CUDA|GPU|TensorRT|could not import 'tensorrt'|MADV_COLLAPSE|/dev/full|ARM64|/proc/stat|renameat2|"
    r"runtime\.platform\.kernels cannot run here|written for x86-64|this CPU lacks|no C compiler|predates|"
    r"did not grow one region|no second 2x policy")


def _unexpected_skips(config) -> list[str]:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    found = []
    for report in (reporter.stats.get("skipped", []) if reporter else []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not EXPECTED_SKIPS.search(reason):
            found.append(f"{report.nodeid}: {reason}")
    return found


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("SKIPDECODE_CI") == "1" and exitstatus == 0 and _unexpected_skips(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if os.environ.get("SKIPDECODE_CI") == "1":
        unexpected = _unexpected_skips(config)
        if unexpected:
            terminalreporter.section("skips CI does not expect (SKIPDECODE_CI=1: tests/conftest.py EXPECTED_SKIPS)")
            for line in unexpected:
                terminalreporter.write_line(line)

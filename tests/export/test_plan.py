"""export plan: exact byte counts on tiny configs, the fit table, CLI errors, --measure."""

from __future__ import annotations

import onnx
import pytest
from transformers import OPTConfig, OPTForCausalLM

from export import plan as pm
from export.__main__ import main
from runtime.models.published import OPT_ARCHS

TINY = dict(num_layers=2, hidden_size=64, num_heads=4, ffn_dim=96, vocab_size=40, max_positions=48)


def _arch(proj=64, pre_ln=True) -> pm.Arch:
    return pm.Arch("tiny", word_embed_proj_dim=proj, pre_layer_norm=pre_ln, **TINY)


def _torch_bytes(arch: pm.Arch) -> int:
    """fp32 bytes of the PyTorch model's parameters, the tied embedding counted once."""
    model = OPTForCausalLM(OPTConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, ffn_dim=arch.ffn_dim, word_embed_proj_dim=arch.word_embed_proj_dim,
        max_position_embeddings=arch.max_positions, do_layer_norm_before=arch.pre_layer_norm))
    return sum(p.numel() for p in model.parameters()) * 4


@pytest.mark.parametrize("proj, pre_ln", [(64, True), (32, False)])  # OPT-125m-like, OPT-350m-like
def test_float_weights_are_the_models_parameters_tied_head_once(proj, pre_ln):
    arch = _arch(proj, pre_ln)
    # the float head reads the embedding's own tensor in weights.bin: no second copy
    assert pm.weight_bytes(arch, "fp32") == (_torch_bytes(arch),) * 2
    assert pm.weight_bytes(arch, "fp16") == (_torch_bytes(arch) // 2,) * 2


def test_quantized_bytes_blocks_scales_zero_points():
    # K = 40: two blocks of 32 (the second padded); N = 3 columns; fp16 scales
    assert pm.quantized_bytes(40, 3, 4, 32, 2, symmetric=False) == 3 * 2 * 16 + 3 * 2 * 2 + 3 * 1
    assert pm.quantized_bytes(40, 3, 8, 32, 2, symmetric=False) == 3 * 2 * 32 + 3 * 2 * 2 + 3 * 2
    assert pm.quantized_bytes(40, 3, 4, 32, 2, symmetric=True) == 3 * 2 * 16 + 3 * 2 * 2
    assert pm.quantized_bytes(96, 5, 4, 32, 2, symmetric=False) == 5 * 3 * 16 + 5 * 3 * 2 + 5 * 2  # 3 blocks: 2 bytes of zero points


def test_int4_keeps_embeddings_norms_and_biases_in_fp16():
    arch, D, F, V, P = _arch(), 64, 96, 40, 64
    floats = 2 * (V * P + (arch.max_positions + 2) * D + arch.num_layers * (4 * D + F + D + 4 * D) + 2 * D)
    q = lambda k, n: pm.quantized_bytes(k, n, 4, 32, 2, False)  # noqa: E731
    matmuls = arch.num_layers * (4 * q(D, D) + q(D, F) + q(F, D)) + q(P, V)
    assert pm.weight_bytes(arch, "int4") == (floats + matmuls, floats)
    assert pm.weight_bytes(arch, "int4", pm.Workload(block_size=16))[0] > floats + matmuls  # more scales


def test_kv_cache_rounds_up_to_whole_pages_and_activations():
    arch = _arch()
    w = pm.Workload(tokens=33, batch=3, prompt=8, page_size=32)
    # layers x K,V x batch x (heads x head_dim = D) x width 33 rounded up to 64 x fp16
    assert pm.kv_cache_bytes(arch, w, 2) == 2 * 2 * 3 * 64 * 64 * 2
    # prefill scores and probabilities (B, heads, T, W + T) in fp32, W = the cache's width in pages (64)
    layer = 2 * 3 * 4 * 8 * (64 + 8) * 4 + 3 * 8 * (96 + 6 * 64) * 2
    assert pm.activation_bytes(arch, w, 2) == max(layer, 3 * 40 * (2 + 4))
    assert pm.activation_bytes(arch, pm.Workload(tokens=33, batch=3, prompt=8, page_size=1), 2) == (
        2 * 3 * 4 * 8 * (33 + 8) * 4 + 3 * 8 * (96 + 6 * 64) * 2)  # pages of one position: W = 33
    p = pm.plan(arch, "fp16", w, overhead=1000)
    assert p.total_bytes == p.weight_bytes + p.kv_bytes + p.activation_bytes + 1000


def test_activations_are_the_engines_largest_prefill_shape():
    """What TensorRT sizes its activation scratch for: the prefill profile's max batch, sequence and past."""
    from engines.config import EngineBuildConfig
    from engines.profiles import dim_ranges

    arch = _arch()
    config = EngineBuildConfig(max_batch=3, max_seq=40, max_prompt=24)
    prefill = dim_ranges(config, 16)[0]
    (_, _, B), (_, _, T), (_, _, W) = prefill["batch"], prefill["sequence"], prefill["past_sequence"]
    assert (B, T, W) == (3, 24, 48)
    w = pm.engine_workload(arch, config.max_seq, config.max_batch, config.max_prompt, page_size=16)
    assert pm.activation_bytes(arch, w, 2) == 2 * B * 4 * T * (W + T) * 4 + B * T * (96 + 6 * 64) * 2


def test_default_shape_is_what_engines_build_builds_capped_at_the_model():
    from engines.config import EngineBuildConfig

    d = EngineBuildConfig()
    w = pm.engine_workload(pm.arch_from_alias("opt-1.3b"))
    assert (w.batch, w.tokens, w.prompt) == (d.max_batch, d.max_seq, d.prompt_limit) == (8, 1024, 1024)
    assert pm.engine_workload(_arch()).tokens == 48 == pm.engine_workload(_arch()).prompt  # max_positions 48
    assert pm.engine_workload(_arch(), tokens=32, batch=1).prompt == 32


def test_an_artifacts_own_weight_format():
    arch = _arch()
    int4 = pm.WeightFormat("int4", "int4", 4)  # an fp32 export with --weights int4
    mixed = pm.WeightFormat("float", "int4", 2)  # --dtype fp16 --head-weights int4
    assert (int4.label, mixed.label, pm.parse_format("int4").label) == ("int4 (fp32)", "float layers, int4 head (fp16)", "int4")
    D, F, V, P = 64, 96, 40, 64
    q = lambda k, n, b: pm.quantized_bytes(k, n, 4, 32, b, False)  # noqa: E731
    floats = lambda b: b * (V * P + (arch.max_positions + 2) * D + arch.num_layers * (4 * D + F + D + 4 * D) + 2 * D)  # noqa: E731
    assert pm.weight_bytes(arch, int4) == (floats(4) + arch.num_layers * (4 * q(D, D, 4) + q(D, F, 4) + q(F, D, 4))
                                           + q(P, V, 4), floats(4))
    layers_fp16 = arch.num_layers * (4 * D * D + 2 * D * F) * 2
    assert pm.weight_bytes(arch, mixed) == (floats(2) + layers_fp16 + q(P, V, 2), floats(2) + layers_fp16)
    p = pm.plan(arch, int4, pm.Workload(tokens=48, batch=1, prompt=8))
    assert p.weights == "int4 (fp32)" and p.kv_bytes == pm.kv_cache_bytes(arch, p.workload, 4)


def test_devices_are_what_linux_sees_per_module():
    """MemTotal in MiB as tegrastats prints it, per module; the two without a capture are marked."""
    assert [(d.name, d.visible_mib) for d in pm.DEVICES] == [
        ("Orin Nano 4GB", 3524), ("Orin Nano 8GB", 7620), ("Orin NX 8GB", 7620), ("Orin NX 16GB", 15656),
        ("AGX Orin 32GB", 30536), ("AGX Orin 64GB", 62841), ("AGX Thor", 125772)]
    assert [d.name for d in pm.DEVICES if d.source.startswith("unverified")] == ["Orin Nano 4GB", "Orin NX 8GB"]
    assert round(pm.DEVICES[5].visible_bytes / pm.GiB, 1) == 61.4  # issue 60's AGX Orin 64GB


def test_os_reserve_scales_with_the_module():
    """1 GiB + 5% of MemTotal; --reserve replaces it for every device."""
    nano, agx64, thor = pm.DEVICES[1], pm.DEVICES[5], pm.DEVICES[6]
    assert pm.os_reserve_bytes(nano.visible_bytes) == pm.GiB + 7620 * pm.MiB // 20 == 1_473_249_280
    assert nano.usable_bytes() == 7_990_149_120 - 1_473_249_280 == 6_516_899_840
    assert agx64.reserve_bytes() == 4_368_420_044 and agx64.usable_bytes() == 61_525_144_372
    assert thor.reserve_bytes() == 7_667_816_857 and thor.usable_bytes() == 124_213_683_815
    assert nano.usable_bytes(reserve=2 * pm.GiB) == 7_990_149_120 - 2 * pm.GiB
    assert pm.parse_gib("auto") is None and pm.parse_gib("1.5GiB") == 3 * pm.GiB // 2


def test_tensorrt_path_overhead_is_its_own_term():
    """CUDA context 384 MiB + import torch 502 MiB + TensorRT's cuBLAS initialization 341 MiB (cited)."""
    assert pm.TENSORRT_PATH_BYTES == (384 + 502 + 159 + 182) * pm.MiB == 1_286_602_752
    p = pm.plan(pm.arch_from_alias("opt-1.3b"), "fp16", pm.Workload(tokens=1024, batch=1))
    assert p.device_bytes == p.total_bytes + pm.TENSORRT_PATH_BYTES


def test_fits_uses_the_reserve():
    nano = pm.DEVICES[1]
    p = pm.plan(pm.arch_from_alias("opt-1.3b"), "fp16", pm.Workload(tokens=1024, batch=1))
    assert p.fits(nano) and not p.fits(pm.DEVICES[0])  # 4.45 GiB on the device: the 4 GB Nano keeps 2.27
    edge = nano.visible_bytes - p.device_bytes  # the largest reserve that still fits
    assert p.fits(nano, reserve=edge) and not p.fits(nano, reserve=edge + 1)


def test_cli_fit_table_lists_every_alias_and_device(capsys):
    assert main(["plan", "--tokens", "512", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| opt-")]
    assert [r.split(" | ")[0][2:] for r in rows] == [a for a in OPT_ARCHS for _ in range(3)]
    assert [r.split(" | ")[1] for r in rows[:3]] == ["fp16", "int8", "int4"]
    header = next(line for line in out.splitlines() if line.startswith("| model |"))
    assert header.endswith("| total GiB | with TensorRT path GiB | Orin Nano 4GB (2.3 GiB usable) | Orin Nano 8GB "
                           "(6.1 GiB usable) | Orin NX 8GB (6.1 GiB usable) | Orin NX 16GB (13.5 GiB usable) | "
                           "AGX Orin 32GB (27.3 GiB usable) | AGX Orin 64GB (57.3 GiB usable) | AGX Thor (115.7 GiB "
                           "usable) |")
    assert "KV cache for 512 tokens x batch 2" in out and "the TensorRT path adds 1.20 GiB" in out
    big = next(r for r in rows if r.startswith("| opt-66b | fp16"))
    assert big.endswith("| no | no | no | no | no | no | no |")
    small = next(r for r in rows if r.startswith("| opt-125m | int4"))
    assert small.endswith("| yes | yes | yes | yes | yes | yes | yes |")


def test_cli_reserve_overrides_the_rule(capsys):
    assert main(["plan", "opt-125m", "--weights", "fp16", "--reserve", "2"]) == 0
    out = capsys.readouterr().out
    assert "Orin Nano 8GB (5.4 GiB usable)" in out and "AGX Thor (120.8 GiB usable)" in out
    assert "less 2 GiB (--reserve) for the OS" in out


@pytest.mark.parametrize("argv, message", [
    (["opt-7b"], "unknown model 'opt-7b': pass an artifact directory or one of opt-125m"),
    (["nosuch"], "opt-66b, llama-3.2-1b, llama-3.2-3b, qwen2.5-0.5b, qwen3-0.6b, qwen3-1.7b, smollm2-135m, smollm2-360m"),
    (["opt-125m", "--tokens", "0"], "tokens must be a positive int, got 0"),
    (["opt-125m", "--tokens", "4096"], "--tokens 4096 exceeds max_position_embeddings 2048 of opt-125m"),
    (["opt-125m", "--tokens", "64", "--prompt", "65"], "--prompt 65 exceeds --tokens 64"),
    (["opt-125m", "--weights", "int3"], "--weights 'int3': each must be one of fp32, fp16, int8, int4"),
    (["opt-125m", "--reserve", "lots"], "--reserve 'lots' is not a size in GiB"),
    (["opt-125m", "--measure"], "--measure loads an artifact: 'opt-125m' is not a directory"),
])
def test_cli_errors_say_what_and_how(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_cli_artifact_reads_manifest_and_measures(artifact_dir, capsys):
    assert main(["plan", str(artifact_dir), "--tokens", "48", "--prompt", "8", "--batch", "1", "--measure"]) == 0
    out = capsys.readouterr().out
    # one row, named by the artifact directory ("model"), at the artifact's dtype
    assert [line.split(" | ")[:2] for line in out.splitlines() if " | fp" in line] == [["| model", "fp32"]]
    assert "(rounded up to pages of 32)" in out  # the manifest's page size
    line = out.splitlines()[-1]
    assert line.startswith("model fp32: predicted ") and "measured peak RSS" in line
    assert "generated 1 x 48 positions" in line


def test_cli_defaults_work_on_a_short_model_and_say_the_shape(artifact_dir, capsys):
    """The tiny model has 64 positions: engines build's --max-seq 1024 is capped, not an error."""
    assert main(["plan", str(artifact_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# KV cache for 64 tokens x batch 8 (rounded up to pages of 32), prefill of a "
                             "64-token prompt over that cache: what `python -m engines build` builds by default "
                             "(--max-batch 8 --max-seq 1024, --max-prompt = --max-seq;")
    assert out[1] == "# model: 64 tokens, its max_position_embeddings (where engines build caps its default --max-seq too)"


def test_cli_plans_a_quantized_artifact_at_its_real_size(tmp_path, capsys):
    """An int4 artifact is planned as int4 (its block, zero points and dtype), near its files' bytes."""
    from export.build import BuildOptions, build
    from runtime.artifact.manifest import load_manifest
    from tests.conftest import save_tiny_checkpoint

    out = tmp_path / "int4"
    build(BuildOptions(model=str(save_tiny_checkpoint(tmp_path / "ckpt", "pre_ln")), out=str(out), weights="int4",
                       block_size=16, check=False, progress=False), log=lambda *_: None)
    assert main(["plan", str(out), "--batch", "1"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| int4 |")]
    assert row.split(" | ")[1] == "int4 (fp32)"
    manifest = load_manifest(out)
    fmt, fields = pm.artifact_format(manifest)
    assert fields == {"block_size": 16, "symmetric": False}
    planned, floats = pm.weight_bytes(pm.arch_from_artifact(out), fmt, pm.Workload(**fields))
    # exactly the packed weights, scales and zero points the graphs hold (the float parts of a random
    # tiny model are partly identical zeros and ones, which the export stores once)
    held = sum(len(i.raw_data) for g in manifest.graphs
               for i in onnx.load(str(out / g.file), load_external_data=True).graph.initializer
               if i.name.endswith(("_Q4", "_scales", "_zero_points")))
    assert planned - floats == held
    assert planned < 0.5 * pm.weight_bytes(pm.arch_from_artifact(out), "fp32")[0]

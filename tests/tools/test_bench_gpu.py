"""``python -m tools.bench.gpu``: its CPU dry run end to end, the floor's byte count, its refusals."""

import re

import numpy as np
import pytest
import torch

from tools.bench import gpu

TINY = ["--device", "cpu", "--arch", "tiny-random", "--batch", "1", "2", "--speedups", "2", "--prompt", "4",
        "--new-tokens", "4", "--rounds", "1", "--bandwidth-mib", "16", "--dtype", "float32"]


def test_cpu_dry_run_prints_the_table(tmp_path, capsys):
    out = tmp_path / "gpu.md"
    assert gpu.main(TINY + ["--out", str(out)]) == 0
    text = out.read_text()
    assert capsys.readouterr().out.strip() == text.strip()
    assert "Hardware: " in text and "(CPU, " in text and "GB/s" in text
    assert f"Command: `python -m tools.bench.gpu {' '.join(TINY)} --out {out}`" in text
    assert "static step (eager stand-in) ms" in text  # not called a CUDA graph on the CPU
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| tiny-random")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("1", "full"), ("1", "2x"), ("2", "full"), ("2", "2x")]
    for r in rows:
        floor, eager, graphs = (float(r[k]) for k in (4, 5, 6))
        assert 0 < floor < eager and graphs > 0
    assert [r[10].strip() for r in rows] == ["1.00x", "2.00x", "1.00x", "2.00x"]  # 8 layers: 8 / 4
    assert {(r[12].strip(), r[13].strip()) for r in rows} == {("-", "-")}  # kernels and their time: CUDA only
    peer = [r[14].strip() for r in rows]  # transformers' generate, at full depth
    # a figure, not its sign: (33 tokens' time - 1 token's) / 32 of a tiny model on a loaded CPU can be ~0
    assert peer[1] == peer[3] == "-" and all(re.fullmatch(r"-?\d+\.\d{3}", p) for p in (peer[0], peer[2])), peer
    for full, skip in (rows[:2], rows[2:]):  # every row against its batch's transformers figure
        for r in (full, skip):
            # within the rounding of the printed ms (3 decimals) and ratio (2)
            assert float(r[15].strip()[:-1]) == pytest.approx(float(full[14]) / float(r[6]), rel=0.01, abs=0.01)
    # full depth timed again with every row's logits to the host (in the same rounds), its ratio to the ids' step
    assert [r[21].strip() for r in rows][1::2] == ["-", "-"]
    for r in rows[::2]:
        assert float(r[21]) > 0
        assert float(r[22].strip()[:-1]) == pytest.approx(float(r[21]) / float(r[6]), rel=0.01, abs=0.01)


def test_the_steps_take_the_ids_the_engine_asks_for():
    """``run_steps`` asks for greedy ids as the engine does for rows without events, and they are
    the argmax of the logits the same steps give when asked for logits."""
    from runtime.backends.cuda_graphs import EagerCapture
    from runtime.backends.torch import TorchBackend
    from runtime.kvcache import KVCache
    from runtime.policy import SkipPolicy

    model = gpu.build_model("tiny-random", torch.device("cpu"), torch.float32, 0)
    backend = TorchBackend.from_model(model, cuda_graphs=False)
    backend.use_graphs(EagerCapture())
    seen = []
    decode = backend.decode
    backend.decode = lambda step, cache: seen.append((step.argmax, out := decode(step, cache))) or out
    cache = KVCache(backend.kv_storage(), 2, 16, 4)
    ids = np.array([[5, 6, 7], [8, 9, 10]])
    policy = SkipPolicy.full_depth(model.config.num_hidden_layers, 4)
    gpu.run_steps(backend, cache, ids, policy, 4)
    gpu.run_steps(backend, cache, ids, policy, 4, argmax=False)
    picked, logits = seen[:4], seen[4:]
    assert all(asked and out.dtype == np.int64 and out.shape == (2,) for asked, out in picked)
    assert all(not asked and out.shape == (2, model.config.vocab_size) for asked, out in logits)
    for (_, a), (_, b) in zip(picked, logits):  # the same tokens fed back, so the same steps
        np.testing.assert_array_equal(a, b.argmax(-1))


def test_no_transformers_leaves_its_columns_empty(capsys):
    assert gpu.main(TINY + ["--no-transformers"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 4 and {(r[14].strip(), r[15].strip()) for r in rows} == {("-", "-")}


def test_quantized_rows_beside_the_float_ones_and_the_compiled_peer(capsys):
    """--weights float int4: each its rows on the same random weights, the int4 rows' last column
    their step against the float row of the same batch and policy; --peer compiled: transformers'
    static cache (eager on the CPU) beside its dynamic one."""
    assert gpu.main(TINY + ["--batch", "1", "--weights", "float", "int4", "--peer", "eager", "compiled"]) == 0
    out = capsys.readouterr().out
    assert "| transformers compiled ms | graphs vs compiled | graphs / float graphs |" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| tiny-random")]
    assert [(r[0].strip(), r[2].strip()) for r in rows] == [("tiny-random", "full"), ("tiny-random", "2x"),
                                                          ("tiny-random int4", "full"), ("tiny-random int4", "2x")]
    float_full, float_2x, q_full, q_2x = rows
    assert re.fullmatch(r"-?\d+\.\d{3}", float_full[16].strip()) and float_full[17].strip().endswith("x")  # the
    # compiled peer, float rows (a figure: a difference of two times, ~0 for a tiny model on a loaded CPU)
    assert q_full[16].strip() == "-" and q_full[17].strip().endswith("x")  # measured on the float weights
    assert [r[18].strip() for r in (float_full, float_2x)] == ["-", "-"]
    assert {(r[19].strip(), r[20].strip()) for r in rows} == {("-", "-")}  # no --compile-steps
    for q, f in ((q_full, float_full), (q_2x, float_2x)):
        assert float(q[18].strip()[:-1]) == pytest.approx(float(q[6]) / float(f[6]), rel=0.01, abs=0.01)
        assert float(q[4]) < float(f[4])  # the floor: 4-bit products read fewer bytes


def test_compile_steps_times_the_graph_steps_again_compiled(capsys):
    assert gpu.main(TINY + ["--batch", "1", "--speedups", "2", "--no-transformers", "--compile-steps"]) == 0
    out = capsys.readouterr().out
    # what a user pays first, each way: the steps' setup (on the CPU: warm-up runs and inductor's compiles)
    setup = re.search(r"^Setup \(.*\): tiny-random: graph steps (\d+\.\d) s, compiled steps (\d+\.\d) s\.$", out, re.M)
    assert setup and float(setup[2]) > float(setup[1]), out[-600:]
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 2
    for r in rows:
        assert float(r[19]) > 0
        assert float(r[20].strip()[:-1]) == pytest.approx(float(r[6]) / float(r[19]), rel=0.01, abs=0.01)


def test_quantize_model_makes_every_product_blocks_and_step_bytes_counts_them():
    from runtime.models.quantized import QuantLinear

    model = gpu.build_model("tiny-random", torch.device("cpu"), torch.float32, 0)
    before = gpu.step_bytes(model, [0, 1], batch=1, past=0)
    gpu.quantize_model(model, 4)
    assert not [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    layer = model.model.decoder.layers[0]
    assert isinstance(layer.fc1, QuantLinear) and isinstance(model.lm_head, QuantLinear)
    q = layer.fc1
    assert sum(t.numel() * t.element_size() for t in (q.packed, q.scales, q.zeros)) == \
        q.out_features * q.in_features // 2 + q.out_features * (q.in_features // gpu.BLOCK) * 5  # codes, fp32 scale, zero
    assert gpu.step_bytes(model, [0, 1], batch=1, past=0) < before / 4


def test_step_bytes_counts_active_weights_head_and_kv():
    model = gpu.build_model("tiny-random", torch.device("cpu"), torch.float32, 0)
    decoder, c = model.model.decoder, model.config
    layer = sum(p.numel() for p in decoder.layers[0].parameters()) * 4
    head = (model.lm_head.weight.numel() + sum(p.numel() for p in decoder.final_layer_norm.parameters())) * 4
    assert gpu.step_bytes(model, [0, 6, 7], batch=1, past=0) == 3 * layer + head
    kv = 2 * 3 * c.hidden_size * 10 * 4  # K and V of 3 layers, 10 positions, 3 rows
    assert gpu.step_bytes(model, [0, 6, 7], batch=3, past=10) == 3 * layer + head + 3 * kv


def test_step_bytes_of_a_llama_shape_counts_its_kv_heads():
    model = gpu.build_model("smollm2-135m", torch.device("cpu"), torch.float32, 0)
    body, c = model.model, model.config
    layer = sum(p.numel() for p in body.layers[0].parameters()) * 4
    head = (model.lm_head.weight.numel() + c.hidden_size) * 4  # the tied head and the final RMSNorm
    assert gpu.step_bytes(model, [29], batch=1, past=0) == layer + head
    kv = 2 * 3 * 64 * 5 * 4  # K and V of 3 KV heads of 64, 5 positions
    assert gpu.step_bytes(model, [28, 29], batch=2, past=5) == 2 * layer + head + 2 * 2 * kv


def test_an_unknown_shape_is_refused_naming_the_known(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--device", "cpu", "--arch", "smollm3"])
    err = capsys.readouterr().err
    assert "invalid choice: 'smollm3'" in err and "smollm2-135m" in err and "opt-1.3b" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_cuda_without_a_gpu_says_so(capsys):
    assert gpu.main(["--device", "cuda", "--arch", "tiny-random"]) == 2
    assert re.search("^error: .*no CUDA device is visible to PyTorch .* --device cpu --arch tiny-random", capsys.readouterr().err)

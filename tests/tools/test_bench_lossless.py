"""``python -m tools.bench.lossless``: lossless rows against full depth and the lossy policy, its table."""

from tools.bench import lossless


def test_lossless_rows_say_they_are_full_depths_tokens(artifact_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello, my name is\nThe quick brown fox\n\nParis\n")
    out_file = tmp_path / "table.md"
    argv = [str(artifact_dir), "--prompts", str(prompts), "--batch", "1", "3", "--speedups", "2", "--rounds", "1",
            "--max-new-tokens", "10", "--threads", "1", "--out", str(out_file)]
    assert lossless.main(argv) == 0
    out = capsys.readouterr().out
    assert f"Command: `python -m tools.bench.lossless {' '.join(argv)}`" in out
    assert "3 prompts" in out and out_file.read_text() in out  # the same table, written
    assert "1 threads (sleeping workers, plain layer graphs)" in out  # OPT has no fused layer graphs
    rows = {(cells[1].strip(), cells[2].strip()): cells for cells in
            (line.split("|") for line in out.splitlines() if line.startswith("| ") and "row" not in line)}
    assert set(rows) == {(b, r) for b in ("1", "3") for r in ("full depth", "plain 2x", "lossless 2x")}
    for batch in ("1", "3"):
        assert rows[(batch, "full depth")][4].strip() == "1.00x"
        assert rows[(batch, "lossless 2x")][7].strip() == "yes"  # full depth's tokens, every prompt
        assert rows[(batch, "lossless 2x")][5].strip().endswith("%")  # drafts kept
        assert rows[(batch, "plain 2x")][5].strip() == "-"
        draft, verify = (float(c) for c in rows[(batch, "lossless 2x")][8:10])  # in full-depth steps
        assert draft > 0 and verify > 0  # measured: their presence is asserted, not their size (load moves it)
        assert [c.strip() for c in rows[(batch, "plain 2x")][8:10]] == ["-", "-"]
        assert rows[(batch, "full depth")][11].strip() == "1.00x"  # whole calls, prompt in to last token out
        assert float(rows[(batch, "lossless 2x")][10]) > 0 and rows[(batch, "lossless 2x")][11].strip().endswith("x")


def test_the_default_prompts_are_the_e2e_development_split():
    prompts = lossless.load_prompts(None, "mr", 3)
    assert len(prompts) == 3 and all(p.startswith("name[") for p in prompts)


def test_the_header_says_which_layer_graphs_ran(tmp_path_factory, tmp_path, capsys):
    """A Llama-family artifact runs its fused layer graphs unless --no-fused; the table says which,
    and both give full depth's tokens for lossless."""
    from tests.export.test_fused import GQA_SHAPES, _build

    _, art = _build(tmp_path_factory, "smollm2", GQA_SHAPES["smollm2"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello, my name is\nParis\n")
    for flags, said in (([], "1 threads (sleeping workers), median of 2 rounds"),
                        (["--no-fused"], "1 threads (sleeping workers, plain layer graphs), median of 2 rounds")):
        assert lossless.main([str(art), "--prompts", str(prompts), "--batch", "1", "--speedups", "2",
                              "--rounds", "2", "--max-new-tokens", "6", "--threads", "1", *flags]) == 0
        out = capsys.readouterr().out
        assert said in out
        rows = {cells[2].strip(): [c.strip() for c in cells] for cells in
                (line.split("|") for line in out.splitlines() if line.startswith("| 1 |"))}
        assert rows["lossless 2x"][7] == "yes"  # full depth's tokens
        # two rounds: the median ratio and, beside it, the lowest and highest within a round
        assert rows["full depth"][4] == "1.00x"
        low, high = (float(x.rstrip("x")) for x in rows["plain 2x"][4].split("(")[1].rstrip(")").split("-"))
        assert low <= float(rows["plain 2x"][4].split("x")[0]) <= high


def test_spin_loads_the_spinning_pool(artifact_dir, tmp_path):
    """--spin is runtime.load's spin=True: one process-wide pool, so it runs in a process of its own
    here (a spinning pool would outlive this test in pytest's process)."""
    import subprocess
    import sys

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Paris\n")
    done = subprocess.run([sys.executable, "-m", "tools.bench.lossless", str(artifact_dir), "--prompts", str(prompts),
                           "--batch", "1", "--speedups", "2", "--rounds", "1", "--max-new-tokens", "4",
                           "--threads", "1", "--spin"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "1 threads (spinning workers, plain layer graphs)" in done.stdout


def test_the_torch_backend_and_its_device(artifact_dir, tmp_path, capsys):
    """--backend torch (CUDA graphs with --device cuda, where a GPU is): the header says what ran, and
    lossless rows give full depth's tokens; the options of the other backend are refused."""
    import pytest
    import torch

    from runtime.errors import InvalidArgumentError

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello, my name is\nParis\n")
    argv = [str(artifact_dir), "--prompts", str(prompts), "--batch", "2", "--speedups", "2", "--rounds", "1",
            "--max-new-tokens", "8", "--threads", "1", "--backend", "torch"]
    for device, said in [("cpu", "1 threads (torch on cpu)")] + (
            [("cuda", "(torch on cuda, CUDA graphs)")] if torch.cuda.is_available() else []):
        assert lossless.main([*argv, "--device", device]) == 0
        out = capsys.readouterr().out
        assert said in out
        row = next(line for line in out.splitlines() if line.startswith("| 2 | lossless 2x"))
        assert row.split("|")[7].strip() == "yes"
    with pytest.raises(InvalidArgumentError, match="--spin and --no-fused apply to --backend onnxruntime"):
        lossless._run(lossless.parse([*argv, "--spin"]), [])
    with pytest.raises(InvalidArgumentError, match="--device applies to --backend torch"):
        lossless._run(lossless.parse([str(artifact_dir), "--device", "cuda"]), [])



def test_warmup_rounds_run_every_row_untimed_first(artifact_dir, tmp_path, capsys, monkeypatch):
    import runtime

    calls = []
    load = runtime.load

    def counting_load(*args, **kwargs):
        gen = load(*args, **kwargs)
        generate = gen.generate
        gen.generate = lambda *a, **k: calls.append(k) or generate(*a, **k)
        return gen

    monkeypatch.setattr(runtime, "load", counting_load)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello, my name is\nThe quick brown fox\n")
    argv = [str(artifact_dir), "--prompts", str(prompts), "--batch", "1", "--speedups", "2", "--rounds", "1",
            "--max-new-tokens", "6", "--threads", "1", "--warmup-rounds", "1"]
    assert lossless.main(argv) == 0
    assert "median of 1 rounds after 1 untimed (" in capsys.readouterr().out
    # one call warms up; then 3 rows x 2 prompts untimed, and the same timed
    assert len(calls) == 1 + 2 * 3 * 2 and calls[1:7] == calls[7:]
    assert lossless.main(argv[:-1] + ["-1"]) == 2
    assert capsys.readouterr().err == "error: --warmup-rounds must be >= 0, got -1\n"

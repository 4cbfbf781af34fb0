"""tools.evaluate: metrics on hand-checkable strings, the page from fabricated results, the CLI's
errors, and one end-to-end run on the tiny exported model."""

from __future__ import annotations

import csv
import importlib
import json
import math
import sys

import pytest

from tools.evaluate import metrics, report, summary as summary_mod, targets as targets_mod
from tools.evaluate.cli import EvaluateError, main, parse_model, speedup_list
from tools.evaluate.run import ModelSpec, batch_slices

CAT = "the cat sat on the mat"

# -- metrics ------------------------------------------------------------------------------------


def test_identical_text_scores_100():
    assert metrics.corpus_bleu([CAT], [[CAT]]).score == pytest.approx(100)
    assert metrics.rouge_l([CAT], [[CAT]]) == pytest.approx(100)


def test_bleu_and_rouge_l_by_hand():
    # hypothesis vs "the cat sat on a mat", both 6 tokens (brevity penalty 1): clipped n-gram
    # precisions 5/6, 3/5, 2/4, 1/3, so BLEU = (5/6 * 3/5 * 1/2 * 1/3) ** (1/4)
    bleu = metrics.corpus_bleu([CAT], [["the cat sat on a mat"]])
    assert bleu.score == pytest.approx(100 * (5 / 6 * 3 / 5 * 1 / 2 * 1 / 3) ** 0.25)
    assert "nrefs:1" in bleu.signature and "tok:13a" in bleu.signature
    # LCS "the cat sat on mat" = 5 of 6 tokens on both sides: F1 = 5/6
    assert metrics.rouge_l([CAT], [["the cat sat on a mat"]]) == pytest.approx(500 / 6)


def test_sentence_bleu_uses_the_effective_order():
    assert metrics.sentence_bleu(CAT, [CAT, "x"]) == pytest.approx(100)
    # two tokens have no 3- or 4-gram: scored on unigrams and bigrams, not zeroed
    assert metrics.sentence_bleu("the cat", ["the cat"]) == pytest.approx(100)
    assert 0 < metrics.sentence_bleu(CAT, ["the cat sat on a mat"]) < 100
    assert metrics.sentence_bleu(CAT, []) == 0.0


def test_ragged_references_best_reference_counts():
    hyps = [CAT, "dogs bark at night"]
    refs = [["a completely different sentence here", CAT, "yet another one"], ["dogs bark at night"]]
    assert metrics.reference_streams(refs) == [
        ["a completely different sentence here", "dogs bark at night"], [CAT, None], ["yet another one", None]]
    bleu = metrics.corpus_bleu(hyps, refs)
    assert bleu.score == pytest.approx(100) and "nrefs:var" in bleu.signature
    # ROUGE-L: the best reference per prompt (100 and 500/6), averaged
    assert metrics.rouge_l([CAT, "dogs bark at night"], [["x y", "the cat sat on a mat"], ["dogs bark at night"]]) \
        == pytest.approx((500 / 6 + 100) / 2)
    # the order of the references does not matter
    swapped = [list(reversed(r)) for r in refs]
    assert metrics.corpus_bleu(hyps, swapped).score == pytest.approx(bleu.score)


def test_metric_input_errors():
    with pytest.raises(ValueError, match="2 hypotheses but 1"):
        metrics.corpus_bleu(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="no reference"):
        metrics.rouge_l(["a"], [[]])


def test_missing_metric_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # import sacrebleu -> ImportError
    with pytest.raises(metrics.MetricsUnavailableError, match=r'sacrebleu.*pip install -e "\.\[eval\]"'):
        metrics.corpus_bleu([CAT], [[CAT]])
    with pytest.raises(metrics.MetricsUnavailableError):
        metrics.require()
    monkeypatch.setitem(sys.modules, "rouge_score", None)
    monkeypatch.delitem(sys.modules, "rouge_score.rouge_scorer", raising=False)
    with pytest.raises(metrics.MetricsUnavailableError, match="rouge-score"):
        metrics.rouge_l([CAT], [[CAT]])


def test_package_imports_without_the_metric_packages(monkeypatch):
    import tools

    monkeypatch.setattr(tools, "evaluate", tools.evaluate)  # restored with sys.modules afterwards
    for name in [n for n in sys.modules if n == "tools.evaluate" or n.startswith("tools.evaluate.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("sacrebleu", "rouge_score", "rouge_score.rouge_scorer"):
        monkeypatch.setitem(sys.modules, name, None)
    for module in ("data", "metrics", "report", "run", "summary", "targets"):
        importlib.import_module(f"tools.evaluate.{module}")
    cli = importlib.import_module("tools.evaluate.cli")
    assert cli.main(["--render", "unused.json"]) == 2  # the clear error, before reading anything


# -- the page from fabricated results -----------------------------------------------------------

PROMPTS = ["a cat?", "a dog?", "a bird?"]  # not E2E MRs: no slot errors (test_evaluate_slots.py)
REFS = [[CAT, "a cat was on the mat"], ["dogs bark at night"], ["birds sing in the morning light"]]
GOOD = [CAT, "dogs bark at night", "birds sing in the morning light"]
POOR = ["the cat", "dogs", "birds sing"]


def _run(speedup, hyps, seconds, steps=10, layers_per_step=None, L=6):
    policy = {"num_layers": L, "max_layers": L, "min_layers": L, "warmup_layers": 1, "horizon": 63} \
        if speedup == 1 else {"num_layers": L, "max_layers": 4, "min_layers": 2, "warmup_layers": 1, "horizon": 63}
    per_step = layers_per_step if layers_per_step is not None else (L if speedup == 1 else 3)
    return {"speedup": speedup, "policy": policy, "hypotheses": list(hyps), "decode_steps": steps,
            "layers_run": per_step * steps, "generated_tokens": steps + 3, "prefill_seconds": 0.1,
            "timing": {"rounds": 1, "decode_seconds": seconds, "decode_steps": steps}}


def fabricated() -> dict:
    return {
        "tool": "tools.evaluate",
        "argv": ["--data", "val.csv", "--model", "tuned=artifacts/e2e", "--model", "base=artifacts/base",
                 "--speedups", "1", "2", "5"],
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 8.0, "python": "3.11",
                    "versions": {"onnxruntime": "1.0"}, "date": "2025-01-01 00:00 UTC"},
        "settings": {"data": "val.csv", "prompt_column": "mr", "target_column": "ref", "limit": None,
                     "pairs": 4, "max_new_tokens": 64, "batch_size": 16, "speedups": [1.0, 2.0, 5.0],
                     "backend": "onnxruntime", "threads": 2, "timing_rounds": 1, "seed": 0},
        "prompts": PROMPTS, "references": REFS, "elapsed_s": 60.0,
        "models": [
            {"name": "tuned", "dir": "artifacts/e2e", "num_layers": 6, "dtype": "float32",
             "runs": [_run(1.0, GOOD, 1.0), _run(2.0, GOOD, 0.5), _run(5.0, POOR, 0.25, layers_per_step=2)]},
            {"name": "base", "dir": "artifacts/base", "num_layers": 6, "dtype": "float32",
             "runs": [_run(1.0, GOOD, 2.0), _run(2.0, POOR, 1.0), _run(5.0, GOOD, 0.5, layers_per_step=2)]},
        ]}


def test_summary_rows_and_targets():
    s = summary_mod.summarize(fabricated())
    tuned2 = s.find("tuned", 2.0)
    assert tuned2.bleu == pytest.approx(100) and tuned2.delta_bleu == pytest.approx(0)
    assert tuned2.avg_layers == 3 and tuned2.theoretical == pytest.approx(2)
    assert tuned2.ms_per_step == pytest.approx(50) and tuned2.measured_speedup == pytest.approx(2)
    assert s.find("base", 5.0).measured_speedup == pytest.approx(4)  # against base's own full depth
    assert s.find("base", 2.0).delta_bleu < -10  # against the FIRST model's full depth
    got = {(t.name, t.status) for t in targets_mod.evaluate(s)}
    assert got == {("tuned: BLEU at full depth >= 65", "held"),
                   ("tuned: BLEU at 2x within 0.5 point(s) of full depth", "held"),
                   ("tuned: BLEU at 5x within 2 point(s) of full depth", "missed"),
                   ("tuned beats base at 1x (BLEU)", "missed"),  # 100 vs 100: not beaten
                   ("tuned beats base at 2x (BLEU)", "held"),
                   ("tuned beats base at 5x (BLEU)", "missed")}
    assert s.reference_slot_errors is None and tuned2.slot_errors is None


def test_targets_only_for_the_speedups_that_ran():
    data = fabricated()
    data["models"] = data["models"][:1]
    data["models"][0]["runs"] = data["models"][0]["runs"][:2]  # 1x, 2x
    names = [t.name for t in targets_mod.evaluate(summary_mod.summarize(data))]
    assert names == ["tuned: BLEU at full depth >= 65", "tuned: BLEU at 2x within 0.5 point(s) of full depth"]
    data["models"][0]["runs"] = data["models"][0]["runs"][1:2]  # 2x alone: no full depth to compare
    assert "No target evaluated" in report.targets_block(targets_mod.evaluate(summary_mod.summarize(data)))


def test_page_tables_paper_rows_targets_samples():
    data = fabricated()
    s = summary_mod.summarize(data)
    page = report.render(data, s, targets_mod.evaluate(s))
    assert "python -m tools.evaluate --data val.csv --model tuned=artifacts/e2e" in page
    assert "Test CPU, 2 cores" in page and "Backend: onnxruntime, threads: 2" in page
    assert "## tuned" in page and "## base" in page
    assert "| 1x (full depth) | 6→6 (all layers) | 6.0 | 1.00x | 100.0 | 100.0 | +0.0 | – | – | 100.00 | 1.00x |" in page
    assert "| 2x | 4→2 over 63 | 3.0 | 2.00x | 100.0 | 100.0 | +0.0 | – | – | 50.00 | 2.00x |" in page
    assert "Slot errors: not computed" in page
    for row in ("| 1x (full depth) | 24.0 | 65.8 | 67.6 |", "| 2x | 14.7 | 66.3 | 67.9 |",
                "| 5x | 5.8 | 64.2 | 66.3 |"):
        assert row in page
    assert "- **held**: tuned: BLEU at 2x within 0.5 point(s) of full depth. BLEU 100.0 at 2x vs 100.0" in page
    assert "- **missed**: tuned: BLEU at 5x within 2 point(s) of full depth." in page
    assert "- **missed**: tuned beats base at 5x (BLEU)." in page
    samples = page.split("## Sample outputs", 1)[1]
    assert "**Prompt 3**: `a bird?`" in samples and "- tuned, 5x: `birds sing`" in samples
    assert "- base, 5x: `birds sing in the morning light`" in samples and "base, 2x" not in samples
    assert report.NOTES_BEGIN in page and "_No analysis written yet._" in page


def test_notes_survive_re_rendering_from_json(tmp_path, capsys):
    results, out = tmp_path / "quality.json", tmp_path / "quality.md"
    results.write_text(json.dumps(fabricated()))
    assert main(["--render", str(results), "--out", str(out)]) == 0
    first = out.read_text()
    out.write_text(first.replace("_No analysis written yet._", "The 5x drop is the horizon's fault."))
    assert main(["--render", str(results), "--out", str(out)]) == 0
    again = out.read_text()
    assert "The 5x drop is the horizon's fault." in again and "_No analysis written yet._" not in again
    assert again == first.replace("_No analysis written yet._", "The 5x drop is the horizon's fault.")
    # a section written below the analysis (docs/quality.md's quantization and real-model sections) stays
    out.write_text(again + "\n## Weight-only quantization\n\nMeasured by hand.\n")
    assert main(["--render", str(results), "--out", str(out)]) == 0
    assert out.read_text() == again + "\n## Weight-only quantization\n\nMeasured by hand.\n"
    stdout = capsys.readouterr().out
    assert "targets:" in stdout and "held: tuned: BLEU at 2x" in stdout and "**" not in stdout


def test_render_merges_runs_on_the_same_data(tmp_path):
    data = fabricated()
    tuned, base = dict(data, models=data["models"][:1]), dict(data, models=data["models"][1:])
    base["argv"] = ["--data", "val.csv", "--model", "base=artifacts/base", "--timing-rounds", "1"]
    tuned["settings"] = dict(data["settings"], timing_rounds=3)
    paths = [tmp_path / "tuned.json", tmp_path / "base.json"]
    for path, part in zip(paths, (tuned, base)):
        path.write_text(json.dumps(part))
    out = tmp_path / "q.md"
    assert main(["--render", *map(str, paths), "--out", str(out)]) == 0
    page = out.read_text()
    assert "Produced by these 2 commands" in page
    assert "python -m tools.evaluate --data val.csv --model base=artifacts/base --timing-rounds 1" in page
    assert "From command 1, 3 timing round(s)." in page and "From command 2, 1 timing round(s)." in page
    assert "- **missed**: tuned beats base at 5x (BLEU)." in page  # targets span both files
    other = dict(base, prompts=["another prompt?", "a dog?", "a bird?"])
    paths[1].write_text(json.dumps(other))
    assert main(["--render", *map(str, paths), "--out", str(out)]) == 2


def test_sample_text_with_backticks_and_empty_text():
    assert report._code("a `b` c") == "``a `b` c``"
    assert report._code("") == "_(empty)_"
    assert report._code("line\nbreak") == "`line break`"


# -- command line -------------------------------------------------------------------------------


def test_model_specs(tmp_path):
    assert parse_model("tuned=artifacts/e2e") == ModelSpec("tuned", "artifacts/e2e")
    assert parse_model("artifacts/e2e-base/") == ModelSpec("e2e-base", "artifacts/e2e-base/")
    odd = tmp_path / "a=b"
    odd.mkdir()
    assert parse_model(str(odd)) == ModelSpec("a=b", str(odd))
    with pytest.raises(EvaluateError):
        parse_model("=artifacts/e2e")


def test_speedups_always_include_full_depth():
    assert speedup_list([5, 2, 2]) == [1.0, 2.0, 5.0]
    with pytest.raises(EvaluateError, match=">= 1"):
        speedup_list([0.5])
    assert [list(r) for r in batch_slices(5, 2)] == [[0, 1], [2, 3], [4]]


def _write_csv(path, rows, header=("mr", "ref")):
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


DATA_ROWS = [("Hello, my name is", "Ann."), ("The quick brown fox jumps over", "the dog."),
             ("Hello, my name is", "Bob."), ("Paris", "is in France.")]


def test_unknown_column_and_missing_artifact_exit_2(tmp_path, capsys):
    data = _write_csv(tmp_path / "val.csv", DATA_ROWS)
    args = ["--data", str(data), "--model", str(tmp_path / "nowhere"), "-q", "--out", str(tmp_path / "q.md")]
    assert main(args + ["--prompt-column", "meaning"]) == 2
    err = capsys.readouterr().err
    assert "'meaning'" in err and "'mr', 'ref'" in err and "--prompt-column" in err
    assert main(args + ["--prompt-column", "mr", "--target-column", "ref"]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err
    assert main(["--data", str(data), "-q"]) == 2  # no --model
    assert "--model" in capsys.readouterr().err
    assert not (tmp_path / "q.md").exists()


# -- end to end on the tiny export --------------------------------------------------------------


@pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True)  # one variant is enough here
def test_end_to_end_on_the_tiny_model(artifact_dir, tmp_path, capsys):
    import runtime

    data = _write_csv(tmp_path / "val.csv", DATA_ROWS)
    out, raw = tmp_path / "quality.md", tmp_path / "quality.json"
    rc = main(["--data", str(data), "--prompt-column", "mr", "--target-column", "ref",
               "--model", f"tiny={artifact_dir}", "--model", str(artifact_dir), "--speedups", "1", "2",
               "--max-new-tokens", "4", "--threads", "1", "--timing-rounds", "2", "-q", "--out", str(out),
               "--json", str(raw)])
    assert rc == 0, capsys.readouterr().err
    page = out.read_text()
    assert "## tiny" in page and "## model" in page
    assert page.count("| 1x (full depth) | 6→6 (all layers) | 6.0 | 1.00x |") == 2
    assert page.count("| 2x | ") == 2 + 1  # two models, and the paper's row
    assert "tiny beats model at 2x (BLEU)" in page  # same artifact twice: equal BLEU, missed

    results = json.loads(raw.read_text())
    prompts = ["Hello, my name is", "The quick brown fox jumps over", "Paris"]
    assert results["prompts"] == prompts
    assert results["references"] == [["Ann.", "Bob."], ["the dog."], ["is in France."]]
    gen = runtime.load(artifact_dir, threads=1)
    try:
        full = gen.generate(prompts, 4, policy=runtime.SkipPolicy.full_depth(gen.num_layers))
        policy2 = gen.policy_for(4, speedup=2)
    finally:
        gen.close()
    for model in results["models"]:
        runs = {r["speedup"]: r for r in model["runs"]}
        assert runs[1.0]["hypotheses"] == [t.strip() for t in full.texts]
        assert runs[1.0]["layers_run"] == 6 * runs[1.0]["decode_tokens"] > 0  # every row's tokens
        assert runs[2.0]["policy"] == policy2.to_dict()
        assert runs[2.0]["layers_run"] < 6 * runs[2.0]["decode_tokens"]
        for run in runs.values():  # each round's time is kept apart for the speedup's spread
            t = run["timing"]
            assert len(t["round_decode_seconds"]) == len(t["round_decode_steps"]) == t["rounds"] == 2
            assert sum(t["round_decode_steps"]) == t["decode_steps"]  # engine calls: rows of a batch share them
            assert t["decode_steps"] // 2 <= run["decode_tokens"] <= len(prompts) * t["decode_steps"] // 2
            assert sum(t["round_decode_seconds"]) == pytest.approx(t["decode_seconds"])
    # --render reproduces the page from the raw results without generating
    assert main(["--render", str(raw), "--out", str(out)]) == 0
    assert out.read_text() == page


def test_policy_shape_options_and_prompt_pass_speedup(artifact_dir, tmp_path, capsys):
    import runtime

    data = _write_csv(tmp_path / "val.csv", DATA_ROWS)
    out, raw = tmp_path / "quality.md", tmp_path / "quality.json"
    rc = main(["--data", str(data), "--prompt-column", "mr", "--target-column", "ref",
               "--model", f"tiny={artifact_dir}", "--speedups", "1", "3", "--decay", "power",
               "--exponent", "2", "--prefill", "policy", "--max-new-tokens", "4", "--threads", "1",
               "-q", "--out", str(out), "--json", str(raw)])
    assert rc == 0, capsys.readouterr().err
    results = json.loads(raw.read_text())
    runs = {r["speedup"]: r for r in results["models"][0]["runs"]}
    with runtime.load(artifact_dir, threads=1) as gen:
        want = gen.policy_for(4, speedup=3, decay="power", exponent=2.0, prefill="policy")
    assert runs[3.0]["policy"] == want.to_dict() and want.prefill == "policy"
    assert runs[1.0]["policy"]["min_layers"] == 6 and "prefill" not in runs[1.0]["policy"]
    assert all(r["timing"]["prefill_seconds"] > 0 for r in runs.values())
    page = out.read_text()
    assert f"over {want.horizon}, power 2, prompt at {want.max_layers} |" in page
    assert "Skipping policies: the budget decays along a power curve, exponent 2; the prompt runs at " \
           "the first step's active set" in page


def test_prompt_pass_speedup_is_full_depth_time_over_this_one():
    data = fabricated()
    for model in data["models"]:
        for run, seconds in zip(model["runs"], (0.3, 0.2, 0.1)):
            run["timing"]["prefill_seconds"] = seconds
    s = summary_mod.summarize(data)
    assert s.find("tuned", 5.0).prefill_speedup == pytest.approx(3)
    assert s.find("tuned", 1.0).prefill_speedup == pytest.approx(1)
    assert math.isnan(summary_mod.summarize(fabricated()).find("tuned", 2.0).prefill_speedup)  # older JSON


@pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True)
def test_deep_copies_counted_per_token_and_said(artifact_dir, tmp_path, capsys, monkeypatch):
    """--deep-copies: the skipping runs' deep steps count in layers/token, row by row, and the page
    says how many tokens ran deep (every one here: the test's own rule)."""
    from runtime.decoding.copying import CopyRule

    monkeypatch.setattr(CopyRule, "due", lambda self, text: True)
    data = _write_csv(tmp_path / "val.csv", DATA_ROWS)
    out, raw = tmp_path / "quality.md", tmp_path / "quality.json"
    rc = main(["--data", str(data), "--prompt-column", "mr", "--target-column", "ref", "--model", f"tiny={artifact_dir}",
               "--speedups", "1", "3", "--max-new-tokens", "4", "--threads", "1", "--deep-copies", "-q",
               "--out", str(out), "--json", str(raw)])
    assert rc == 0, capsys.readouterr().err
    run = {r["speedup"]: r for r in json.loads(raw.read_text())["models"][0]["runs"]}[3.0]
    assert run["deep_steps"] == run["decode_tokens"] > 0
    assert run["layers_run"] == 4 * run["decode_tokens"]  # the deep set: warm-up + the top 3 of 6
    assert "Deep copies on (3x 100% of tokens, " in out.read_text()

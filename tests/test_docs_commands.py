"""Every command in README.md and docs/ (and the model and data cards) works as written.

The commands are read from the Markdown itself: each line of a fenced block that starts with
``python -m``, ``pip`` or ``curl`` (indented lines continue it; ``&&`` separates two), and each
inline ``python -m ...`` that gives arguments. Every one of them must match a rule below, and each
rule says how it is checked:

- run: run as written, in order, in a scratch directory laid out as a fresh clone (the shipped
  ``data/`` and ``models/``), with this checkout's packages; its output is checked where the docs
  show it.
- parse: it needs what this machine cannot give (the Hugging Face hub, TensorRT on an NVIDIA GPU),
  or runs for minutes to hours; the reason is stated, and the command's own argument parser must
  accept it exactly as written (``[...]`` groups included).
- mention: prose naming a command or an option, not a whole command line; the options named must
  be the command's.
- setup: not a command of this toolkit (installing, the test suite, the server's HTTP requests);
  where it is tested instead is stated.

A new command in the docs fails this test until a rule covers it; a rule no command matches fails too.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/benchmarks.md", "docs/benchmarks-gpu.md", "docs/design.md", "docs/jetson.md", "docs/quality.md", "docs/serving.md",
        "models/opt-e2e-skipdecode/README.md", "models/smollm2-135m-e2e/README.md", "data/e2e/README.md"]
START = re.compile(r"(python3? -m |pip |curl |\. )")

HUB = "needs the OPT checkpoint from the Hugging Face hub, which this machine cannot reach"
TRT = "needs TensorRT on an NVIDIA GPU (a Jetson): none on this machine (docs/jetson.md)"
LONG = "a measurement of minutes to hours; the page it documents is its output"
BEFORE = "compares with a copy of an older revision at that path (made as the section says)"
RECIPE = "needs the demo recipe's intermediate checkpoints (tools/e2e/recipe.sh: hours of training)"
DEMO_BUILD = "the quick start's build of the demo model with other options; that build runs here"
SERVER = "a server: runs until stopped; tests/runtime/test_serve.py starts it and sends it requests"
PLACEHOLDER = "DIR and OUT stand for the reader's own directories"
REAL = ("the real SmolLM2-135M-Instruct (a minute): tests/test_real_model.py exports it once and chats with it "
        "through the CLI and the openai client")
LLAMACPP_FILES = (REAL + ", and Q4_K_M / Q8_0 files llama.cpp's quantizer makes of it (never committed); "
                  "tests/tools/test_agreement.py runs --llamacpp with a stand-in worker")
SHIPPED_E2E = ("the shipped adapter over the real model (a minute): tests/test_shipped_e2e_model.py builds it "
               "and checks its descriptions at 1x, 2x and 5x")
DEMO_PROMPT = "name[The Eagle], eatType[coffee shop], food[French], area[riverside]"
QUICK_BUILD = "python -m export build --out artifacts/opt-e2e-skipdecode"
QUICK_RUN = f'python -m runtime artifacts/opt-e2e-skipdecode "{DEMO_PROMPT}" --speedup 2'
RUNTIME_SYNOPSIS = [  # README's synopsis of `python -m runtime`, made concrete: every option of it
    f'python -m runtime artifacts/opt-e2e-skipdecode "{DEMO_PROMPT}" "name[Loch Fyne]" --max-new-tokens 32 '
    f'--max-layers 6 --min-layers 3 --warmup-layers 1 --decay power --exponent 2 --prefill full '
    f'--backend onnxruntime --device cpu --threads 1 --max-batch 2 --prefill-chunk auto --do-sample '
    f'--temperature 0.7 --top-k 50 --top-p 0.9 --seed 0 --stop . --ignore-eos --deep-copies --json',
    f'python -m runtime artifacts/opt-e2e-skipdecode "{DEMO_PROMPT}" --speedup 2 --backend torch '
    f'--prefill-chunk none --no-deep-copies --stream',
]

# (the command's start, or the whole command where the pattern ends in "$"; kind; reason): the
# first rule that matches applies
RULES = [
    ("pip install", "setup", "installs; CI runs it (.ci/run)"),
    ("python -m pytest", "setup", "the test suite itself"),
    ("python3 -m venv", "setup", "a Jetson's virtual environment (docs/jetson.md)"),
    (". .venv/bin/activate", "setup", "a Jetson's virtual environment (docs/jetson.md)"),
    ("curl ", "setup", SERVER),
    # the quick start, and what the README shows of it
    (QUICK_BUILD + "$", "run", ""),
    (QUICK_RUN + "$", "run", ""),
    ("python -m export build --model tiny-random -q$", "run", ""),
    ("python -m export verify artifacts/tiny-random -q$", "run", ""),
    ("python -m runtime ART ", "run", "README's synopsis; RUNTIME_SYNOPSIS runs it made concrete"),
    ("python -m runtime --help$", "run", ""),
    ("python -m export plan opt-1.3b opt-6.7b --tokens 1024 --batch 4$", "run", ""),
    ("python -m export plan$", "run", ""),
    ("python -m export plan --batch 1 --tokens 1024 --prompt 256$", "run", ""),
    ("python -m export plan opt-1.3b", "run", ""),
    ("python -m export plan qwen3-0.6b", "run", ""),
    ("python -m tools.e2e split --data data/e2e/trainset.csv.gz --out .work/e2e$", "run", ""),
    ("python -m tools.bench.startup artifacts/opt-e2e-skipdecode --runs 10$", "run", ""),
    # a command's name in prose
    ("python -m runtime serve$", "mention", ""),
    ("python -m export verify$", "mention", ""),
    ("python -m engines build$", "mention", ""),
    ("python -m engines verify$", "mention", ""),
    ("python -m tools.e2e init$", "mention", ""),
    ("python -m tools.e2e distill$", "mention", ""),
    ("python -m tools.evaluate --render$", "mention", ""),
    # fine-tuning on the shipped data: the split above runs; the rest trains for a quarter of an hour
    ("python -m tools.finetune --model models/opt-e2e-skipdecode", "parse", LONG + " (an epoch of fine-tuning)"),
    ("python -m export build --model .work/mine", "parse", "exports the fine-tuned model of the line before"),
    ("python -m tools.evaluate --data data/e2e/devset.csv.gz --model artifacts/mine", "parse", LONG),
    ("python -m tools.evaluate --data data/e2e/devset.csv.gz --prompt-column mr --target-column ref "
     "--model 'SkipDecode fine-tuned", "parse", LONG),
    ("python -m tools.evaluate --data data/e2e/devset.csv.gz --prompt-column mr --target-column ref "
     "--model 'shipped model", "parse", LONG),
    ("python -m tools.evaluate --data data/e2e/devset.csv.gz --prompt-column mr --target-column ref "
     "--model 'fp32=", "parse", LONG + "; the int8/int4 exports of the demo model first"),
    ("python -m tools.evaluate --data data/e2e/devset.csv.gz --prompt-column mr --target-column ref "
     "--model 'SmolLM2", "parse", LONG + "; on the export of the line before"),
    ("python -m tools.evaluate --data data/e2e/devset.csv.gz", "parse", RECIPE),
    ("python -m export build --model .work/", "parse", RECIPE),
    ("python -m export build --out artifacts/opt-e2e-skipdecode -q", "parse", DEMO_BUILD),
    ("python -m export build --speedup 2", "parse", DEMO_BUILD),
    ("python -m export build --out DIR", "parse", DEMO_BUILD),
    ("python -m export build --model OUT", "parse", PLACEHOLDER),
    ("python -m export build --model opt-125m --random-weights", "parse", LONG + " (exports OPT-125m)"),
    ("python -m export build --model smollm2-135m-instruct$", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --out artifacts/smollm2-135m-instruct$", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights float$", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights float --draft-head int8 --draft-layers int8$",
     "parse", REAL),
    ("python -m export build --model smollm2-135m-e2e", "parse", SHIPPED_E2E),
    ("python -m runtime artifacts/smollm2-135m-e2e ", "parse", SHIPPED_E2E),
    ("python -m tools.e2e distill --model artifacts/smollm2-135m-e2e ", "parse",
     LONG + " (16 minutes of generation over the training split with the real model)"),
    ("python -m tools.e2e consensus --train data/e2e/trainset.csv.gz --candidates .work/smollm2-distilled.csv ",
     "parse", "reads the distill's output (16 minutes of generation with the real model); "
              "tests/tools/test_e2e_consensus.py runs it on hand-written pairs"),
    ("python -m tools.e2e consensus --train data/e2e/trainset.csv.gz --candidates .work/smollm2-distilled4.csv ",
     "parse", "reads the distill outputs of earlier versions (as above)"),
    ("python -m tools.e2e distill --model artifacts/opt-e2e-skipdecode ", "parse",
     LONG + " (the demo model describes the 4,862 training MRs: a minute)"),
    ("python -m tools.finetune --model .work/smollm2-e2e-consensus", "parse",
     LONG + " (the shipped model's later stages: 5-10 minutes each over the previous stage's output)"),
    ("python -m tools.finetune --model smollm2-135m-instruct ", "parse",
     LONG + " (43 minutes of LoRA fine-tuning; tests/tools/test_finetune_lora.py trains a tiny model)"),
    # issue 56: the renamed development split, and the eighth version's stage (models/smollm2-135m-e2e)
    ("python -m tools.e2e rename --data data/e2e/devset.csv.gz --pool dev --out .work/devset-renamed.csv$", "run", ""),
    ("python -m tools.evaluate --data .work/devset-renamed.csv ", "parse",
     LONG + " (10 minutes of generation with the real model over the renamed split)"),
    ("python -m tools.e2e rename --data .work/smollm2-distilled7.csv ", "parse",
     "reads the distill's output (26 minutes of generation with the real model); "
     "tests/tools/test_e2e_rename.py runs it on hand-written pairs"),
    ("python -m tools.finetune --model smollm2-135m-e2e ", "parse",
     LONG + " (43 minutes of LoRA fine-tuning over the shipped model; tests/tools/test_finetune_lora.py trains a tiny model)"),
    ("python -m tools.finetune --model .work/eighth ", "parse",
     LONG + " (the fifth stage tried: 45 minutes of LoRA fine-tuning over the eighth version's adapter)"),
    ("python -m tools.finetune.stack --adapters models/smollm2-135m-e2e ", "parse",
     "reads the fourth stage's adapter (above); tests/tools/test_finetune_stack.py stacks tiny adapters"),
    ("python -m tools.evaluate.copying --model .work/tenth ", "parse",
     "reads the tenth stage's stack (a run of 35 minutes); tests/tools/test_evaluate_copying.py scores a tiny model"),
    # issue 57: self-distillation data, and the command line shapes the README names
    ("python -m tools.finetune.selfchat --model ART --out CSV$", "parse",
     PLACEHOLDER + "; tests/tools/test_finetune_selfchat.py runs it on a tiny chat model"),
    ("python -m tools.finetune.selfchat --model artifacts/smollm2-135m-instruct ", "parse",
     LONG + " (8 minutes of generation with the real model; tests/tools/test_finetune_selfchat.py runs it on a tiny one)"),
    ("python -m export build --model smollm2-135m-instruct --weights float --out artifacts/smollm2-135m-instruct "
     "--draft-head none "
     "--draft-layers none$", "parse", REAL),
    ("python -m tools.finetune.general_text --out .work/general-b.csv$", "run", ""),
    ("python -m tools.finetune.general_text --out .work/general-s.csv --stdlib$", "run", ""),
    ("python -m tools.finetune.bridge --model smollm2-135m-instruct ", "parse",
     REAL + "; tests/tools/test_finetune_bridge.py fits bridges on a tiny model and scores with them"),
    ("python -m tools.evaluate.perplexity --model MODEL ", "parse",
     "MODEL stands for the models the section names; " + LONG),
    ("python -m export build --model smollm2-135m-instruct --weights int4 --out /tmp/smol-int4$", "parse", REAL),
    # issue 58: the GGUF's own blocks against the float export
    ("python -m export build --model smollm2-135m-instruct --weights int4 --head-weights int4 --out artifacts/smollm2-int4-h4$",
     "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights int4 --accuracy-level 1 --out "
     "artifacts/smollm2-int4-acc1$", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights int4 --out artifacts/smollm2-int4$", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights int4 --out artifacts/smollm2-int4-e8$", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights int4 --accuracy-level 4 --out "
     "artifacts/smollm2-int4-a8$", "parse", REAL),
    ("python -m export verify artifacts/smollm2-int4$", "parse", REAL),
    # issue 55: every int4/int8 export at float activations
    ("python -m export build --model smollm2-135m-instruct --weights int8 --accuracy-level 4 --out "
     "artifacts/smollm2-int8-a8$", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights int4 --requantize --out "
     "artifacts/smollm2-int4-rq$", "parse", REAL),
    # issue 57: lossless at speedup 1 on the file's own blocks
    ("python -m export build --model smollm2-135m-instruct --weights float --out artifacts/smollm2-instruct-default$",
     "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights float --out artifacts/smollm2-instruct-d8 "
     "--draft-layers int8$",
     "parse", REAL),
    ("python -m tools.evaluate.agreement --reference artifacts/smollm2-q4km-f32 ", "parse", LLAMACPP_FILES),
    ("python -m tools.evaluate.agreement --reference artifacts/smollm2-q8-f32 ", "parse", LLAMACPP_FILES),
    ("python -m tools.evaluate.agreement --reference artifacts/smollm2-135m-instruct-default ", "parse", REAL),
    ("python -m tools.evaluate.agreement --reference artifacts/smollm2-135m-instruct ", "parse",
     REAL + "; tests/tools/test_agreement.py runs it on tiny float and int4 exports"),
    ("python -m export build --model smollm2-135m-instruct --weights int8 --out artifacts/smollm2-int8$", "parse", REAL),
    ("python -m tools.bench.decode int8-mlas=artifacts/smollm2-int8:onnxruntime ", "parse",
     REAL + " (the section's exports); tests/tools/test_bench_decode.py runs it on a tiny int4 export"),
    ("python -m tools.bench.decode before=artifacts/smollm2-int4-before ", "parse",
     REAL + " (the section's exports); tests/tools/test_bench_decode.py runs it on a tiny int4 export"),
    ("python -m tools.bench.decode avx512=ART:skipdecode avx2=ART:skipdecode-avx2 ", "parse",
     REAL + " (ART: the section's exports); tests/tools/test_bench_decode.py runs it on a tiny int4 export"),
    ("python -m tools.bench.memory artifacts/smollm2-int4 ", "parse", REAL + " (the section's exports)"),
    ("python -m tools.bench.decode new=artifacts/smollm2-int4 ", "parse",
     REAL + " (the section's export); tests/tools/test_bench_decode.py runs it on a tiny int4 export"),
    ("python -m export build --model smollm2-360m --random-weights --weights int4 --out A$", "parse",
     LONG + " (exports SmolLM2-360M's shape at int4, 425 MB)"),
    ("python -m export build --model WORK/ARCH/hf --out A$", "parse",
     LONG + " (exports tools.bench's checkpoint of SmolLM2-360M's or Qwen3-0.6B's shape in float32, 1.4-3 GB)"),
    ("python -m export build --model H --weights int4 --out A$", "parse",
     PLACEHOLDER + " (H: the real SmolLM2-135M-Instruct saved as a Hugging Face directory; tests/test_real_model.py "
     "exports it)"),
    ("python -m export build --model WORK/ARCH/hf --weights int4 --out A$", "parse",
     LONG + " (exports tools.bench's checkpoint of SmolLM2-360M's or Qwen3-0.6B's shape, in its --work-dir)"),
    ("python -m export build --model qwen3-0.6b --random-weights --weights int4$", "parse",
     LONG + " (exports Qwen3-0.6B's shape, 1 GB)"),
    ("python -m runtime artifacts/smollm2-135m-instruct --chat", "parse", REAL),
    ("python -m runtime artifacts/smollm2-135m-instruct --backend torch", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights float --out artifacts/smollm2-135m-instruct$",
     "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights float --out artifacts/smollm2-instruct-drafts",
     "parse", "reads a skipping-only run's adapter (45 minutes to 2 hours of LoRA training); "
              "tests/export/test_draft_layers.py builds a tiny model with a random one"),
    ("python -m tools.bench.board ART ", "parse", PLACEHOLDER + " (a Jetson with llama.cpp built; "
     "tests/tools/test_bench_board.py runs it with a fake tegrastats and llama-bench)"),
    ("python -m tools.evaluate.perplexity --model smollm2-135m-instruct", "parse", REAL + "; tools.evaluate."
     "perplexity's own tests: tests/tools/test_perplexity.py"),
    ("python -m export build --model opt-1.3b", "parse", HUB),
    ("python -m export verify artifacts/opt-1.3b", "parse", HUB),
    ("python -m engines build", "parse", TRT),
    ("python -m engines verify", "parse", TRT),
    ("python -m export build --weights int4$", "parse", DEMO_BUILD),
    ("python -m export verify DIR", "parse", PLACEHOLDER),
    ("python -m tools.trtexec", "parse", TRT),
    ("python -m runtime artifacts/opt-1.3b", "parse", HUB + "; and a CUDA GPU"),
    ("python -m runtime serve", "parse", SERVER),
    ("python -m export plan DIR", "parse", PLACEHOLDER + "; --measure loads each (minutes)"),
    ("python -m export.measure DIR", "parse", PLACEHOLDER),
    ("python -m tools.bench.memory DIR", "parse", PLACEHOLDER + "; " + LONG),
    ("python -m tools.bench.gemv", "parse", LONG + " (on the artifact tools.bench prepares)"),
    ("python -m tools.bench.slots --checkout /work/before", "parse", BEFORE),
    ("python -m tools.bench.gap --checkout /work/before", "parse", BEFORE),
    ("python -m tools.bench.staggered --artifact artifacts/opt-e2e-skipdecode", "parse",
     LONG + " (rounds of 8 generations; tests/tools/test_bench_staggered.py runs it on a tiny model)"),
    ("python -m tools.bench.startup artifacts/opt-e2e-skipdecode --runs 10 --checkout /tmp/", "parse", BEFORE),
    ("python -m tools.bench.context --before", "parse", BEFORE),
    ("python -m tools.bench.gpu", "parse", LONG + " (on a CUDA GPU; --device cpu runs the same for 8 minutes)"),
    ("python -m tools.bench.host_copy --device cuda", "parse",
     "on a CUDA GPU (tests/tools/test_bench_host_copy.py runs it with --device cpu)"),
    ("python -m tools.bench.prefix artifacts/smollm2-135m-int4$", "parse",
     LONG + " (the real model's int4 export; tests/tools/test_bench_prefix.py runs it on a tiny model)"),
    ("python -m tools.bench.structured /tmp/fz/q3q4", "parse",
     PLACEHOLDER + " (Qwen3-0.6B shapes exported with random weights at int4)"),
    ("python -m tools.bench.structured artifacts/smollm2-135m-int4 --rounds 7$", "parse",
     LONG + " (the real model's int4 export; tests/tools/test_bench_structured.py runs it on a tiny model)"),
    ("python -m tools.bench.lossless", "parse",
     LONG + " (D, A32, A4: the section's exports; tests/tools/test_bench_lossless.py runs it on a tiny model)"),
    ("python -m export build --model opt-e2e-skipdecode --out D", "parse", DEMO_BUILD),
    ("python -m export build --model smollm2-135m-instruct --weights float --out A32", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights int4 --out A$", "parse", REAL),
    ("python -m export build --model smollm2-135m-instruct --weights int4 --out artifacts/smollm2-135m-int4$",
     "parse", REAL),
    ("python -m tools.bench --render", "parse", "re-renders the results a full run left in .bench/"),
    ("python -m tools.bench", "parse", LONG),
    ("python -m export build$", "parse", DEMO_BUILD),
    # the ONNX Runtime GenAI peer (docs/benchmarks.md, issue 28): D, A32, G... are the section's directories
    ("python -m venv --system-site-packages V", "setup", "the GenAI peer's own venv, never the project's"),
    ("V/bin/pip install onnxruntime-genai", "setup", "the GenAI peer's own venv, never the project's"),
    ("python -m export build --model D ", "parse", "exports the random checkpoint of the line before it"),
    ("python -m runtime A ", "parse", LONG + " (SmolLM2-360M's shape, rounds against the peer)"),
]


def _fenced(text: str):
    for block in re.finditer(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        if block.group(0).startswith("```python"):
            continue  # README's API example: tests/runtime covers the API
        command = None
        for line in block.group(1).splitlines() + [""]:
            if command is not None and line.startswith("    "):
                command += " " + line.strip()  # an indented line continues the command
                continue
            if command is not None:
                yield command
            line = re.split(r"\s{2,}#", line)[0].strip()  # a trailing comment
            command = line if START.match(line) else None


def _inline(text: str):
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.finditer(r"`([^`]+)`", text):
        command = " ".join(span.group(1).split())
        if command.startswith("python -m ") and len(command.split()) > 3:
            yield command


def documented() -> dict[str, str]:
    """command -> the file it first appears in."""
    found = {}
    for name in DOCS:
        text = (REPO / name).read_text(encoding="utf-8")
        for command in [*_fenced(text), *_inline(text)]:
            for part in command.split(" && "):
                found.setdefault(part.strip(), name)
    return found


def rule(command: str):
    for pattern, kind, reason in RULES:
        if command == pattern[:-1] if pattern.endswith("$") else command.startswith(pattern):
            return pattern, kind, reason
    return None


COMMANDS = documented()


def test_every_command_has_a_rule_and_every_rule_a_command():
    unruled = [f"{c!r} ({f})" for c, f in COMMANDS.items() if rule(c) is None]
    assert not unruled, "commands in the docs that no rule covers:\n" + "\n".join(unruled)
    used = {rule(c)[0] for c in COMMANDS}
    assert not [p for p, _, _ in RULES if p not in used], "rules that match no command in the docs"
    assert all(reason for _, kind, reason in RULES if kind in ("parse", "setup"))


class _Parsed(Exception):
    pass


def _argv(command: str) -> tuple[str, list[str]]:
    """The module and argv of a documented command, its optional ``[...]`` groups included."""
    words = shlex.split(command.replace("[", " ").replace("]", " "))
    assert words[:2] == ["python", "-m"], command
    return words[2], words[3:]


def _forget(monkeypatch, module: str) -> None:
    """runpy runs a module afresh, as `python -m` does; a copy imported by an earlier test is set
    aside for the test (packages stay: their classes must stay the ones every test imported)."""
    for name in (module, f"{module}.__main__"):
        if name in sys.modules and not hasattr(sys.modules[name], "__path__"):
            monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("command", [c for c in COMMANDS if rule(c) and rule(c)[1] == "parse"])
def test_parse(command, monkeypatch, capsys):
    """The command's own parser accepts it as written; it stops there (no work is done)."""
    module, argv = _argv(command)
    for name in ("parse_args", "parse_intermixed_args"):  # python -m runtime takes prompts among options
        original = getattr(argparse.ArgumentParser, name)

        def parse(self, args=None, namespace=None, original=original):
            original(self, args, namespace)
            raise _Parsed

        monkeypatch.setattr(argparse.ArgumentParser, name, parse)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    _forget(monkeypatch, module)
    with pytest.raises(_Parsed):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            pytest.fail(f"{command!r} was refused (exit {exc.code}): {capsys.readouterr().err}")


@pytest.mark.parametrize("command", [c for c in COMMANDS if rule(c) and rule(c)[1] == "mention"])
def test_mention(command, monkeypatch, capsys):
    module, argv = _argv(command)
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    _forget(monkeypatch, module)
    with pytest.raises(SystemExit):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    help_text = capsys.readouterr().out
    assert argv and all(word in help_text for word in argv), command  # its options, or subcommand


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A scratch directory laid out as a fresh clone: the shipped data and model, nothing built."""
    root = tmp_path_factory.mktemp("clone")
    for name in ("data", "models"):
        (root / name).symlink_to(REPO / name)
    return root


def sh(clone: Path, command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr and "\r" not in done.stderr, done.stderr[-3000:]  # no bars in a log
    return done


def _readme_block_after(marker: str) -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return text[text.index(marker):].split("```\n", 2)[1].splitlines()


def test_run_quick_start(clone):
    """README's quick start prints the documented line, word for word."""
    sh(clone, QUICK_BUILD)
    out = sh(clone, QUICK_RUN).stdout
    assert out.splitlines() == [line for line in _readme_block_after("It prints, at 2x")]


def test_run_tiny_verify(clone):
    """README's verify example: the same checks pass, in the order shown."""
    sh(clone, "python -m export build --model tiny-random -q")
    lines = sh(clone, "python -m export verify artifacts/tiny-random -q").stdout.splitlines()
    shown = _readme_block_after("python -m export verify artifacts/tiny-random -q`):")
    assert lines[0] == shown[0] and lines[-1] == shown[-1] == "PASSED"

    def checks(block):
        return [line.split(":")[0] for line in block if line.startswith("  [")]
    assert [c for c in checks(lines) if c in checks(shown)] == checks(shown)  # others may be added


def test_run_the_rest(clone):
    """The other runnable commands, and README's synopsis of `python -m runtime` made concrete."""
    runs = [c for c in COMMANDS if rule(c)[1] == "run" and not c.startswith(("python -m export build",
            "python -m export verify", "python -m runtime ART", QUICK_RUN))]
    if not (clone / "artifacts/opt-e2e-skipdecode").is_dir():
        sh(clone, "python -m export build --out artifacts/opt-e2e-skipdecode -q")
    for command in runs + RUNTIME_SYNOPSIS:
        sh(clone, command)
    assert (clone / ".work/e2e/train.csv").is_file() and (clone / ".work/e2e/val.csv").is_file()
    assert not (clone / "data/e2e/train.csv").exists()  # the shipped data untouched

"""``python -m tools.finetune.general_text``: general English text for skip-aware training, from
what this machine already holds (issue 57: no hub, nothing downloaded).

    python -m tools.finetune.general_text --out .work/general-b.csv

Three sources, each named in the rows' ``source`` column: Python's own documentation
(``pydoc_data.topics``, which the interpreter ships: its prose paragraphs, no code), this
repository's README.md and docs/ (prose paragraphs: no tables, code or headings), and the E2E
training references (data/e2e/trainset.csv.gz) in groups of six; with ``--stdlib`` a fourth, the
docstrings of the standard library's modules, classes and functions (read from its source with
``ast``, nothing imported; no test suites; ~600 paragraphs on Python 3.11). Each text becomes one
row of at most ``--max-chars`` characters: its first ~100 characters the prompt, the rest the target
(``tools.finetune --prompt-column prompt --target-column target --separator ''``). The held-out
texts of docs/quality.md (data/prose/) are not among them. Rows shuffled with a fixed seed.
"""

from __future__ import annotations

import argparse
import ast
import csv
import gzip
import random
import re
import sys
from pathlib import Path

from runtime import cli
from runtime.errors import SkipDecodeError

REPO = Path(__file__).resolve().parents[2]
PROMPT_CHARS = 100  # a row's prompt: its text to the first space after this many characters
MIN_CHARS = 300  # shorter paragraphs are left out (headings, captions, one-liners)
E2E_GROUP = 6  # E2E references per row


def paragraphs(text: str) -> list[str]:
    """``text``'s prose paragraphs of MIN_CHARS or more, whitespace collapsed: no Markdown table,
    code block, heading or indented block (interactive sessions, code)."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").splitlines()
        if not lines or any(line.startswith(("|", "```", "#", "    ", "\t", "$ ")) or line.lstrip().startswith(">>>")
                            for line in lines):
            continue
        flat = " ".join(block.split())
        if len(flat) >= MIN_CHARS and not flat.startswith(("python ", "pip ")):
            out.append(flat)
    return out


def stdlib_docstrings() -> list[str]:
    """The prose paragraphs of the standard library's docstrings (modules, classes, functions), files
    in sorted order; test suites and demos left out. Parsed, never imported (no module's side effects)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "site-packages"}
    out = []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a file of another Python's syntax, or bytes
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out += paragraphs(ast.get_docstring(node) or "")
    return out


def sources(e2e_rows: int, seed: int, stdlib: bool = False) -> dict[str, list[str]]:
    """{source: its texts}."""
    import pydoc_data.topics

    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    with gzip.open(REPO / "data" / "e2e" / "trainset.csv.gz", "rt", encoding="utf-8") as fh:
        refs = [row["ref"] for row in csv.DictReader(fh)]
    random.Random(seed).shuffle(refs)
    refs = refs[: e2e_rows * E2E_GROUP]
    return {"pydoc": paragraphs("\n\n".join(pydoc_data.topics.topics.values())),
            "docs": [p for path in docs for p in paragraphs(path.read_text(encoding="utf-8"))],
            "e2e": [" ".join(refs[k:k + E2E_GROUP]) for k in range(0, len(refs), E2E_GROUP)],
            **({"stdlib": stdlib_docstrings()} if stdlib else {})}


def rows(texts: dict[str, list[str]], max_chars: int, seed: int) -> list[dict[str, str]]:
    """One row per text: (source, prompt, target), the text cut to ``max_chars``, shuffled."""
    out = []
    for source, items in texts.items():
        for text in items:
            text = text[:max_chars]
            cut = text.find(" ", PROMPT_CHARS)
            if cut > 0:
                out.append({"source": source, "prompt": text[:cut], "target": text[cut:]})
    random.Random(seed).shuffle(out)
    return out


def write(path: Path, table: list[dict[str, str]]) -> None:
    """The CSV, written beside ``path`` first and renamed (a failed write loses nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, ["source", "prompt", "target"])
        writer.writeheader()
        writer.writerows(table)
    partial.replace(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.finetune.general_text",
                                description="General English text for skip-aware training, from what this "
                                            "machine holds: Python's documentation, this repository's docs, "
                                            "E2E references.")
    p.add_argument("--out", required=True, help="the CSV to write (columns source, prompt, target)")
    p.add_argument("--max-chars", type=int, default=700, help="characters per row at most (default 700)")
    p.add_argument("--e2e-rows", type=int, default=400,
                   help=f"rows of {E2E_GROUP} E2E training references each (default 400; 0: none)")
    p.add_argument("--stdlib", action="store_true",
                   help="also the standard library's docstrings (prose paragraphs, read from its source)")
    p.add_argument("--seed", type=int, default=0, help="which references, and the rows' order")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    if args.max_chars <= PROMPT_CHARS:
        raise SkipDecodeError(f"--max-chars must exceed the prompt's {PROMPT_CHARS} characters, got {args.max_chars}")
    if args.e2e_rows < 0:
        raise SkipDecodeError(f"--e2e-rows must be >= 0, got {args.e2e_rows}")
    texts = sources(args.e2e_rows, args.seed, args.stdlib)
    table = rows(texts, args.max_chars, args.seed)
    write(Path(args.out), table)
    counts = {s: sum(r["source"] == s for r in table) for s in texts}
    print(f"{args.out}: {len(table)} rows (" + ", ".join(f"{n} {s}" for s, n in counts.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())

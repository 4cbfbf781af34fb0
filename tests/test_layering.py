"""No circles (issue 33 part C): the toolkit's modules form no import cycle, lazy imports included;
the top-level packages depend one way (runtime < engines < export < tools); no module takes
another's private name. tests/runtime/test_layering.py keeps runtime free of export and engines."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "engines", "export", "tools")  # in layer order: each may import those before it


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path):
    """(module imported, names taken from it) for every import of ``name``, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{base}.{alias.name}"
                yield (sub, ()) if sub in MODULES else (base, (alias.name,))


def _ours(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for target, _ in _imports(name, path):
            t = _ours(target)
            if t is not None and t != name and not name.startswith(t + "."):  # a package's own __init__
                graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_top_level_packages_depend_one_way():
    upward = sorted((name, target) for name, targets in _graph().items() for target in targets
                    if PACKAGES.index(target.split(".")[0]) > PACKAGES.index(name.split(".")[0]))
    assert upward == [], f"imports of a higher layer ({' < '.join(PACKAGES)}): {upward}"


def test_no_module_takes_another_modules_private_name():
    taken = sorted((name, f"{target}.{n}") for name, path in MODULES.items() for target, names in _imports(name, path)
                   for n in names if n.startswith("_") and not n.startswith("__") and _ours(target) not in (None, name))
    assert taken == []


def test_the_server_maps_errors_by_type_and_param_never_by_message_text():
    """runtime/serve turns library errors into HTTP errors by their type and ``param``: a message's
    wording may change without moving an error to another field or status."""
    matched = [f"{path.name}:{n}" for path in (ROOT / "runtime" / "serve").glob("*.py")
               for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
               if re.search(r"str\(exc\)\.(startswith|endswith)|in str\(exc\)|re\.\w+\(.*str\(exc\)", line)]
    assert matched == []


MAX_MODULE, MAX_CLASS = 420, 250  # lines of code (issue 59: a newcomer reads one job at a time)


def _code_lines(source: str) -> set[int]:
    """The lines holding code: not blank, not a comment alone, not a docstring."""
    docs = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    return {line for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type not in skip
            for line in range(tok.start[0], tok.end[0] + 1) if line not in docs}


def test_modules_and_classes_stay_small():
    too_big = []
    for name, path in MODULES.items():
        source = path.read_text(encoding="utf-8")
        lines = _code_lines(source)
        if len(lines) > MAX_MODULE:
            too_big.append(f"{name}: {len(lines)} lines of code (at most {MAX_MODULE})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                n = sum(node.lineno <= line <= node.end_lineno for line in lines)
                if n > MAX_CLASS:
                    too_big.append(f"{name}.{node.name}: {n} lines of code (at most {MAX_CLASS})")
    assert too_big == [], "split by job: " + "; ".join(too_big)


def test_the_size_check_counts_code_only():
    source = 'class A:\n    """Doc.\n\n    More."""\n\n    # why\n    x = 1\n\n    def f(self):\n        return 2\n'
    assert sorted(_code_lines(source)) == [1, 7, 9, 10]


def test_the_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

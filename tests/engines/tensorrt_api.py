"""TensorRT's Python API as its type stubs name it (the tensorrt-stubs package: NVIDIA's bindings'
classes and their members), so that the fakes and the engines' own calls are checked against the
real API rather than against each other.

The recorded copy (tests/engines/tensorrt-10.13-api.json) was made from tensorrt-stubs 10.13.0.35.1,
the TensorRT of JetPack 7.0/7.1 (installing the stubs would make ``import tensorrt`` find a package
without TensorRT in it, so they are read from the wheel):

    pip download --no-deps tensorrt-stubs==10.13.0.35.1 -d DIR
    python -m tests.engines.tensorrt_api DIR/tensorrt_stubs-10.13.0.35.1-py3-none-any.whl > tests/engines/tensorrt-10.13-api.json
"""

from __future__ import annotations

import json
import re
import sys
import zipfile

BINDINGS = "tensorrt_bindings/tensorrt.pyi"
MODULE = "tensorrt/__init__.pyi"


def parse_stub(text: str) -> dict[str, list[str]]:
    """{class: its members (methods, properties, attributes, nested classes), with its bases'} of a
    stub file, by its lines: the stubs are generated text that is not always valid Python."""
    classes: dict[str, tuple[list[str], set[str]]] = {}
    current = None
    for line in text.splitlines():
        found = re.match(r"^class (\w+)(?:\((.*)\))?:", line)
        if found:
            current = found.group(1)
            classes[current] = ([b.strip() for b in (found.group(2) or "").split(",") if b.strip()], set())
        elif line and not line.startswith(" "):
            current = None
        elif current is not None:
            member = re.match(r"^    (?:def (\w+)\(|class (\w+)|(\w+)\s*[:=])", line)
            if member:
                classes[current][1].add(next(g for g in member.groups() if g))

    def members(name: str) -> set[str]:
        bases, own = classes[name]
        return own.union(*(members(b) for b in bases if b in classes))

    return {name: sorted(members(name)) for name in sorted(classes)}


def module_names(text: str) -> list[str]:
    """The names a stub module's ``__all__`` lists."""
    found = re.search(r"^__all__ = \[(.*?)\]", text, flags=re.M)
    return sorted(re.findall(r"'(\w+)'", found.group(1))) if found else []


def from_wheel(path: str) -> dict:
    with zipfile.ZipFile(path) as wheel:
        bindings = wheel.read(BINDINGS).decode()
        module = wheel.read(MODULE).decode()
    version = re.search(r"^__version__: str = '([\d.]+)'", module, flags=re.M).group(1)
    return {"version": version, "module": module_names(module), "classes": parse_stub(bindings)}


if __name__ == "__main__":
    json.dump(from_wheel(sys.argv[1]), sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")

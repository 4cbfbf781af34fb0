"""TensorRT compatibility of exported graphs, checked without a GPU or TensorRT.

Every graph's operators (with their domain), its opset and the documented restrictions that a graph
can break are compared with what the TensorRT ONNX parser (onnx-tensorrt) imports, per TensorRT
version. The data, ``trt_ops/supported_ops.json``, is onnx-tensorrt's ``docs/operators.md`` for each
version, with the repository, path and commit it was read from (and a caveat where only the nearest
version could be read). Graphs are read without their weights, so OPT-66B costs what OPT-125m does.

Per version, a graph gets:

  errors    an operator the parser does not import, or one outside the ai.onnx domain; an opset below
            the stated range, or past it with an operator whose signature changed since the stated
            maximum in a way this version's importer does not read; a quantized type (INT4, FP8, FP4)
            the parser lacks; a restriction the graph breaks (an input that must be an initializer but
            is computed, outputs the importer drops); local functions before TensorRT 9
  warnings  an opset past the stated range whose operators the parser still reads (no parser refuses
            an opset: confirm on the device); another tensor type outside the operator's documented
            "Supported Types"; INT64 graph inputs and outputs, which TensorRT 8.x casts to INT32; an
            IR version newer than the parser's ONNX

    report = check_artifact("artifacts/opt-1.3b")          # default versions: 8.6, 10.3, 10.13, 10.16
    print("\\n".join(report.lines()))
    report.raise_for_errors()                              # TensorRTCompatibilityError names graph, op, version, fix
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from runtime.artifact.manifest import load_manifest
from runtime.errors import InvalidArgumentError, SkipDecodeError

ONNX_DOMAINS = ("", "ai.onnx")
# ONNX tensor element types -> the names operators.md uses in its "Supported Types" column.
TYPE_NAMES = {"FLOAT": "FP32", "FLOAT16": "FP16", "BFLOAT16": "BF16", "DOUBLE": "FP32", "INT32": "INT32",
              "INT64": "INT64", "INT8": "INT8", "UINT8": "UINT8", "BOOL": "BOOL", "INT4": "INT4",
              "FLOAT8E4M3FN": "FP8", "FLOAT8E4M3FNUZ": "FP8", "FLOAT8E5M2": "FP8", "FLOAT8E5M2FNUZ": "FP8",
              "FLOAT4E2M1": "FP4"}
# Which tensor carries an operator's documented type: input 0 unless listed here.
TYPED_INPUT = {"Where": 1}
TYPED_OUTPUT = {"Constant": 0, "ConstantOfShape": 0, "Cast": 0}
# Export-side remedies worth naming beside the generic ones.
# Weight-only quantized graphs (export.quantize): ONNX Runtime's MatMulNBits is a contrib op that no
# TensorRT parser imports. The QDQ form (int4 weights, opset 21 DequantizeLinear with block_size and
# no zero point, feeding a MatMul) is what TensorRT 10's explicit quantization takes for INT4
# weight-only: its Dequantize layer accepts "a 2-D tensor for block quantization (supported for
# DataType::kINT4 only)" and zero points that "must only contain zero-valued coefficients" (TensorRT
# operator docs, Dequantize). 10.13 (9-23), 10.16 and 11.0 (9-24) document opset 21; 10.0-10.5
# document 9-20, but no parser checks the opset and the 10.x DequantizeLinear importer reads a blocked
# scale by its shape (supported_ops.json "opset_enforcement" and 10.3's "read_beyond"), so 10.3 gets a
# warning to confirm on the device, not an error; 8.x has no INT4 type at all.
CONTRIB_HINTS = {
    "MatMulNBits": "or re-export with `--quant-format qdq` (int4 as blocked DequantizeLinear + MatMul, "
                   "for TensorRT 10+) or `--weights float`",
}
# Element types the parser of a version without them cannot even hold: an error, not a warning.
QUANTIZED_TYPES = ("INT4", "FP4", "FP8")
HINTS = {
    "LayerNormalization": "or export at opset 16 (`python -m export build --opset 16`) so layer norm is decomposed into "
                          "primitive operators (keep it in fp32: TensorRT's fp16 layer norm overflows)",
}


class TensorRTCompatibilityError(SkipDecodeError, ValueError):
    """An exported graph that the ONNX parser of a target TensorRT version would reject."""

    def __init__(self, findings: list[Finding]):
        self.findings = list(findings)
        lines = [f.message + (f"; fix: {f.fix}" if f.fix else "") for f in self.findings]
        super().__init__(f"{len(lines)} TensorRT compatibility error(s):\n  " + "\n  ".join(lines))


@dataclass(frozen=True)
class Finding:
    version: str  # TensorRT version, "8.6"
    graph: str  # graph name ("embed", "layer_03") or file name
    severity: str  # "error" or "warning"
    kind: str  # operator, domain, opset, restriction, type, int64, ir_version, function
    detail: str  # what is wrong, without version and graph
    fix: str = ""
    op: str | None = None
    node: str | None = None
    count: int = 1  # nodes of this graph with the same finding

    @property
    def message(self) -> str:
        return f"TensorRT {self.version}: {self.graph}: {self.detail}"


@dataclass(frozen=True)
class VersionSupport:
    """One TensorRT version's entry of supported_ops.json."""

    version: str
    data: dict

    @property
    def operators(self) -> dict:
        return self.data["operators"]

    @property
    def source(self) -> dict:
        return self.data["source"]

    @property
    def source_ref(self) -> str:
        s = self.source
        ref = f"{s['repository']} {s['path']} @ {s['commit'][:12]}"
        return ref if s.get("exact_version") else ref + ", nearest readable version"

    @property
    def opset_range(self) -> tuple[int | None, int | None]:
        return self.data["opset"]["min"], self.data["opset"]["max"]

    @property
    def int64_native(self) -> bool:
        return self.data["int64"] == "native"

    def checks(self, op: str) -> list[dict]:
        return [c for c in self.data.get("checks", []) if c["op"] == op]


@dataclass(frozen=True)
class SupportData:
    """The whole data file: every version (oldest first) and the ones checked by default."""

    versions: dict[str, VersionSupport]
    defaults: tuple[str, ...]

    def select(self, versions=None) -> list[VersionSupport]:
        """None: the defaults; "all"; one version string; or a list of them."""
        if versions is None:
            versions = self.defaults
        elif versions == "all":
            versions = tuple(self.versions)
        elif isinstance(versions, str):
            versions = (versions,)
        unknown = [v for v in versions if v not in self.versions]
        if unknown:
            raise InvalidArgumentError(f"no TensorRT operator data for {', '.join(unknown)}; "
                             f"known versions: {', '.join(self.versions)}")
        return [self.versions[v] for v in versions]

    def nearest(self, major: int, minor: int) -> VersionSupport:
        """The data for TensorRT ``major.minor``: its own, else the newest older version's (an
        operator added since is then reported missing: the safe side), else the oldest."""
        older = [vs for v, vs in self.versions.items() if _version_key(v) <= (major, minor)]
        return older[-1] if older else next(iter(self.versions.values()))


def load_support(path: str | Path | None = None) -> SupportData:
    """The packaged ``trt_ops/supported_ops.json`` (or the file at ``path``)."""
    return _load(str(path) if path else None)


@functools.lru_cache(maxsize=4)
def _load(path: str | None) -> SupportData:
    if path:
        text = Path(path).read_text()
    else:
        text = (resources.files("export") / "trt_ops" / "supported_ops.json").read_text()
    raw = json.loads(text)
    ordered = sorted(raw["versions"].items(), key=lambda kv: _version_key(kv[0]))
    versions = {v: VersionSupport(v, d) for v, d in ordered}
    return SupportData(versions, tuple(raw["default_versions"]))


# -- reading a graph ----------------------------------------------------------------------------------


@dataclass
class _GraphFacts:
    opset: int | None
    ir_version: int
    nodes: list  # (NodeProto, consts): consts are the names the parser holds as weights where it runs
    functions: set  # (domain, name) of model-local functions
    types: dict  # tensor name -> TensorProto element type name
    io: list  # (name, type) of graph inputs and outputs

    @property
    def op_types(self) -> set[tuple[str, str]]:
        return {(n.domain or "", n.op_type) for n, _ in self.nodes}


def _facts(model) -> _GraphFacts:
    import onnx
    from onnx import TensorProto

    opset = next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS), None)
    try:  # types of every tensor; without weights this is cheap, and a partial map is still useful
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - a custom op may stop inference; check with what we have
        inferred = model
    types = {}
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = TensorProto.DataType.Name(v.type.tensor_type.elem_type)
    nodes: list = []

    def walk(graph, outer: frozenset):
        # Names whose values the parser holds as weights here: initializers and Constant outputs
        # (its Constant importer returns weights), plus those of enclosing graphs.
        consts = set(outer) | {i.name for i in graph.initializer} | {i.values.name for i in graph.sparse_initializer}
        for i in graph.initializer:
            types[i.name] = TensorProto.DataType.Name(i.data_type)
        for n in graph.node:
            if n.op_type == "Constant" and (n.domain or "") in ONNX_DOMAINS:
                consts.update(n.output)
                for a in n.attribute:
                    if a.name == "value":
                        types[n.output[0]] = TensorProto.DataType.Name(a.t.data_type)
                    elif a.name in ("value_int", "value_ints"):
                        types[n.output[0]] = "INT64"
                    elif a.name in ("value_float", "value_floats"):
                        types[n.output[0]] = "FLOAT"
        consts = frozenset(consts)
        for n in graph.node:
            nodes.append((n, consts))
            for a in n.attribute:  # If / Loop / Scan bodies are imported node by node too
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(sub, consts)

    walk(model.graph, frozenset())
    for f in model.functions:  # parsed by inlining (TensorRT >= 9); their nodes must be importable too
        for n in f.node:
            nodes.append((n, frozenset()))
    io = [(v.name, types.get(v.name, "")) for v in [*model.graph.input, *model.graph.output]]
    return _GraphFacts(opset, model.ir_version, nodes, {(f.domain, f.name) for f in model.functions}, types, io)


# -- checking ------------------------------------------------------------------------------------------


def _first_supporting(op: str, support: SupportData, after: str) -> str | None:
    """The first version newer than ``after`` that imports ``op``."""
    for v, vs in support.versions.items():
        if _version_key(v) > _version_key(after) and vs.operators.get(op, {}).get("supported"):
            return v
    return None


def _first_supporting_type(op: str, type_name: str, support: SupportData, after: str) -> str | None:
    """The first version newer than ``after`` whose operators.md lists ``type_name`` for ``op``."""
    for v, vs in support.versions.items():
        if _version_key(v) > _version_key(after) and type_name in (vs.operators.get(op, {}).get("types") or ()):
            return v
    return None


def _lifted(check: dict, support: SupportData, after: str) -> str | None:
    """The first version newer than ``after`` whose parser no longer has this restriction."""
    for v, vs in support.versions.items():
        if _version_key(v) <= _version_key(after) or not vs.operators.get(check["op"], {}).get("supported"):
            continue
        if not any(c["kind"] == check["kind"] and c.get("input") == check.get("input") for c in vs.checks(check["op"])):
            return v
    return None


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def _check_facts(facts: _GraphFacts, graph: str, vs: VersionSupport, support: SupportData,
                 strict_types: bool) -> list[Finding]:
    v = vs.version
    found: dict[tuple, Finding] = {}

    def add(severity, kind, detail, fix="", op=None, node=None):
        key = (severity, kind, op, detail)
        if key in found:
            prev = found[key]
            found[key] = Finding(v, graph, severity, kind, detail, fix, op, prev.node, prev.count + 1)
        else:
            found[key] = Finding(v, graph, severity, kind, detail, fix, op, node)

    lo, hi = vs.opset_range
    if facts.opset is None:
        add("error", "opset", "the graph imports no ai.onnx opset",
            "export with an ai.onnx opset_import (`python -m export build --opset`)")
    elif lo is not None and facts.opset < lo:
        add("error", "opset", f"opset {facts.opset} is below the parser's range ({lo} to {hi}; "
                              f"'{vs.data['opset']['statement']}')",
            f"re-export with `python -m export build --opset {lo}` or newer")
    elif hi is not None and facts.opset > hi:
        _check_opset_beyond(facts, vs, support, add)
    max_ir = vs.data.get("onnx", {}).get("max_ir_version")
    if max_ir is not None and facts.ir_version > max_ir:
        add("warning", "ir_version", f"IR version {facts.ir_version} is newer than the parser's ONNX "
                                     f"{vs.data['onnx']['version']} knows (IR {max_ir})",
            "export with an older onnx / exporter, or check the parse on the device")

    for node, consts in facts.nodes:
        op, domain = node.op_type, node.domain or ""
        where = f"{op} node '{node.name or node.output[0]}'"
        if (domain, op) in facts.functions:
            if not vs.data.get("local_functions", True):
                add("error", "function", f"{where} calls a model-local function, which this parser cannot import",
                    "inline local functions before building (onnx.inliner.inline_local_functions) or use TensorRT 9+",
                    op, node.name)
            continue
        if domain not in ONNX_DOMAINS:
            add("error", "domain", f"{domain}::{op} is not an ONNX operator; TensorRT imports it only as a plugin",
                f"provide a TensorRT plugin named {op} or export without it"
                + (f", {CONTRIB_HINTS[op]}" if op in CONTRIB_HINTS else ""), op, node.name)
            continue
        entry = vs.operators.get(op)
        if entry is None or not entry["supported"]:
            later = _first_supporting(op, support, v)
            status = "is not in the parser's operator list" if entry is None else "is marked unsupported (N)"
            fix = (f"use TensorRT {later} or newer, " if later else "") + (
                f"re-export without {op} (decompose it into supported operators) "
                f"or provide a TensorRT plugin named {op}")
            if op in HINTS:
                fix += f", {HINTS[op]}"
            add("error", "operator", f"operator {op} {status} in TensorRT {v}'s operators.md ({vs.source_ref})",
                fix, op, node.name)
            continue
        for check in vs.checks(op):
            if check["kind"] == "constant_input":
                i = check["input"]
                if len(node.input) > i and node.input[i] and node.input[i] not in consts:
                    lifted = _lifted(check, support, v)
                    how = ("the parser takes only initializers and Constant nodes here" if check["strict"]
                           else "the parser must fold it to a constant itself")
                    add("error" if check["strict"] else "warning", "restriction",
                        f"{where}: input {i} ({check['input_name']}) is computed by the graph, but operators.md "
                        f"says \"{check['doc']}\" ({how})",
                        "make it a constant: fold constants before building (polygraphy surgeon sanitize "
                        "--fold-constants) or export so it is an initializer"
                        + (f"; TensorRT {lifted} and newer lift this restriction" if lifted else ""), op, node.name)
            elif check["kind"] == "max_outputs":
                outs = [o for o in node.output if o]
                if len(outs) > check["outputs"]:
                    add("error", "restriction", f"{where} has {len(outs)} outputs: \"{check['doc']}\"",
                        f"export {op} with its first output only", op, node.name)
        allowed = entry.get("types")
        if allowed:
            names = []
            if op in TYPED_OUTPUT:
                names.append(node.output[TYPED_OUTPUT[op]])
            if op not in ("Constant", "ConstantOfShape"):
                i = TYPED_INPUT.get(op, 0)
                if len(node.input) > i and node.input[i]:
                    names.append(node.input[i])
            for name in names:
                onnx_type = facts.types.get(name)
                if not onnx_type:
                    continue
                t = TYPE_NAMES.get(onnx_type, onnx_type)
                shown = t
                if t == "INT64" and not vs.int64_native:
                    t, shown = "INT32", "INT64 (cast to INT32 by this parser)"
                if t in QUANTIZED_TYPES and t not in allowed:
                    later = _first_supporting_type(op, t, support, v)
                    add("error", "type", f"{op} on {t}: this parser has no {t} (operators.md lists Supported "
                                         f"Types {', '.join(allowed)})",
                        (f"target TensorRT {later} or newer, or " if later else "")
                        + f"re-export without {t} weights (`--weights float`)", op, node.name)
                elif t not in allowed:
                    add("error" if strict_types else "warning", "type",
                        f"{op} on {shown}: operators.md lists Supported Types {', '.join(allowed)}",
                        f"cast to a listed type before {op}, or confirm on a device that TensorRT {v} builds it",
                        op, node.name)

    if not vs.int64_native:
        wide = [name for name, t in facts.io if t == "INT64"]
        if wide:
            add("warning", "int64", f"INT64 graph inputs/outputs ({', '.join(wide)}) are cast to INT32 by this "
                                    f"parser, clamping to +-2^31-1",
                "bind INT32 buffers for them on TensorRT 8.x (token ids and masks fit)")
    order = {"error": 0, "warning": 1}
    return sorted(found.values(), key=lambda f: (order[f.severity], f.kind, f.op or ""))


def _signature(schema) -> tuple:
    return (sorted(schema.attributes), [i.name for i in schema.inputs], [o.name for o in schema.outputs])


def changed_operators(ops, documented: int, opset: int) -> list[str]:
    """The ai.onnx operators among ``ops`` whose signature (attributes, inputs, outputs) differs
    between opset ``documented`` and ``opset``: those an importer written for ``documented`` may
    misread. An operator whose later versions only widened its types is not listed."""
    import onnx.defs

    changed = []
    for op in sorted(ops):
        try:
            before, after = onnx.defs.get_schema(op, documented), onnx.defs.get_schema(op, opset)
        except onnx.defs.SchemaError:  # not an operator at ``documented``: the operator check names it
            continue
        if before.since_version != after.since_version and _signature(before) != _signature(after):
            changed.append(op)
    return changed


def _first_documenting(opset: int, support: SupportData, after: str) -> str | None:
    """The first version newer than ``after`` whose documented range holds ``opset``."""
    for v, vs in support.versions.items():
        lo, hi = vs.opset_range
        if _version_key(v) > _version_key(after) and (lo or 0) <= opset <= (hi or 0):
            return v
    return None


def _check_opset_beyond(facts: _GraphFacts, vs: VersionSupport, support: SupportData, add) -> None:
    """A graph past the documented range: no parser refuses the opset itself (supported_ops.json
    "opset_enforcement"), so what can break is an operator whose signature changed since the
    documented maximum and whose importer this version does not read that way."""
    lo, hi = vs.opset_range
    ops = {op for domain, op in facts.op_types if domain in ONNX_DOMAINS}
    read = vs.data["opset"].get("read_beyond", {})
    changed = changed_operators(ops, hi, facts.opset)
    unread = [op for op in changed if op not in read]
    later = _first_documenting(facts.opset, support, vs.version)
    where = f"opset {facts.opset} is past the parser's documented range ({lo or 'any'} to {hi}; " \
            f"'{vs.data['opset']['statement']}')"
    newer = f"target TensorRT {later} or newer, whose parser documents opset {facts.opset}" if later else \
        f"target a TensorRT whose parser documents opset {facts.opset}"
    if unread:
        # Our exports write opset 21 only for the qdq weights format; everything else is --opset 14-17.
        fix = (f"{newer}, or re-export with an opset up to {hi} (`python -m export build --opset`; the qdq "
               f"weights format needs 21: export with --weights float or --quant-format matmulnbits "
               f"for this version)")
        add("error", "opset", f"{where}, and {', '.join(unread)} changed after opset {hi} in ways its "
                              f"importer does not read", fix)
        return
    known = f", or ({', '.join(changed)}) as this version's importer reads them (supported_ops.json)"
    add("warning", "opset", f"{where}; the parser does not refuse an opset, and this graph's operators "
                            f"changed after opset {hi} only in the types they accept" + (known if changed else ""),
        f"confirm the parse on the device (`python -m tools.trtexec ARTIFACT --graph NAME --run`), or {newer}")


def check_model(model, name: str = "graph", versions=None, *, strict_types: bool = False,
                support: SupportData | None = None) -> dict[str, list[Finding]]:
    """Findings per TensorRT version for an in-memory ``onnx.ModelProto``."""
    support = support or load_support()
    facts = _facts(model)
    return {vs.version: _check_facts(facts, name, vs, support, strict_types) for vs in support.select(versions)}


def check_graph(path, versions=None, *, name: str | None = None, strict_types: bool = False,
                support: SupportData | None = None) -> dict[str, list[Finding]]:
    """Findings per TensorRT version for one ``.onnx`` file, read without its external weights."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return check_model(model, name or Path(path).name, versions, strict_types=strict_types, support=support)


# -- whole artifacts -----------------------------------------------------------------------------------


@dataclass
class VersionResult:
    version: str
    source: str  # where the operator list came from
    graphs: int
    operators: list[str]  # every op type in the artifact's graphs
    opsets: list[int]
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def passed(self) -> bool:
        return not self.errors

    @property
    def summary(self) -> str:
        opsets = "/".join(map(str, self.opsets))
        head = f"{self.graphs} graphs, {len(self.operators)} operators at opset {opsets}"
        if self.errors:
            tail = f"{len(self.errors)} error(s)"
        else:
            tail = "all importable"
        if self.warnings:
            tail += f", {len(self.warnings)} warning(s)"
        return f"{head}: {tail} ({self.source})"

    def lines(self) -> list[str]:
        out = [f"[{'ok' if self.passed else 'FAIL':>4}] TensorRT {self.version}: {self.summary}"]
        for f, graphs, count in _grouped(self.findings):
            nodes = f" [{count} nodes]" if count > 1 else ""
            out.append(f"         {f.severity}: {graphs}: {f.detail}{nodes}" + (f"; fix: {f.fix}" if f.fix else ""))
        return out


@dataclass
class CompatReport:
    directory: str
    results: list[VersionResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def result(self, version: str) -> VersionResult:
        for r in self.results:
            if r.version == version:
                return r
        raise KeyError(f"TensorRT {version} was not checked; checked: {', '.join(r.version for r in self.results)}")

    @property
    def errors(self) -> list[Finding]:
        return [f for r in self.results for f in r.errors]

    def lines(self) -> list[str]:
        return [line for r in self.results for line in r.lines()]

    def raise_for_errors(self) -> None:
        if self.errors:
            raise TensorRTCompatibilityError(self.errors)


def _grouped(findings: list[Finding]):
    """Identical findings across graphs, once each: (first finding, graphs named compactly, node count)."""
    groups: dict[tuple, list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.severity, f.kind, f.op, f.detail), []).append(f)
    for fs in sorted(groups.values(), key=lambda fs: fs[0].severity != "error"):
        names = [f.graph for f in fs]
        text = ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]} ({len(names)} graphs)"
        yield fs[0], text, sum(f.count for f in fs if f.node is not None)


def check_artifact(directory, versions=None, *, strict_types: bool = False,
                   support: SupportData | None = None) -> CompatReport:
    """Check every graph the manifest of ``directory`` names, for each TensorRT version.

    ``versions``: None for the data file's defaults (the Jetson parsers: 8.6 for JetPack 6.0, 10.3 for
    6.1/6.2, 10.13 for 7.0/7.1, 10.16 for 7.2), "all" (8.5 and 11.0 too), or a list such as ["10.3"].
    Hashes are not rechecked here (``python -m export verify`` does that).
    """
    import onnx

    support = support or load_support()
    selected = support.select(versions)
    manifest = load_manifest(directory, check_hashes=False)
    per_graph = []
    for g in manifest.graphs:
        model = onnx.load(str(Path(directory) / g.file), load_external_data=False)
        per_graph.append((g.name, _facts(model)))
    operators = sorted({op for _, f in per_graph for _, op in f.op_types})
    opsets = sorted({f.opset for _, f in per_graph if f.opset is not None})
    results = []
    for vs in selected:
        findings = [x for name, f in per_graph for x in _check_facts(f, name, vs, support, strict_types)]
        results.append(VersionResult(vs.version, vs.source_ref, len(per_graph), operators, opsets, findings))
    return CompatReport(str(directory), results)

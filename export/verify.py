"""``python -m export verify DIR``: recheck an artifact against PyTorch and transformers.

1. the manifest and the sha256 of every file it names;
2. every graph against the PyTorch module it came from (export.parity: Polygraphy's Comparator with
   its ONNX Runtime runner, at the export's stated tolerances), the layers' fused variant on the
   same cases (export.parity.compare_fused), and
   every operator and opset against the TensorRT ONNX parser's supported lists (export.trt_compat);
3. end to end, batched with left padding: greedy tokens of the ONNX Runtime backend at full depth
   against transformers' ``generate``, with the logits of every step; and under a skip policy,
   against the skip-aware PyTorch reference, including the layers run at each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.artifact.manifest import DRAFT_LAYERS, load_manifest
from runtime.generator import load

from . import parity, reference

DEFAULT_PROMPTS = ("Hello, my name is", "The weather today is", "Paris is the capital of")
# Greedy logits of a whole generation, fp32 artifact vs transformers: errors grow with depth and
# steps, but stay far below the gaps between the top tokens of a real model.
E2E_LOGIT_ATOL = {"float32": 1e-3, "float16": 1e-1}


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str, status: str | None = None) -> None:
        """``status``: the word shown instead of ok/FAIL for a check that passes with a caveat
        ("warn") or does not apply to this artifact ("skip"); only ``ok`` False fails the report."""
        self.lines.append(f"[{status or ('ok' if ok else 'FAIL'):>4}] {name}: {detail}")
        if not ok:
            self.failures.append(name)

    @property
    def passed(self) -> bool:
        return not self.failures


def verify(directory, model: str | None = None, prompts=DEFAULT_PROMPTS, max_new_tokens: int = 16,
           speedup: float = 2.0, log=print, progress: bool = True) -> Report:
    report = Report()
    manifest = load_manifest(directory, check_hashes="full")  # every byte, whatever the fingerprints say
    report.add("files", True, f"manifest schema {manifest.schema_version}, {len(manifest.files)} "
                              f"files match their sha256")
    # PyTorch and transformers run in a child process that exits before any ONNX Runtime session
    # opens here: the two never hold the weights at once (export.reference).
    torch_side = reference.run(directory, model, list(prompts), max_new_tokens, speedup, progress)
    if torch_side.mismatch:
        report.add("source", False, "the reference checkpoint's shape differs from the artifact's; "
                                    "pass the checkpoint it was exported from with --model")
        return report

    from tqdm.auto import tqdm

    plain = [parity.compare(spec, torch_side.cases[spec.name], directory, manifest.dtype,
                            manifest.graph_weights(spec.name))
             for spec in tqdm(manifest.checked_graphs, desc="check vs torch", unit="graph", disable=not progress)]
    # the layers' fused variant (export.fused) on the same cases: judged as float graphs
    results = plain + [
        parity.compare_fused(spec, torch_side.cases[spec.name], directory, manifest.dtype, manifest.page_size)
        for spec in tqdm(manifest.fused, desc="check fused vs torch", unit="graph", disable=not progress)]
    results += [parity.compare_draft_layer(spec, torch_side.cases[spec.name + parity.DRAFT_KEY], directory,
                                           manifest.dtype, manifest.weights[DRAFT_LAYERS], manifest.page_size)
                for spec in manifest.draft_layers]
    if manifest.embed_table is not None:  # the runtime's lookup in the embedding graph's stead
        results.append(parity.compare_embed_table(manifest.embed, manifest.embed_table, torch_side.cases["embed"],
                                                  directory, manifest.dtype, manifest.model.vocab_size))
    bad = [r.graph for r in results if not r.passed]
    floats = [r for r in results if r.weights == "float"]
    atol, rtol = parity.TOLERANCES[manifest.dtype]
    detail = (f"{len(plain)} graphs vs PyTorch through Polygraphy "
              f"{parity.polygraphy_version()} (its ONNX Runtime runner, Comparator.run and compare_accuracy)")
    if manifest.fused:
        detail += f", and {len(manifest.fused)} fused layer graphs on the same cases (their K/V bound in place)"
    if manifest.draft_layers:
        detail += f", and {len(manifest.draft_layers)} draft layer graphs"
    if manifest.embed_table is not None:
        detail += ", and the embedding's table lookup against its graph (value for value)"
    if floats:
        worst = max(floats, key=lambda r: r.max_abs_diff)
        detail += (f", float: max |diff| {worst.max_abs_diff:.2e} ({worst.graph}), tolerance atol "
                   f"{atol:g} rtol {rtol:g}")
    for kind in sorted({r.weights for r in results} - {"float"}):
        mine = [r for r in results if r.weights == kind]
        worst = max(mine, key=lambda r: r.weight_error)
        diff = max(mine, key=lambda r: r.max_abs_diff)
        detail += (f", {kind}: weights' relative error {worst.weight_error:.2e} ({worst.graph}), tolerance "
                   f"{parity.QUANT_TOLERANCES[kind]:g}; max |diff| {diff.max_abs_diff:.2e} ({diff.graph}) "
                   f"against the module with those weights, tolerance atol {atol:g} rtol {rtol:g}")
    report.add("graphs", not bad, detail + (f"; failed: {', '.join(bad)}" if bad else ""))
    if manifest.quantized:
        report.add("weights", True, f"{manifest.weights_label}: greedy tokens and logits below may "
                                    f"differ from the float reference (reported, not required)")

    from .trt_compat import check_artifact

    # A weight format is chosen for its runtimes (MatMulNBits: ONNX Runtime; qdq: TensorRT 10+): a
    # parser that cannot read the format is reported as such, not failed.
    unreadable, w = {}, manifest.weights
    if manifest.quantized:
        from .quantize import QuantConfig, tensorrt_verdicts

        verdicts = tensorrt_verdicts(QuantConfig(weights=w["layers"], head_weights=w["head"],
                                                 block_size=w["block_size"], format=w["format"],
                                                 accuracy_level=w.get("accuracy_level", 0)))
        unreadable = {v: why for v, (kind, why) in verdicts.items() if kind == "cannot"}
    for r in check_artifact(directory).results:  # the JetPack versions: TensorRT 8.6, 10.3, 10.13, 10.16
        details = "".join("\n         " + line.strip() for line in r.lines()[1:])
        if r.version in unreadable and not r.passed:
            readers = [v for v in verdicts if v not in unreadable]
            fix = (f"the format is for TensorRT {', '.join(readers)}" if readers else
                   "the format is for ONNX Runtime; for TensorRT re-export int4 with --quant-format qdq")
            report.add(f"TensorRT {r.version} parser", True,
                       f"cannot parse this artifact's {w['format']} weights ({unreadable[r.version]}; not required: "
                       f"{fix}; for this TensorRT, --weights float): " + r.summary + details, status="skip")
        else:
            report.add(f"TensorRT {r.version} parser", r.passed, r.summary + details,
                       status="warn" if r.passed and any(f.kind == "opset" for f in r.warnings) else None)

    gen = load(directory, check_hashes=False)
    try:
        _end_to_end(report, gen, torch_side.references, manifest.dtype, exact=not manifest.quantized)
    finally:
        gen.close()
    return report


def _end_to_end(report, gen, refs: reference.References, dtype, exact=True):
    """``exact``: require tokens (fp32) and logits to match; False for quantized weights, whose
    difference from the float reference is the quantization's, bounded per graph above."""
    eos = gen.manifest.model.eos_ids
    pad = gen.manifest.model.pad_token_id
    prompts, max_new_tokens, hf_tokens = refs.prompts, refs.max_new_tokens, refs.hf_tokens
    # Full depth: ONNX Runtime vs transformers' generate.
    full = {"max_layers": gen.num_layers, "min_layers": gen.num_layers}
    stream = gen.stream(prompts, max_new_tokens, policy=full, eos_token_id=eos)
    step_logits = _step_logits(stream, len(prompts))
    ours = [_pad(t, len(hf_tokens[0]), pad) for t in stream.result.token_ids]
    same = ours == hf_tokens
    report.add("full depth vs transformers", same or dtype == "float16" or not exact,
               f"{len(prompts)} prompts, {max_new_tokens} new tokens, greedy: "
               + ("identical tokens" if same else f"tokens differ ({_agreement(ours, hf_tokens)})"))
    running = [len(t) for t in stream.result.token_ids]  # steps each row ran, its EOS included
    diff = _logit_diff(step_logits, refs.hf_logits, ours, hf_tokens, running)
    tol = E2E_LOGIT_ATOL[dtype]
    report.add("full depth logits", diff <= tol or not exact,
               f"max |diff| {diff:.2e} over the steps where tokens agree "
               + (f"(atol {tol:g})" if exact else "(quantized weights: reported, not required)"))

    # Under a skip policy: ONNX Runtime vs the skip-aware PyTorch reference.
    policy, expected = refs.policy, refs.skip_tokens
    skipped = gen.generate(prompts, max_new_tokens, policy=policy, eos_token_id=eos)
    ours = [_pad(t, len(expected[0]), pad) for t in skipped.token_ids]
    same = ours == expected
    layers_ok = _layers_follow(skipped.stats.steps, policy)
    report.add(f"skip policy {policy.max_layers}->{policy.min_layers} layers",
               (same or dtype == "float16" or not exact) and layers_ok,
               f"{skipped.stats.layer_reduction:.2f}x fewer layers, layers per step "
               f"{_compact(skipped.stats.layers_per_step)}; "
               + ("identical tokens to the PyTorch reference" if same else
                  f"tokens differ from the PyTorch reference ({_agreement(ours, expected)})")
               + ("" if layers_ok else "; layers run differ from the policy's active sets"))


def _layers_follow(steps, policy) -> bool:
    """Whether every step ran the policy's active set at its step. Judged against the policy, not
    the reference's record of its own steps: where quantized weights change the tokens, rows end
    at other steps than the reference's (an int4 artifact ran more steps and failed here)."""
    return all(tuple(s.layers) == tuple(policy.active_layers(s.step)) for s in steps)


def _step_logits(stream, rows: int) -> list[np.ndarray]:
    """(B, V) logits per generation step, each row's from the event that gave its token at that
    step: an event carries the rows at one step, and an int8/int4 artifact seats its rows one at a
    time (batch_invariant), so its first events hold some rows each (the others' zeros)."""
    per_step: dict[int, np.ndarray] = {}
    for event in stream:
        for b, token in enumerate(event.token_ids):
            if token is not None:
                per_step.setdefault(event.step, np.zeros((rows, event.logits.shape[1]), np.float32))[b] = event.logits[b]
    return [per_step[g] for g in sorted(per_step)]


def _logit_diff(ours_logits, hf_logits, ours_tokens, hf_tokens, running) -> float:
    """Max |logit diff| over the steps at which both sides have fed the same tokens so far, on
    the rows still generating (``running[r]``: steps row r ran). A row that has emitted EOS is
    done: transformers keeps computing logits for it on pad tokens, the runtime does not."""
    worst = 0.0
    for step, (ours, theirs) in enumerate(zip(ours_logits, hf_logits)):
        if [t[:step] for t in ours_tokens] != [t[:step] for t in hf_tokens]:
            break
        rows = [r for r, n in enumerate(running) if step < n]
        if rows:
            worst = max(worst, float(np.abs(ours[rows] - theirs[rows]).max()))
    return worst


def _pad(tokens: list[int], length: int, pad: int) -> list[int]:
    return tokens + [pad] * (length - len(tokens))


def _agreement(a, b) -> str:
    flat = [x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return f"{sum(flat)}/{len(flat)} positions agree"


def _compact(values: list[int]) -> str:
    """[8, 8, 7, 7, 7] -> '8x2 7x3'."""
    out, prev, count = [], None, 0
    for v in values + [None]:
        if v == prev:
            count += 1
            continue
        if prev is not None:
            out.append(f"{prev}x{count}")
        prev, count = v, 1
    return " ".join(out)

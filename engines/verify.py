"""``python -m engines verify ARTIFACT_DIR``: every built engine against ONNX Runtime, through Polygraphy.

For each engine that engines.json lists and each of its optimization profiles (prefill, decode),
Polygraphy's TensorRT runner (``TrtRunner`` on the plan, that profile selected) and its ONNX Runtime
runner (``OnnxrtRunner`` on the graph the plan was built from) run the same inputs at the profile's
opt shapes, the shapes TensorRT tuned its kernels for; ``Comparator.run`` feeds both from one
Polygraphy ``DataLoader`` (so an INT32 binding of TensorRT 8.x gets the same ids as ONNX Runtime's
INT64 input), and ``compare_accuracy`` judges them with numpy's ``allclose`` rule at ``TOLERANCE``
(``runtime.compare.compare_func``).

Inputs: ids inside the vocabulary and an all-ones attention mask (no row fully masked); hidden
states and the past K/V keep Polygraphy's default uniform [0, 1], as ``tools.trtexec --polygraphy``
does for the same check by hand.

Exit codes (``python -m engines verify``): 0 every engine within tolerance; 1 one or more differ;
2 a user error (no engines built, TensorRT missing here, an engine manifest that does not match).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.artifact.manifest import GraphSpec, load_manifest

from .errors import EngineConfigError
from .manifest import DEFAULT_ENGINE_DIR, read_engine_manifest
from .profiles import Profile

# (atol, rtol): an element fails when it is off by more than both. Engines run fp16, or fp32 on TF32
# (TensorRT's default for fp32 builds on Ampere and later, every Jetson Orin): both keep 10 mantissa
# bits in their matmuls, and the export's own fp16 graphs pass 3e-2 against PyTorch
# (export.parity.TOLERANCES["float16"]); a broken layer is off by O(1) or NaN. The same numbers as
# tools.trtexec's printed `polygraphy run`.
TOLERANCE = (3e-2, 3e-2)
SEED = 1  # Polygraphy DataLoader seed: the same inputs on every run


@dataclass
class EngineCheck:
    graph: str
    profile: str  # "prefill" or "decode"
    shapes: dict  # input name -> the shape run
    passed: bool
    max_abs_diff: float

    def line(self) -> str:
        shapes = ", ".join(f"{n} {list(s)}" for n, s in self.shapes.items())
        return (f"[{'ok' if self.passed else 'FAIL':>4}] {self.graph} {self.profile}: max |diff| "
                f"{self.max_abs_diff:.2e} ({shapes})")


def trt_runner(plan: Path, profile: int, name: str):
    """Polygraphy's TensorRT runner on a serialized plan, with optimization profile ``profile``."""
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    from .builder import import_tensorrt

    import_tensorrt()  # the install message, before Polygraphy's own import fails less helpfully
    return TrtRunner(EngineFromBytes(Path(plan).read_bytes()), name=name, optimization_profile=profile)


def value_ranges(spec: GraphSpec, vocab_size: int) -> dict:
    """Polygraphy val_range for the inputs a random loader would make invalid."""
    ranges = {}
    for t in spec.inputs:
        if t.name == "input_ids":
            ranges[t.name] = (0, vocab_size - 1)
        elif t.name == "attention_mask":
            ranges[t.name] = (1, 1)
    return ranges


def _loader(spec: GraphSpec, profile: Profile, vocab_size: int):
    from polygraphy.common import TensorMetadata
    from polygraphy.comparator import DataLoader

    meta = TensorMetadata()
    for t in spec.inputs:  # dtype None: each runner's own (an INT32 binding gets the same values)
        meta.add(t.name, dtype=None, shape=profile.shapes[t.name].opt)
    return DataLoader(seed=SEED, iterations=1, input_metadata=meta, val_range=value_ranges(spec, vocab_size))


def check_engine(spec: GraphSpec, profile: Profile, engine, onnx: Path, vocab_size: int) -> EngineCheck:
    """One engine (its Polygraphy runner, on ``profile``) at the profile's opt shapes, against ONNX
    Runtime on the graph it was built from."""
    import numpy as np
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    from runtime.compare import compare_func, ort_session

    reference = OnnxrtRunner(lambda: ort_session(onnx), name=f"onnxruntime:{spec.name}")
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):  # Polygraphy logs every output's statistics at INFO
        results = Comparator.run([engine, reference], data_loader=_loader(spec, profile, vocab_size))
        passed = bool(Comparator.compare_accuracy(results, compare_func=compare_func(*TOLERANCE)))
    (_, [ours]), (_, [theirs]) = results
    diff = max((float(np.abs(np.asarray(ours[o.name], np.float32) - np.asarray(theirs[o.name], np.float32)).max())
                for o in spec.outputs), default=0.0)
    shapes = {t.name: profile.shapes[t.name].opt for t in spec.inputs}
    return EngineCheck(spec.name, profile.name, shapes, passed and bool(np.isfinite(diff)), diff)


def verify_engines(artifact_dir, engine_dir=None, graphs=None, runner=trt_runner,
                   progress: bool = True) -> list[EngineCheck]:
    """Check every engine (or those of ``graphs``) at each of its profiles; ``runner(plan, profile
    index, name)`` makes the engine's Polygraphy runner (default: TrtRunner on the plan)."""
    artifact_dir = Path(artifact_dir)
    engine_dir = Path(engine_dir) if engine_dir is not None else artifact_dir / DEFAULT_ENGINE_DIR
    artifact = load_manifest(artifact_dir, check_hashes=False)
    em = read_engine_manifest(engine_dir, artifact_dir)
    names = [g.name for g in artifact.graphs if g.name in em.engines]
    if graphs:
        unknown = [g for g in graphs if g not in em.engines]
        if unknown:
            raise EngineConfigError(f"no engine for {', '.join(unknown)} in {engine_dir}; built: "
                                    f"{', '.join(names) or 'none'} (python -m engines build {artifact_dir})")
        names = [n for n in names if n in graphs]
    if not names:
        raise EngineConfigError(f"{engine_dir} holds no engines; build them with "
                                f"`python -m engines build {artifact_dir}`")
    from tqdm.auto import tqdm

    # every runner first: a missing TensorRT fails here, before any engine runs
    jobs = [(artifact.graph(name), Profile.from_dict(data),
             runner(engine_dir / em.engines[name].plan, index, f"tensorrt:{name}:{data['name']}"))
            for name in names for index, data in enumerate(em.engines[name].profiles)]
    return [check_engine(spec, profile, engine, artifact_dir / spec.file, artifact.model.vocab_size)
            for spec, profile, engine in tqdm(jobs, desc="engines vs onnxruntime", unit="check",
                                              disable=not progress)]

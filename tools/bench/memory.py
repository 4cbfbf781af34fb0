"""``python -m tools.bench.memory ARTIFACT [...]``: peak memory of load + generate, against the weights.

For each artifact, in a fresh process each (so one's pages never count for another): peak RSS
of ``runtime.load`` + one ``generate`` on the ONNX Runtime CPU backend (export.measure, the probe
``python -m export plan --measure`` uses), and with
``--verify`` of ``python -m export verify``; each divided by the artifact's weight bytes: the bytes
of every initializer of every graph, a tensor that several graphs share (the tied embedding in
``weights.bin``) counted once. Issue 12's targets: load + generate within 1.15x, verify within 2x.

Peak RSS counts file pages the process has mapped and touched (ONNX Runtime maps ``weights.bin``)
as well as its own memory; the table splits what is resident after generating into anonymous
memory (packed weights, KV cache, heap), mapped pages of ``weights.bin`` and other files (code).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from export.measure import run_probe
from runtime import cli

from .runner import REPO


# verify runs its PyTorch side in a child process (export.reference) while it waits: its peak is
# its own, or its RSS at that moment plus the child's peak, whichever is larger.
_VERIFY = """
import json, resource, sys
from export import reference
from export.measure import status_bytes
from export.verify import verify
waiting = []
def run(*a, **k):
    waiting.append(status_bytes("VmRSS"))
    return _run(*a, **k)
_run, reference.run = reference.run, run
report = verify(sys.argv[1], log=lambda *_: None, progress=False)
own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"peak": max(own, waiting[0] + child), "own": own, "child": child, "passed": report.passed}))
"""


def weight_bytes(directory: Path) -> int:
    """Bytes of the artifact's initializers, each external tensor once (by file and offset)."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    from runtime.artifact.manifest import load_manifest

    packed = (onnx.TensorProto.UINT4, onnx.TensorProto.INT4)  # two values a byte

    manifest = load_manifest(directory, check_hashes=False)
    seen, total = set(), 0
    for spec in manifest.graphs:
        proto = onnx.load(str(directory / spec.file), load_external_data=False)
        for t in proto.graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            key = (ext["location"], ext.get("offset", "0")) if ext else (spec.name, t.name)
            if key not in seen:
                seen.add(key)
                n = int(np.prod(t.dims, dtype=np.int64))
                total += (-(-n // 2) if t.data_type in packed
                          else n * np.dtype(tensor_dtype_to_np_dtype(t.data_type)).itemsize)
    return total


def _child(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the measuring process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = cli.parser("python -m tools.bench.memory", __doc__.split("\n\n")[0])
    p.add_argument("artifacts", nargs="+", type=Path, help="artifact directories (python -m export build)")
    p.add_argument("--batch", type=int, default=1, help="rows generated together")
    p.add_argument("--tokens", type=int, default=256, help="positions per row, prompt included")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--verify", action="store_true", help="also measure `python -m export verify`")
    args = p.parse_args(argv)
    return cli.run(lambda: _main(args))


def _main(args) -> int:
    from runtime.artifact.manifest import load_manifest

    for art in args.artifacts:  # every argument before the first measurement (sizes, not hashes)
        load_manifest(art, check_hashes=False)
    mb = lambda n: f"{n / 2**20:,.0f}"  # noqa: E731
    print("| artifact | dtype | weights MiB | load + generate peak RSS MiB | ratio | RSS after load MiB | "
          "after generate: anonymous / weights.bin mapped / other files MiB |"
          + (" verify peak RSS MiB | ratio |" if args.verify else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if args.verify else ""))
    for art in args.artifacts:
        manifest = json.loads((art / "manifest.json").read_text())
        weights = weight_bytes(art)
        run = run_probe(art.resolve(), args.batch, args.tokens, args.prompt)
        parts = run["resident_after_generate_bytes"]
        row = (f"| {art} | {manifest['dtype']} | {mb(weights)} | {mb(run['peak_rss_bytes'])} | "
               f"{run['peak_rss_bytes'] / weights:.2f}x | {mb(run['loaded_rss_bytes'])} | "
               f"{' / '.join(mb(parts[k]) for k in ('anonymous', 'weights_file', 'other_files'))} |")
        if args.verify:
            v = _child(_VERIFY, str(art.resolve()))
            row += f" {mb(v['peak'])} | {v['peak'] / weights:.2f}x{'' if v['passed'] else ' (FAILED)'} |"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

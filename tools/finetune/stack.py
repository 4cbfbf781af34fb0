"""``python -m tools.finetune.stack --adapters A B ... --out DIR``: LoRA adapters trained one after the
other (each on the model the ones before it merged into), stacked into one adapter whose merge is
exactly their merges' sum: the A matrices one above the other, the B matrices side by side, each B
scaled from its own adapter's lora_alpha / r to the stacked one's (rank the sum of theirs, alpha
twice that), with the first adapter's skipdecode.json (the policies it serves) carrying every
stage's training record. How smollm2-135m-e2e ships its stages (models/smollm2-135m-e2e/README.md).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from export.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError, read_config

SKIPDECODE_JSON = "skipdecode.json"
# what a skipdecode.json says of the policies a model serves (tools.finetune's run_meta)
POLICY_KEYS = ("horizon", "warmup_layers", "speedups", "decay", "exponent", "prefill", "policies",
               "speedup_policies")
from runtime import cli


def _scale(config: dict) -> float:
    r = int(config["r"])
    return float(config.get("lora_alpha", r)) / (r ** 0.5 if config.get("use_rslora") else r)


def stack(adapters: list[Path], out: Path, dtype: str = "float16") -> int:
    """Write the stacked adapter of ``adapters`` to ``out`` (via a temporary sibling); its rank."""
    import torch
    from safetensors.torch import load_file, save_file

    from runtime.artifact.swap import swap_into_place

    configs = [read_config(a) for a in adapters]
    tensors = [load_file(Path(a) / ADAPTER_WEIGHTS) for a in adapters]
    keys = [sorted(k for k in t if k.endswith(".lora_A.weight")) for t in tensors]
    if any(k != keys[0] for k in keys[1:]):
        raise AdapterError(f"{', '.join(map(str, adapters))}: the adapters adapt different modules; only "
                           f"adapters of the same modules stack")
    rank = sum(int(c["r"]) for c in configs)
    scale = 2.0  # alpha = 2 r, as tools.finetune's default
    stacked = {}
    for key in keys[0]:
        b_key = key.replace(".lora_A.", ".lora_B.")
        stacked[key] = torch.cat([t[key].float() for t in tensors], dim=0)  # (rank, in)
        stacked[b_key] = torch.cat([t[b_key].float() * (_scale(c) / scale)
                                    for t, c in zip(tensors, configs)], dim=1)  # (out, rank)
    stacked = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in stacked.items()}
    config = {**configs[0], "r": rank, "lora_alpha": scale * rank, "use_rslora": False}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(stacked, str(tmp / ADAPTER_WEIGHTS))
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    meta = stacked_training(adapters, rank, scale * rank)
    if meta is not None:
        (tmp / SKIPDECODE_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    swap_into_place(tmp, out)
    return rank


def _training(adapter: Path) -> dict | None:
    """An adapter's skipdecode.json: in its folder (a shipped model) or the run's above it
    (tools.finetune writes RUN/skipdecode.json beside RUN/adapter/)."""
    for folder in (adapter, adapter.parent):
        if (folder / SKIPDECODE_JSON).is_file():
            return json.loads((folder / SKIPDECODE_JSON).read_text())
    return None


def stacked_training(adapters: list[Path], rank: int, alpha: float) -> dict | None:
    """The stack's skipdecode.json: the policies it serves (horizon, shape, speedups, their
    policies) of the last stage that trained every speedup the first serves (a later stage under
    another shape: tools.finetune --decay/--policy), else the first's; every stage's
    ``trained_from`` in order, their training time summed and the stacked rank; None when the
    first has none."""
    metas = [_training(Path(a)) for a in adapters]
    if metas[0] is None:
        return None
    first = metas[0]
    serves = set(first.get("speedups", []))
    latest = next((m for m in reversed(metas) if m and serves <= set(m.get("speedups", []))), first)
    first = {**{k: v for k, v in first.items() if k not in POLICY_KEYS},
             **{k: v for k, v in latest.items() if k in POLICY_KEYS}}
    history, seen = [], []
    for m in metas:
        for entry in (m or {}).get("trained_from", []):
            if entry not in seen:  # a later stage's record repeats the stages it started from
                seen.append(entry)
                history.append(entry)
    seconds = sum(m.get("train_seconds", 0.0) for m in metas if m)
    return {**first, "trained_from": history, "train_seconds": round(seconds, 1),
            "lora": {**first.get("lora", {}), "rank": rank, "alpha": alpha, "adapter": "adapter"}}


def main(argv=None) -> int:
    p = cli.parser("python -m tools.finetune.stack", __doc__)
    p.add_argument("--adapters", nargs="+", required=True, metavar="DIR",
                   help="adapter folders (peft's format), in the order they were trained")
    p.add_argument("--out", required=True, help="folder of the stacked adapter")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="its tensors' type")
    args = p.parse_args(argv)

    def run() -> int:
        rank = stack([Path(a) for a in args.adapters], Path(args.out), args.dtype)
        print(f"{len(args.adapters)} adapters stacked into one of rank {rank} -> {args.out}")
        return 0

    return cli.run(run)


if __name__ == "__main__":
    sys.exit(main())

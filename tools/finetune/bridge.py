"""Linear bridges over the layers a SkipDecode step skips, fitted in closed form (issue 57).

A skipping step runs the warm-up layers, then jumps to the top ones, which then read the warm-up
layers' output where full depth would give them the state after the skipped stretch: the original
SmolLM2-135M-Instruct's prose perplexity is 106x its full depth at 1.5x (docs/quality.md). A bridge
is, for one layer ``s`` a step can jump to, the affine map of the state after the warm-up layers
that best predicts the state full depth has at layer ``s``'s input, over a text's every position:
least squares, with a ridge towards the identity (plain skipping). Din et al. 2023 ("Jump to
Conclusions: Short-Cutting Transformers with Linear Transformations") fit such maps between
layers; here they are solved from the normal equations of full-depth passes, no gradient: about a
minute on 2 CPU cores for 32,000 tokens of SmolLM2-135M. ``tools.finetune.skip.skip_forward`` applies
them (``bridges=``); ``tools.evaluate.perplexity --bridges`` and ``tools.finetune --bridges`` read the
file this writes. The runtime does not run them (yet).

    python -m tools.finetune.bridge --model smollm2-135m-instruct --text .work/pydoc-topics.txt \
        --out .work/bridges.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from runtime import cli
from runtime.errors import SkipDecodeError
from runtime.models.base import SkipModel

RIDGE = 0.1  # the ridge, relative to the mean squared norm of a state's coordinates
WIDTH = 160  # tokens per window of the fitting text (tools.evaluate.perplexity's default window)
KEY = "layer_{:02d}"  # a bridge's name in the file: the layer it jumps to


class BridgeError(SkipDecodeError):
    """A bridges file that does not fit the model, or bad settings."""


def fit(model: SkipModel, ids: torch.Tensor, warmup_layers: int = 1, ridge: float = RIDGE,
        batch_size: int = 8, progress: bool = True) -> dict[int, torch.Tensor]:
    """{s: (D + 1, D) float32}, one bridge per layer s a step can jump to (warmup_layers < s < L),
    from full-depth passes over ``ids`` (N, T): its first D rows the map, the last its offset.
    ``ridge`` >= 0 pulls the maps towards the identity (a large one gives plain skipping back)."""
    from tqdm.auto import tqdm

    if not 1 <= warmup_layers < model.num_layers - 1:
        raise BridgeError(f"warmup_layers must leave a layer to skip and one to jump to: 1 <= warmup_layers "
                         f"< {model.num_layers - 1}, got {warmup_layers}")
    if ridge < 0:
        raise BridgeError(f"ridge must be >= 0, got {ridge}")
    targets = range(warmup_layers + 1, model.num_layers)
    gram = cross = None  # X'X (D + 1, D + 1) and X'Y_s (D + 1, D) per target, float64
    batches = ids.split(batch_size)
    with torch.no_grad():
        for batch in tqdm(batches, desc="bridges", unit="batch", disable=not progress):
            states = _states(model, batch)  # the input of every layer, (B, T, D) each
            x = _with_ones(states[warmup_layers].flatten(0, 1).double())  # (n, D + 1)
            if gram is None:
                gram = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
                cross = {s: torch.zeros(x.shape[1], x.shape[1] - 1, dtype=torch.float64) for s in targets}
            gram += x.T @ x
            for s in targets:
                cross[s] += x.T @ states[s].flatten(0, 1).double()
    D = gram.shape[0] - 1
    identity = torch.eye(D + 1, D, dtype=torch.float64)  # the map of plain skipping, no offset
    weight = ridge * float(torch.diagonal(gram)[:D].mean())
    system = gram + weight * torch.eye(D + 1, dtype=torch.float64)
    return {s: torch.linalg.solve(system, cross[s] + weight * identity).float() for s in targets}


def _states(model: SkipModel, ids: torch.Tensor) -> list[torch.Tensor]:
    """Full depth over ``ids``: each layer's input state, and the last layer's output."""
    mask = torch.ones_like(ids)
    empty = model.empty_past(ids.shape[0])
    hidden = model.embed(ids, mask)  # (B, T, D)
    states = [hidden]
    for layer in model.layers:
        hidden, _, _ = layer(hidden, mask, *empty)
        states.append(hidden)
    return states


def _with_ones(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)  # (n, D + 1): the offset's column


def errors(model: SkipModel, ids: torch.Tensor, bridges: dict[int, torch.Tensor],
           warmup_layers: int = 1) -> dict[int, tuple[float, float]]:
    """{s: (plain, bridged)}: the mean squared distance over ``ids``' positions from full depth's
    state at layer s's input to the warm-up layers' output, and to its bridge's map of it."""
    from .skip import bridge

    with torch.no_grad():
        states = _states(model, ids)
        start = states[warmup_layers]
        return {s: (float((start - states[s]).pow(2).mean()), float((bridge(start, m) - states[s]).pow(2).mean()))
                for s, m in bridges.items()}


def save(bridges: dict[int, torch.Tensor], path) -> None:
    """To a safetensors file, written beside it first and renamed (a failed write loses nothing)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file({KEY.format(s): m.contiguous() for s, m in sorted(bridges.items())}, str(partial))
    partial.replace(path)


def load(path, model: SkipModel) -> dict[int, torch.Tensor]:
    """A file ``save`` wrote, checked against ``model``'s layers and width."""
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise BridgeError(f"bridges file {path} does not exist; `python -m tools.finetune.bridge` writes one")
    D, L = model.config.hidden_size, model.num_layers
    bridges = {}
    for key, m in load_file(str(path)).items():
        s = int(key.rsplit("_", 1)[1])
        if not 1 < s < L or tuple(m.shape) != (D + 1, D):
            raise BridgeError(f"{path}: {key} of shape {tuple(m.shape)} does not fit this model ({L} layers, "
                              f"hidden size {D}: a bridge per layer 2..{L - 1}, ({D + 1}, {D}) each); fit "
                              f"them on this model with `python -m tools.finetune.bridge`")
        bridges[s] = m.float()
    return bridges


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.finetune.bridge",
                                description="Fit linear bridges over the layers SkipDecode skips, in closed form.")
    p.add_argument("--model", required=True,
                   help="what `python -m export build --model` takes: alias, GGUF file, checkpoint directory")
    p.add_argument("--text", required=True, help="a .txt file, or a .csv/.jsonl (.gz) with --column "
                                                 "(not a text you will score them on)")
    p.add_argument("--column", help="the column of a .csv/.jsonl whose unique values make the text")
    p.add_argument("--windows", type=int, default=200,
                   help=f"windows of {WIDTH} tokens to fit on (default 200)")
    p.add_argument("--ridge", type=float, default=RIDGE, help=f"pull towards plain skipping (default {RIDGE})")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    from export import checkpoint
    from runtime.models import skip_model

    from .data import read_text, token_windows

    if args.windows < 1:
        raise BridgeError(f"--windows must be >= 1, got {args.windows}")
    progress = cli.progress(args.quiet)
    hf_model, tokenizer = checkpoint.load(checkpoint.resolve(args.model), dtype=torch.float32, progress=progress)
    model = skip_model(hf_model).eval()
    ids = token_windows(tokenizer, read_text(args.text, args.column), WIDTH, args.windows, "; pass a longer text",
                        BridgeError)
    bridges = fit(model, ids, 1, args.ridge, progress=progress)  # the paper's one warm-up layer, as the policies
    save(bridges, args.out)
    print(f"{args.out}: {len(bridges)} bridges (layers {min(bridges)}-{max(bridges)}) fitted on {ids.numel()} "
          f"tokens of {args.text}, ridge {args.ridge:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

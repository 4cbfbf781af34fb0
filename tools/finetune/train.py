"""The training loop: AdamW, warm-up + cosine schedule, periodic checkpoints, exact resume."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from export.build import swap_into_place
from export.checkpoint import SKIPDECODE_JSON
from runtime.models import skip_model
from runtime.models.base import SkipModel
from runtime.errors import SkipDecodeError

from . import lora
from .data import Encoded, batches, common_words, encode, read_pairs
from .skip import PolicySampler, layer_mask, set_dropout, skip_forward

STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
BEST_DIR = "best"  # the weights with the lowest validation loss so far, inside --out
ADAPTER_DIR = "adapter"  # a LoRA run's adapters in peft's format, inside --out (export/adapter.py merges them)


class TrainError(SkipDecodeError):
    """A fine-tuning run cannot start or resume as asked."""


@dataclass
class TrainConfig:
    model: str  # what to start from: a checkpoint directory, a GGUF file or an alias (export's --model)
    train: str  # CSV / JSONL of (prompt, target) pairs
    out: str  # where the fine-tuned checkpoint goes (and checkpoint-N/ folders while training)
    val: str | None = None  # held-out pairs: loss per policy after each epoch
    prompt_column: str = "prompt"
    target_column: str = "target"
    separator: str = " "  # put between prompt and target; the runtime sees the prompt alone
    speedups: tuple[float, ...] = (1.0,)  # policies sampled per row; (1.0,) = plain fine-tuning
    horizon: int | None = None  # decay span in decode steps; None: the model's skipdecode.json, else 64
    warmup_layers: int = 1  # bottom layers every step runs (the paper: 1)
    decay: str = "linear"  # budget curve of the policies: "linear" (the paper) or "power"
    exponent: float = 2.0  # of the "power" decay (SkipPolicy.exponent)
    policies: tuple[tuple[float, int, int], ...] = ()  # (speedup, max, min): --policy S=MAX:MIN
    prefill: str = "full"  # the prompt's layers under a policy: "full" or "policy" (step 0's set)
    epochs: int = 10
    max_steps: int | None = None  # optimizer steps to run, overriding epochs (transformers' max_steps);
    # the learning-rate schedule spans them, so a run sized to a time budget still decays
    batch_size: int = 32
    max_train: int | None = None  # a seeded random subset of this many training pairs (None: all)
    faithful_only: bool = False  # E2E: train only on the pairs whose target has no slot error against
    # its MR (tools.evaluate.slots): 28% of the references drop or invent a slot, and teach it
    lora_rank: int = 0  # 0: full fine-tuning; R > 0: LoRA adapters of rank R on every decoder linear layer
    lora_alpha: float | None = None  # LoRA's scale numerator (scale = alpha / rank); None: 2 * rank
    skipping_only: bool = False  # LoRA: the adapters act only on tokens that skip layers (the prompt's
    # pass and full depth stay the starting model): adapters for export build --draft-adapter
    copy_weight: float = 1.0  # the loss weight of the target tokens that copy the prompt (data.copied_tokens:
    # a name, a number) against 1 for the others: what a skipping policy gets most wrong on new names
    deep_copies: int | None = None  # the model's deep copies (runtime.decoding.copying): a deep step's
    # layers, recorded in skipdecode.json with the training targets' common words; None: the base's
    bridges: str | None = None  # a tools.finetune.bridge file: tokens that jump over layers go through its
    # linear bridges in training (fixed, not trained), as they must where the result is scored or run
    distill: float = 0.0  # LoRA: the loss's share of KL(the starting model at full depth || the row's
    # policy) over the target tokens; the rest is cross-entropy on the targets (0: it alone, 1: no targets)
    lr: float = 5e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * this
    warmup_ratio: float = 0.05  # fraction of steps with linear lr warm-up
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"  # auto = cuda when available, else cpu
    threads: int | None = None  # torch CPU threads (None: torch's default)
    checkpoint_every: int = 200  # optimizer steps between checkpoints (and at each epoch's end)
    val_every: int | None = None  # optimizer steps between validations (None: at each epoch's end)
    select_best: bool = True  # with val: ship the weights of the lowest mean validation loss
    keep_checkpoints: int = 2  # older checkpoint-N folders are deleted
    resume: str | None = None  # "auto" (latest checkpoint in out) or a checkpoint-N directory
    progress: bool = True
    extra: dict = field(default_factory=dict)  # recorded in skipdecode.json as is


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TrainError(f"--device {name}: this torch has no CUDA device; use --device cpu")
    return torch.device(name)


def _load(spec: str):
    """(model, tokenizer, skipdecode.json's fields) of anything `export build --model` takes: a
    checkpoint directory (a run's checkpoint-N too), a GGUF file, an alias (smollm2-135m-instruct),
    a hub id; of a supported family (runtime.models), checked before the weights load."""
    from export import checkpoint

    source = checkpoint.resolve(spec)
    if source.kind == "random":
        raise TrainError(f"--model {spec} is a randomly initialised model; pass a checkpoint to fine-tune")
    model, tokenizer = checkpoint.load(source, dtype=torch.float32)  # a truncated file: a typed error naming it
    return model, tokenizer, checkpoint.skipdecode_training(source)


def _save_atomic(target: Path, write_weights, tokenizer, meta: dict | None, state: dict | None) -> None:
    """Write a checkpoint at ``target`` via a temporary sibling and a rename; ``write_weights(dir)``
    writes the weights (the whole model, or a LoRA run's adapters)."""
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_weights(tmp)
    tokenizer.save_pretrained(tmp)
    if meta is not None:
        (tmp / SKIPDECODE_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    if state is not None:
        torch.save(state, tmp / STATE_FILE)
    swap_into_place(tmp, target)  # atomic where the filesystem can exchange directories


def _checkpoints(out: Path) -> list[Path]:
    found = [p for p in out.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()
             and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def _schedule(cfg: TrainConfig, total_steps: int):
    warm = max(1, int(cfg.warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = min((step - warm) / max(total_steps - warm, 1), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return factor


def faithful_pairs(pairs: list, source: str) -> list:
    """The pairs whose target realises every slot of its E2E MR and asserts no other's, in order."""
    from tools.evaluate.slots import is_mr_list, slot_errors

    if not is_mr_list([ex.prompt for ex in pairs]):
        raise TrainError(f"--faithful-only judges targets against E2E meaning representations, but the "
                         f"prompts of {source} are not all of the form 'slot[value], ...'; drop --faithful-only")
    return [ex for ex in pairs if not slot_errors(ex.prompt, ex.target).errors]


def masked_loss(model: SkipModel, batch, policies, teacher: torch.Tensor | None = None,
                distill: float = 0.0, skipping_only: nn.Module | None = None,
                bridges: dict | None = None) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the target tokens of ``batch``, each row under its policy; with
    ``teacher`` (the target tokens' logits, ``teacher_logits``), ``distill`` of it is the KL from
    the teacher's distributions instead. ``skipping_only``: the model holding the LoRA adapters,
    which then act only where a token skips layers (``skipping_gate``). ``bridges``: the linear
    bridges of tools.finetune.bridge where a token jumps over skipped layers."""
    mask = layer_mask(policies, batch.prompt_lens, batch.input_ids.shape[1]).to(batch.input_ids.device)
    gate = None if skipping_only is None else skipping_gate(policies, batch.prompt_lens, batch.input_ids.shape[1])
    with lora.gated(skipping_only, None if gate is None else gate.to(batch.input_ids.device)):
        logits = skip_forward(model, batch.input_ids, batch.attention_mask, mask, bridges)  # (B, T, V)
    targets = batch.labels != -100  # (B, T)
    n = int(targets.sum())
    # (n,) each target token's share of the loss: equal, or as batch.weights (--copy-weight) weighs them
    share = (torch.full((n,), 1.0 / n, device=logits.device) if batch.weights is None
             else batch.weights[targets] / batch.weights[targets].sum())
    ce = F.cross_entropy(logits[targets].float(), batch.labels[targets], reduction="none")  # (n,)
    loss = (ce * share).sum()
    if teacher is not None and distill:
        student = F.log_softmax(logits[targets].float(), dim=-1)  # (n, V)
        kl = F.kl_div(student, F.log_softmax(teacher.float(), dim=-1), log_target=True, reduction="none").sum(-1)
        loss = (1 - distill) * loss + distill * (kl * share).sum()
    return loss, n


def skipping_gate(policies, prompt_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B, T) float: 1 at the positions that decode under a skipping policy (the generated tokens of
    a row whose policy is not full depth), 0 elsewhere: the prompt's pass and every full-depth step
    stay the starting model's, as the original layers run them when export build writes the adapted
    layers as a lossless row's drafts alone (--draft-adapter)."""
    positions = torch.arange(seq_len)[None, :]  # (1, T)
    skipping = torch.tensor([not p.is_full_depth for p in policies])[:, None]  # (B, 1)
    return ((positions >= prompt_lens.cpu()[:, None]) & skipping).float()


@torch.no_grad()
def teacher_logits(model: torch.nn.Module, skip: SkipModel, batch) -> torch.Tensor:
    """(n, V): the target tokens' logits of the model the run started from, at full depth: its
    adapters off, no dropout. Distilling towards them teaches the skipping policies what full
    depth predicts, while full depth itself keeps close to the model it was."""
    was_training = skip.training
    skip.eval()
    try:
        with lora.disabled(model):
            B, T = batch.input_ids.shape
            full = torch.ones((B, T, skip.num_layers), dtype=torch.bool, device=batch.input_ids.device)
            logits = skip_forward(skip, batch.input_ids, batch.attention_mask, full)  # (B, T, V)
    finally:
        skip.train(was_training)
    return logits[batch.labels != -100]


@torch.no_grad()
def evaluate_loss(model: SkipModel, items: list[Encoded], sampler: PolicySampler, pad_id: int,
                  batch_size: int, device, skipping_only: nn.Module | None = None,
                  bridges: dict | None = None) -> dict[str, float]:
    """Validation loss per policy of the sampler: {"2x": loss, ...}."""
    was_training = model.training
    model.eval()
    result = {}
    for speedup, policy in zip(sampler.speedups, sampler.policies()):
        total, count = 0.0, 0
        for batch in batches(items, batch_size, pad_id, shuffle=False, rng=random.Random(0)):
            batch = batch.to(device)
            loss, n = masked_loss(model, batch, [policy] * batch.input_ids.shape[0], skipping_only=skipping_only,
                                  bridges=bridges)
            total += float(loss) * n
            count += n
        result[f"{speedup:g}x"] = total / max(count, 1)
    model.train(was_training)
    return result


def selection_score(val_loss: dict[str, float]) -> float:
    """What best-checkpoint selection minimises: the mean validation loss over the policies
    trained (one model serves them all, so no policy's loss counts more than another's)."""
    return sum(val_loss.values()) / len(val_loss)


def _load_weights(model, directory: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(directory / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # tied input/output embeddings are stored once; anything else missing is a broken folder
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise TrainError(f"{directory}: weights do not match the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    model.tie_weights()


def train(cfg: TrainConfig) -> Path:
    """Run the fine-tuning described by ``cfg``; returns the output directory."""
    from tqdm.auto import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = _device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    start_dir = cfg.model
    state = None
    if cfg.resume:
        found = _checkpoints(out) if cfg.resume == "auto" else [Path(cfg.resume)]
        if not found or not (found[-1] / STATE_FILE).is_file():
            raise TrainError(f"nothing to resume: no checkpoint-N folder with {STATE_FILE} in "
                             f"{out if cfg.resume == 'auto' else cfg.resume}")
        start_dir = str(found[-1])
        state = torch.load(found[-1] / STATE_FILE, weights_only=False)
    if cfg.lora_rank < 0:
        raise TrainError(f"--lora-rank {cfg.lora_rank}: a rank is a positive number of dimensions (0: full fine-tuning)")
    if not 0.0 <= cfg.distill <= 1.0:
        raise TrainError(f"--distill {cfg.distill:g}: the KL term's share of the loss lies in [0, 1]")
    if cfg.skipping_only and not cfg.lora_rank:
        raise TrainError("--skipping-only needs --lora-rank: it gates adapters, which full fine-tuning has none "
                         "of; add --lora-rank 16")
    if cfg.skipping_only and all(s == 1 for s in cfg.speedups):
        raise TrainError("--skipping-only trains the adapters on the tokens that skip layers, and --speedups "
                         "has no policy that skips; add one (--speedups 1.5 2)")
    if cfg.copy_weight <= 0:
        raise TrainError(f"--copy-weight {cfg.copy_weight:g}: a loss weight is positive (1: copied tokens weigh "
                         f"as the others)")
    if cfg.distill and not cfg.lora_rank:
        raise TrainError("--distill needs --lora-rank: the teacher is the starting model, which the run "
                         "reads with its adapters off (full fine-tuning keeps no copy of it); add --lora-rank 16")
    lora_alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank
    # a LoRA checkpoint holds the adapters alone: its weights are the base model's plus them
    model, tokenizer, meta = _load(cfg.model if cfg.lora_rank else start_dir)
    if cfg.lora_rank:
        lora.inject(model, cfg.lora_rank, lora_alpha)
        if state:
            lora.load(model, Path(start_dir))
    base_meta = state["base_meta"] if state else meta
    horizon = cfg.horizon or base_meta.get("horizon") or 64
    L = model.config.num_hidden_layers
    sampler = PolicySampler(L, tuple(cfg.speedups), horizon, cfg.warmup_layers, cfg.decay,
                            cfg.exponent, cfg.prefill, tuple(cfg.policies))
    sampler.policies()  # validate the speedups now, not after the first epoch
    missing = [s for s, _, _ in cfg.policies if s not in cfg.speedups]
    if missing:
        raise TrainError(f"--policy names speedup {missing[0]:g}, which --speedups does not train; add it there")
    # the policies the model serves for --speedup S: this run's own, or the base's where the shape is its
    same_shape = all(base_meta.get(k) == v for k, v in (("decay", cfg.decay), ("exponent", cfg.exponent)))
    own = (sampler.speedup_policies() if cfg.policies else
           base_meta.get("speedup_policies") if same_shape else None)

    limit = model.config.max_position_embeddings
    pairs = read_pairs(cfg.train, cfg.prompt_column, cfg.target_column)
    if cfg.faithful_only:
        pairs = faithful_pairs(pairs, cfg.train)
    if cfg.max_train is not None and cfg.max_train < len(pairs):
        pairs = random.Random(cfg.seed).sample(pairs, cfg.max_train)  # the same subset on resume
    common = common_words([ex.target for ex in pairs]) if cfg.copy_weight != 1.0 or cfg.deep_copies else frozenset()
    if cfg.deep_copies is not None and not 1 <= cfg.deep_copies <= L:
        raise TrainError(f"--deep-copies {cfg.deep_copies}: a deep step's layers lie in [1, {L}] (the model's layers)")
    copies = ({"deep_copies": {"layers": cfg.deep_copies, "common_words": sorted(common)}}
              if cfg.deep_copies else {})
    train_items = [encode(tokenizer, ex, cfg.separator, limit, cfg.copy_weight, common) for ex in pairs]
    val_items = ([encode(tokenizer, ex, cfg.separator, limit)
                  for ex in read_pairs(cfg.val, cfg.prompt_column, cfg.target_column)]
                 if cfg.val else [])
    model.to(device).train()
    skip = skip_model(model).train()  # shares the parameters of ``model``
    bridges = None
    if cfg.bridges:
        from . import bridge

        bridges = {s: m.to(device) for s, m in bridge.load(cfg.bridges, skip).items()}
    set_dropout(skip, float(getattr(model.config, "dropout", 0.0) or 0.0))  # Llama's config has none
    # a GGUF tokenizer may name no pad token (transformers 5.17); padded positions carry no loss
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    steps_per_epoch = math.ceil(len(train_items) / cfg.batch_size)
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise TrainError(f"--max-steps {cfg.max_steps}: give a positive number of optimizer steps")
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    decay, no_decay = [], []
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg, total_steps))
    step = 0
    best = None  # {"step", "val_loss", "score"} of the weights in out/best
    if state:
        # the run goes on as it was (transformers' Trainer resumes so too): its optimizer, and its
        # schedule's peak rate, stretched over the new total where --max-steps changed
        resumed_lr = state.get("config", {}).get("lr", cfg.lr)
        if resumed_lr != cfg.lr:
            warnings.warn(f"--lr {cfg.lr:g} is not used: a resumed run keeps its own learning rate "
                          f"({resumed_lr:g}) and schedule; start a new run (without --resume) for "
                          f"another rate", stacklevel=2)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
        best = state.get("best")
    val_every = cfg.val_every or steps_per_epoch

    def run_meta(val_loss=None) -> dict:
        meta = {k: v for k, v in base_meta.items() if k != "speedup_policies"}
        return {**meta, **({"speedup_policies": own} if own else {}), "format": "skipdecode-finetune", "horizon": horizon,
                "warmup_layers": cfg.warmup_layers, "speedups": list(cfg.speedups),
                # the policy shape the runtime must use for this model (export puts it in the manifest)
                "decay": cfg.decay, "exponent": cfg.exponent, "prefill": cfg.prefill,
                "policies": [p.to_dict() for p in sampler.policies()], "separator": cfg.separator,
                "trained_from": base_meta.get("trained_from", []) + [{
                    "model": cfg.model, "train": cfg.train, "epochs": cfg.epochs,
                    "speedups": list(cfg.speedups), "steps": step, "val_loss": val_loss,
                    "max_steps": cfg.max_steps, "max_train": cfg.max_train, "faithful_only": cfg.faithful_only,
                    "lora_rank": cfg.lora_rank, **({"distill": cfg.distill} if cfg.distill else {}),
                    **({"copy_weight": cfg.copy_weight} if cfg.copy_weight != 1.0 else {}),
                    **({"skipping_only": True} if cfg.skipping_only else {}),
                    **({"bridges": cfg.bridges} if cfg.bridges else {})}],
                **copies, **cfg.extra}

    # the adapters' base as export resolves it from anywhere: an alias or hub id as given, a path absolute
    base_spec = str(Path(cfg.model).expanduser().resolve()) if Path(cfg.model).expanduser().exists() else cfg.model

    def write_weights(directory: Path) -> None:
        if cfg.lora_rank:
            lora.save(model, directory, cfg.lora_rank, lora_alpha, base_spec)
        else:
            model.save_pretrained(directory)

    def checkpoint(val_loss=None) -> None:
        target = out / f"checkpoint-{step}"
        # with skipdecode.json: a checkpoint exports as it is (export build --model DIR/checkpoint-N)
        _save_atomic(target, write_weights, tokenizer, run_meta(val_loss), {
            "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "base_meta": base_meta, "config": asdict(cfg), "val_loss": val_loss, "best": best,
            "seconds": before + time.perf_counter() - started})
        for old in _checkpoints(out)[:-cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    log = (out / LOG_FILE).open("a")
    bar = tqdm(total=total_steps, initial=step, desc="fine-tune", unit="step", disable=not cfg.progress)
    val_loss = None
    started = time.perf_counter()
    before = state.get("seconds", 0.0) if state else 0.0  # the training time of the runs it resumes
    while step < total_steps:
        epoch, skip_batches = divmod(step, steps_per_epoch)
        # Batch order and policy draws depend only on (seed, epoch, step): a resumed run replays
        # exactly the batches the interrupted one would have seen.
        epoch_batches = batches(train_items, cfg.batch_size, pad_id, shuffle=True,
                                rng=random.Random(cfg.seed * 100003 + epoch))
        for i, batch in enumerate(epoch_batches):
            if i < skip_batches:
                continue
            if step == total_steps:  # --max-steps ends inside an epoch
                break
            rng = random.Random(cfg.seed * 1000003 + step)
            torch.manual_seed(cfg.seed * 1000003 + step)  # dropout
            batch = batch.to(device)
            teacher = teacher_logits(model, skip, batch) if cfg.distill else None
            loss, _ = masked_loss(skip, batch, sampler.sample(batch.input_ids.shape[0], rng), teacher, cfg.distill,
                                  model if cfg.skipping_only else None, bridges)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            value = loss.item()
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{value:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            log.write(json.dumps({"step": step, "epoch": epoch + 1, "loss": round(value, 5),
                                  "lr": scheduler.get_last_lr()[0]}) + "\n")
            if val_items and (step % val_every == 0 or step == total_steps):
                val_loss = evaluate_loss(skip, val_items, sampler, pad_id, cfg.batch_size, device,
                                         model if cfg.skipping_only else None, bridges)
                score = selection_score(val_loss)
                improved = best is None or score < best["score"]
                if improved and cfg.select_best:
                    best = {"step": step, "val_loss": val_loss, "score": score}
                    _save_atomic(out / BEST_DIR, write_weights, tokenizer, None, None)
                log.write(json.dumps({"step": step, "epoch": epoch + 1, "val_loss": val_loss,
                                      "best_step": best["step"] if best else None}) + "\n")
                bar.write(f"step {step} (epoch {epoch + 1}): val loss " +
                          ", ".join(f"{k} {v:.3f}" for k, v in val_loss.items()) +
                          f"; mean {score:.4f}" + (" (best)" if improved else ""))
            if step % cfg.checkpoint_every == 0 or step % steps_per_epoch == 0:
                checkpoint(val_loss)
            log.flush()
    bar.close()
    log.close()
    model.eval()
    if best is not None and cfg.select_best:
        if cfg.lora_rank:
            lora.load(model, out / BEST_DIR)
        else:
            _load_weights(model, out / BEST_DIR)
        val_loss = best["val_loss"]
    meta_out = run_meta(val_loss)
    meta_out["trained_from"][-1]["selected_step"] = best["step"] if best else step
    meta_out["train_seconds"] = round(before + time.perf_counter() - started, 1)  # resumed runs' too
    if cfg.lora_rank:
        # the adapters alone (a few MB: what ships), then the merged model beside them
        meta_out["lora"] = {"rank": cfg.lora_rank, "alpha": lora_alpha, "adapter": ADAPTER_DIR}
        _save_atomic(out / ADAPTER_DIR, write_weights, tokenizer, meta_out, None)
        lora.merge(model)
    _save_final(out, model, tokenizer, meta_out)
    return out


def _save_final(out: Path, model, tokenizer, meta: dict) -> None:
    """The finished model's files go into ``out`` itself (next to checkpoint-N/), config.json
    last, so ``out`` becomes a loadable checkpoint only once every weight is in place."""
    tmp = out / f".final.tmp-{os.getpid()}"
    _save_atomic(tmp, model.to("cpu").save_pretrained, tokenizer, meta, None)
    names = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in names if n != "config.json"] + ["config.json"]:
        os.replace(tmp / name, out / name)
    tmp.rmdir()

"""``python -m export build``: checkpoint -> artifact directory (graphs, tokenizer, manifest).

The artifact is assembled in a temporary sibling directory and swapped into place only once every
graph is exported, hashed and checked, and the manifest (written last) is in; the swap is atomic
where the filesystem can exchange two directories, and recoverable where it cannot (runtime.artifact.swap).
A build killed at any step leaves ``--out`` as the old or the new artifact (restored by the next
build or load if the kill fell between two renames), and the next build deletes the
``.NAME.tmp-PID`` / ``.NAME.old-PID`` leftovers of builds whose process is gone.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from runtime.artifact.integrity import record_hashes
from runtime.artifact.manifest import (DRAFT_HEAD, DRAFT_LAYERS, KV_LAYOUT, MANIFEST_NAME, Manifest, ModelInfo,
                                       file_entry)
from runtime.artifact.swap import recover, remove_leftovers, swap_into_place, temp_sibling
from runtime.errors import ArtifactError, InvalidArgumentError
from runtime.decoding.copying import DeepCopies
from runtime.policy import SkipPolicy, speedup_policies

from . import checkpoint, fused as fused_layers, gguf, parity
from runtime.models import family_of, head_dim, kv_heads, skip_model
from .onnx_export import (ExportConfig, draft_head_spec, draft_layer_spec, embed_table_entry, export_graph,
                          graph_specs)
from .gguf_blocks import GGML_BLOCK, BlockIndex
from .quantize import BLOCK_SIZE, QuantConfig, tensorrt_readers
from .weights import SharedWeights

TOKENIZER_DIR = "tokenizer"


@dataclass
class BuildOptions:
    model: str = checkpoint.DEMO_MODEL  # alias, hub id or directory; the default demo runs offline
    out: str = f"artifacts/{checkpoint.DEMO_MODEL}"  # the artifact directory to create or replace
    dtype: str = "float32"  # "float32" or "float16"
    opset: int = 17  # 16 avoids LayerNormalization, which TensorRT 8.5 (JetPack 5) cannot parse
    random_weights: bool = False  # build --model's architecture with random weights (no download)
    seed: int = 0  # seed of random weights, so a random artifact can be rebuilt and verified
    external_data: str = "shared"  # "shared": all weights in one weights.bin; "never": in each graph
    page_size: int = 32  # KV positions per page: the bound past grows in steps of it (see export.onnx_export)
    check: bool = True  # compare every graph with PyTorch after export
    policy: dict | None = None  # {max_layers, min_layers, warmup_layers} or {speedup}; None = full depth
    progress: bool = True  # progress bars on stderr
    weights: str = "auto"  # layers' weights: float (the dtype's), int8, int4 (export.quantize) or auto (auto_weights:
    # a quantized GGUF's own precision, else float)
    head_weights: str | None = None  # the head's; None: as ``weights`` (int4 head + float layers works)
    block_size: int = BLOCK_SIZE  # weights per quantization scale (export.quantize.QuantConfig)
    weights_format: str = "matmulnbits"  # or "qdq" (int4, the form TensorRT 10+ parses)
    accuracy_level: int = 0  # MatMulNBits' activations: 1 = float32 (exact products, batch-invariant greedy
    # output), 4 = int8 (prompts faster); 0: export.quantize.DEFAULT_ACCURACY_LEVEL (1)
    requantize: bool = False  # a quantized GGUF: quantize its dequantized weights again instead of carrying
    # its own blocks (export.gguf_blocks): no minimums' term on ONNX Runtime's MatMulNBits, further from the file
    fused: bool = True  # also write the layers' fused-operator variant for ONNX Runtime (export.fused)
    # lossless rows' drafts: "int8"/"int4" also writes a quantized copy of the float head / of the fused
    # layers, which draft steps run on ONNX Runtime's CPU provider; "auto": int8 where they can run
    # (``auto_drafts``), "none": no copies
    draft_head: str = "auto"
    draft_layers: str = "auto"
    # a LoRA adapter over the same base whose merged layers the draft copies hold instead of the
    # model's own (tools.finetune --skipping-only trains one): drafts skip with weights tuned for
    # it while every kept token comes from the model's own float layers
    draft_adapter: str | None = None


def _token_id(value, fallback=None) -> int:
    """A config's token id: Llama 3's eos_token_id may be a list (its first is the one the manifest
    names; eos_token_ids keeps them all), and Llama and Qwen checkpoints name no pad token (the EOS
    pads, as transformers' generate does)."""
    value = value[0] if isinstance(value, (list, tuple)) else value
    return int(value if value is not None else fallback)


def _id_list(value) -> list[int]:
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]


def model_info(config, generation_config=None) -> ModelInfo:
    """The manifest's model entry. ``generation_config``'s EOS ids join the config's, as they end a
    row in transformers' generate (Llama 3 Instruct ends a chat turn on <|eot_id|>, which only
    its generation config may name)."""
    eos = _token_id(config.eos_token_id)
    every = list(dict.fromkeys(_id_list(config.eos_token_id)
                               + _id_list(getattr(generation_config, "eos_token_id", None))))
    return ModelInfo(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads, head_dim=head_dim(config), vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        pre_layer_norm=bool(getattr(config, "do_layer_norm_before", True)),
        bos_token_id=_token_id(config.bos_token_id, eos), eos_token_id=eos,
        pad_token_id=_token_id(config.pad_token_id, eos),
        architecture=family_of(config).name, num_kv_heads=kv_heads(config),
        eos_token_ids=every if len(every) > 1 else None)


def default_policy(num_layers: int, fields: dict | None, trained: dict | None = None) -> dict:
    """Validated default policy for the manifest.

    ``trained`` is the checkpoint's skipdecode.json: a model fine-tuned under SkipDecode keeps the
    horizon and warm-up layers it was trained with, so every policy the runtime picks for it decays
    as in training. Otherwise the horizon is None, meaning "the call's max_new_tokens - 1".
    """
    trained = trained or {}
    warmup = trained.get("warmup_layers", 1)
    fields = dict(fields or {"max_layers": num_layers, "min_layers": num_layers, "warmup_layers": warmup})
    if fields.get("warmup_layers") is None:
        fields["warmup_layers"] = warmup
    fields.setdefault("horizon", trained.get("horizon"))
    # the policy shape a model was trained under (tools.finetune) is the one it must run
    shape = {k: trained[k] for k in ("decay", "exponent", "prefill") if k in trained}
    # a speedup over the trained horizon, else 128 steps (the paper's lengths)
    policy = SkipPolicy.from_fields(num_layers, {**fields, **shape})
    # the shape only where it is not the paper's, so the manifests of linear models stay as they were
    extra = {k: v for k, v in policy.to_dict().items() if k in ("decay", "exponent", "prefill")}
    out = {"max_layers": policy.max_layers, "min_layers": policy.min_layers,
           "warmup_layers": policy.warmup_layers, "horizon": fields.get("horizon"), **extra}
    if trained.get("speedup_policies") and fields.get("horizon") == trained.get("horizon"):
        # the model's own policy per speedup target, checked as the runtime checks it
        out["speedup_policies"] = speedup_policies(policy, trained["speedup_policies"])
    if trained.get("deep_copies"):  # its rows copying a rare prompt string run deeper (runtime.decoding.copying)
        copies = DeepCopies.from_manifest(trained["deep_copies"], num_layers)
        out["deep_copies"] = {"layers": copies.layers, "common_words": sorted(copies.common)}
    return out


def _prepare_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"--out {out} is a file; pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise ArtifactError(
            f"--out {out} exists, is not empty and is not an artifact directory (no "
            f"{MANIFEST_NAME}); refusing to replace it. Pass a new directory or remove it")


def draft_refusals(config: ExportConfig, model_config, width: int) -> dict[str, str]:
    """Why this export cannot write each draft copy ({"draft_head": ..., "draft_layers": ...}; one
    it can write is absent), in the words that refuse ``--draft-head``/``--draft-layers``."""
    quant, refusals = config.quant, {}
    if width % quant.block_size:
        refusals["draft_head"] = (f"--draft-head: block_size {quant.block_size} does not divide the head's input "
                                  f"width {width}; pass --block-size with a power of two that divides it")
    why_not = config.fused_reason(model_config)
    if why_not:
        refusals["draft_layers"] = (f"--draft-layers quantizes the fused layer graphs, and this export writes "
                                    f"none ({why_not}); drop --draft-layers")
    else:
        c = model_config
        try:  # the layers' products, as --weights checks them
            quant.check_sizes(c.hidden_size, c.intermediate_size, None, attention=c.num_attention_heads * head_dim(c))
        except InvalidArgumentError as exc:
            refusals["draft_layers"] = f"--draft-layers: {exc}"
    return refusals


def auto_drafts(config: ExportConfig, refusals: dict[str, str]) -> str:
    """What ``draft_head``/``draft_layers`` "auto" writes: "int8" where lossless drafts can run the
    copies, float32 layers and head whose fused graphs this export writes (ONNX Runtime's CPU
    provider runs them: docs/benchmarks.md, "Draft layers": 2.09x against 1.67x without on the
    fine-tuned SmolLM2), else "none" (quantized weights draft with themselves; float16 and the
    models without fused graphs run their drafts through the float graphs)."""
    quant = config.quant
    if config.dtype != "float32" or quant.weights != "float" or quant.for_graph("head") != "float" or refusals:
        return "none"
    return "int8"


def from_gguf(blocks: BlockIndex) -> dict:
    """The manifest's record of a quantized GGUF's products: how many carried, of which GGML types
    ("Q4_K+Q6_K": a product of runs of both), and the weights requantized."""
    return {"carried": len(blocks.carried), "types": dict(sorted(blocks.types.items())),
            "requantized": sorted(blocks.requantized)}


def activations(accuracy_level: int) -> str:
    """What the build log says of the products' activations (export.quantize.DEFAULT_ACCURACY_LEVEL)."""
    if accuracy_level == 4:
        return "int8 activations: greedy text can change with the batch"
    return "float activations: greedy text the same in any batch (--accuracy-level 4: int8 ones, prompts faster)"


def carried_line(blocks: BlockIndex, gguf_entry: dict) -> str:
    """What the export made of a quantized GGUF's blocks: the products carried as they are, and
    those requantized (a head of another bit width than asked, another
    --block-size)."""
    line = (f"{gguf_entry['file']}: {len(blocks.carried)} products carried from its own blocks exactly, "
            f"{len(blocks.requantized)} requantized; the embedding "
            f"{'gathered from its 8-bit blocks' if blocks.embedding else 'float (the file holds it in no 8-bit type)'}")
    if blocks.requantized:
        shown = ", ".join(blocks.requantized[:3]) + (" ..." if len(blocks.requantized) > 3 else "")
        line += (f" ({shown}: the file holds them at another bit width or in types of different widths, a "
                 f"merged adapter changed them, --block-size is not the file's {GGML_BLOCK}, or --quant-format "
                 f"is qdq)")
    return line


def auto_weights(options: BuildOptions) -> tuple[str, str]:
    """What ``--weights auto`` means for this model: (weights, why). A quantized GGUF's own precision
    (Q4_* layers int4, Q5_*/Q6_*/Q8_0 int8: export.gguf_blocks carries them as they are), else float
    (a float file, a checkpoint directory, or an adapter, whose merge moves the file's values)."""
    source = checkpoint.resolve(options.model, random_weights=options.random_weights)
    if source.kind == "adapter":
        return "float", "a merged adapter moves the file's values off its blocks"
    if source.kind != "gguf":
        return "float", f"{source.describe()} holds no quantized blocks"
    quantization = gguf.inspect(source.location).quantization
    weights = "int4" if quantization.startswith("Q4") else "int8" if quantization.startswith(("Q5", "Q6", "Q8")) else "float"
    return weights, f"the file's {quantization} layers"


def build(options: BuildOptions, log=print) -> Manifest:
    """Export ``options.model`` into ``options.out``; returns the manifest written. ``log`` takes
    each line of what the build does (the parity table included); result_line says what it made."""
    out = Path(options.out)
    recover(out, MANIFEST_NAME)  # a build killed mid-swap: put its artifact back first
    remove_leftovers(out)
    _prepare_out(out)
    own_widths = options.weights == "auto"  # a quantized GGUF's products at its own widths, each (gguf_blocks)
    if own_widths:
        weights, why = auto_weights(options)
        log(f"--weights auto: {weights} ({why})")
        options = replace(options, weights=weights)
    quant = QuantConfig(weights=options.weights, head_weights=options.head_weights,
                        block_size=options.block_size, format=options.weights_format,
                        accuracy_level=options.accuracy_level)
    config = ExportConfig(dtype=options.dtype, opset=options.opset, external_data=options.external_data,
                          page_size=options.page_size, quant=quant, fused=options.fused,
                          **{k: ("none" if v == "auto" else v) for k, v in
                             (("draft_head", options.draft_head), ("draft_layers", options.draft_layers))})
    if quant.quantized:  # before any work: whether the TensorRT meant to run it can read it
        log(tensorrt_readers(quant, str(out)))
    source = checkpoint.resolve(options.model, random_weights=options.random_weights)
    if source.kind == "random":
        log(f"NOTE: --model {options.model} builds a {source.describe()}, seed {options.seed}. "
            f"Its weights are random, so its text is gibberish; pass --model DIR (a Hugging Face "
            f"checkpoint) for a real model.")
    log(f"loading {source.describe()} as {options.dtype}")
    hf_model, tokenizer = checkpoint.load(source, dtype=config.torch_dtype, seed=options.seed,
                                          progress=options.progress)
    base = checkpoint.adapter_base(source) if source.kind == "adapter" else source  # an adapter's: what it merged into
    gguf_entry = gguf.source_entry(base.location) if base.kind == "gguf" else {}
    if base is not source:
        log(f"merged the LoRA adapter {source.location} into {base.describe()}")
    if gguf_entry:
        log(f"dequantized {gguf_entry['file']} ({gguf_entry['quantization']}) to {options.dtype}")
    model = skip_model(hf_model)
    carry = gguf_entry and options.dtype == "float32" and not options.requantize
    index = BlockIndex.from_gguf(base.location) if carry and quant.quantized else None
    if index:  # the file has blocks of a type carried (gguf_blocks.TYPES)
        index.own_widths = own_widths
        config = replace(config, blocks=index)
        if options.head_weights is None and quant.head_weights == "int4" and index.head_bits == 8:
            # never below the file: its Q8_0 head carried (next-token top-1 agreement with the float
            # export 0.88 against 0.70 requantized to int4 on SmolLM2-135M-Instruct, docs/quality.md)
            quant = replace(quant, head_weights="int8")
            config = replace(config, quant=quant)
            log(f"head: int8, the file's own {index.head_type} blocks (--head-weights int4 requantizes it smaller)")
    if quant.quantized:
        c = hf_model.config
        quant.check_sizes(c.hidden_size, getattr(c, "ffn_dim", None) or c.intermediate_size,
                          getattr(c, "word_embed_proj_dim", c.hidden_size),
                          attention=c.num_attention_heads * head_dim(c))
        embedding = "the embedding in the file's 8-bit blocks where it has them" if index else "float embedding"
        acts = f"; {activations(quant.accuracy_level)}" if quant.format == "matmulnbits" else ""
        log(f"weights: {options.weights} layers, {quant.head_weights} head, {embedding} "
            f"(block {quant.block_size}, {quant.format}){acts}")
    width = getattr(hf_model.config, "word_embed_proj_dim", hf_model.config.hidden_size)  # the head's K
    refusals = draft_refusals(config, hf_model.config, width)
    if "auto" in (options.draft_head, options.draft_layers):
        auto = auto_drafts(config, refusals)
        chosen = {"draft_head": auto, "draft_layers": auto}
        four_bit = str(gguf_entry.get("quantization", "")).startswith("Q4")
        if auto != "none" and carry and four_bit and base is source and options.draft_adapter is None:
            # the file's own 4-bit blocks: drafts that give the float layers' tokens (docs/benchmarks.md,
            # "Drafts from the file's own blocks": lossless 2.2x-2.6x whole requests, 1.54x with int8 copies)
            chosen["draft_layers"] = "int4"
        config = replace(config, **{k: v for k, v in chosen.items() if getattr(options, k) == "auto"})
        parts = [f"an {config.draft_head} copy of the head" * (config.draft_head != "none"),
                 f"{config.draft_layers} copies of the fused layers" * (config.draft_layers != "none")]
        if any(parts):
            log(f"lossless drafts: {' and '.join(filter(None, parts))} (--draft-head/--draft-layers none to leave "
                f"them out)")
    for name in ("draft_head", "draft_layers"):  # asked for, and not possible here
        if getattr(config, name) != "none" and name in refusals:
            raise InvalidArgumentError(refusals[name])
    if carry and not quant.quantized and (config.draft_head, config.draft_layers) != ("none", "none"):
        # a float export's draft copies from the file's own blocks: drafts that agree with the float layers
        config = replace(config, draft_blocks=BlockIndex.from_gguf(base.location))
    draft_model, trained = None, checkpoint.skipdecode_training(source)
    if options.draft_adapter is not None:
        draft_model, draft_source = _draft_model(options.draft_adapter, source, config, options, log)
        # the horizon and policies the drafts were trained for, where the model itself has none
        trained = trained or checkpoint.skipdecode_training(draft_source)
    if trained:
        log(f"fine-tuned under SkipDecode for speedups {trained.get('speedups')} over a "
            f"{trained.get('horizon')}-step horizon: the manifest keeps that horizon")
    policy = default_policy(model.num_layers, options.policy, trained)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        from tqdm.auto import tqdm

        specs = []
        with contextlib.ExitStack() as stack:
            weights = (stack.enter_context(SharedWeights(tmp)) if config.external_data == "shared"
                       else None)
            for spec in tqdm(graph_specs(model, options.dtype), desc="export onnx",
                             unit="graph", disable=not options.progress):
                specs.append(export_graph(model, spec, tmp, config, weights, draft_model))
        if config.blocks is not None:
            log(carried_line(config.blocks, gguf_entry))
        why_not = config.fused_reason(hf_model.config)
        c = hf_model.config
        fused = [] if why_not else [fused_layers.graph_spec(s, kv_heads(c), head_dim(c)) for s in specs[1:-1]]
        log(f"fused layer graphs for ONNX Runtime: {'none, ' + why_not if why_not else len(fused)}")
        # the embedding as a lookup of its table where it is one (runtime.artifact.embed_table)
        embed_table = embed_table_entry(model, specs[0], tmp)
        if embed_table is not None:
            log(f"embedding: a lookup of its table in {embed_table['file']} (the runtime's, on ONNX Runtime)")
        draft = draft_head_spec(specs[-1]) if config.draft_head != "none" else None
        if draft is not None:
            log(f"draft head for lossless rows: {draft.file} ({config.draft_head} weights)")
        drafts = [draft_layer_spec(f, s.file) for f, s in zip(fused, specs[1:-1])] if config.draft_layers != "none" else []
        if drafts:
            log(f"draft layers for lossless rows: {len(drafts)} ({config.draft_layers} weights)")
        tokenizer.padding_side = "left"
        tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        hf_model.config.save_pretrained(str(tmp / "hf_config"))

        checks = {}
        if options.check:
            results = parity.check_all(model, specs, tmp, options.dtype, page_size=config.page_size,
                                       progress=options.progress, weights=quant.for_graph)
            for r in results:
                log(f"  {r.line()}")
            if fused:  # each on its plain layer's cases (specs[1:-1], the layers, as ``fused``)
                cases = lambda s: parity.torch_cases(model, s, config.page_size, tmp, quant.for_graph(s.name))  # noqa: E731
                done = [parity.compare_fused(f, cases(s), tmp, options.dtype, config.page_size)
                        for s, f in tqdm(list(zip(specs[1:-1], fused)), desc="check fused vs torch", unit="graph",
                                         disable=not options.progress)]
                for r in done:
                    log(f"  {r.line()}")
                results += done
            done = [parity.compare_draft_layer(d, parity.draft_layer_cases(draft_model or model, s, d, tmp,
                                                                           config.draft_layers, config.page_size),
                                               tmp, options.dtype, config.draft_layers, config.page_size)
                    for s, d in tqdm(list(zip(specs[1:-1], drafts)), desc="check draft layers", unit="graph",
                                     disable=not options.progress or not drafts)]
            for r in done:
                log(f"  {r.line()}")
            results += done
            if embed_table is not None:  # the lookup stands in for the graph: value for value
                cases = parity.torch_cases(model, specs[0], config.page_size, tmp, "float")
                results.append(parity.compare_embed_table(specs[0], embed_table, cases, tmp, options.dtype,
                                                          hf_model.config.vocab_size))
                log(f"  {results[-1].line()}")
            if draft is not None:  # judged as the quantized head it is, against the head's module
                results.append(parity.check_graph(model, draft, tmp, options.dtype, config.draft_head,
                                                  page_size=config.page_size))
                log(f"  {results[-1].line()}")
            parity.raise_on_failure(results)
            checks = parity.summary(results)

        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            files[path.relative_to(tmp).as_posix()] = file_entry(path)
        manifest = Manifest(
            model=model_info(hf_model.config, hf_model.generation_config), dtype=options.dtype, opset=config.opset,
            graphs=specs, files=files, tokenizer_dir=TOKENIZER_DIR, policy=policy,
            kv_cache={"layout": KV_LAYOUT, "page_size": config.page_size},
            source={"model": options.model, "kind": source.kind, "location": source.location,
                    "seed": options.seed, "torch": torch.__version__, **gguf_entry,
                    **({"base": base.location} if base is not source else {}),
                    **({"draft_adapter": str(options.draft_adapter)} if draft_model is not None else {})},
            checks=checks, fused=fused, draft_head=draft, draft_layers=drafts, embed_table=embed_table,
            weights={**quant.manifest_entry(), **({DRAFT_HEAD: config.draft_head} if draft else {}),
                     **({"embed": "int8"} if config.blocks and config.blocks.embedding else {}),
                     **({"from_gguf": from_gguf(config.blocks)} if config.blocks else {}),
                     **({DRAFT_LAYERS: config.draft_layers} if drafts else {})})
        record_hashes(tmp, {rel: e["sha256"] for rel, e in files.items()})  # the first load hashes nothing
        manifest.save(tmp)  # last: a directory without it is an unfinished export
        swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _draft_model(spec: str, source, config: ExportConfig, options: BuildOptions, log):
    """The skip-aware model of ``--draft-adapter`` and its source: the adapter merged into the
    model being exported (``source``), at the export's dtype. Refused unless draft layers are
    written and the adapter was trained over that very model."""
    drafts = checkpoint.resolve(spec)
    if drafts.kind != "adapter":
        raise InvalidArgumentError(f"--draft-adapter {spec}: not a LoRA adapter directory (adapter_config.json "
                                   f"and adapter_model.safetensors); tools.finetune --lora-rank R writes one",
                                   param="draft_adapter")
    if config.draft_layers == "none":
        raise InvalidArgumentError(f"--draft-adapter {spec} goes into the draft layers, and this build writes none "
                                   f"(--draft-layers none, or layers that cannot have them); drop one of the two",
                                   param="draft_adapter")
    trained_over = checkpoint.adapter_base(drafts).location
    if trained_over != source.location:
        raise InvalidArgumentError(f"--draft-adapter {spec} was trained over {trained_over}, not over this model "
                                   f"({source.location}); drafts must share the model's weights", param="draft_adapter")
    hf_draft, _ = checkpoint.load(drafts, dtype=config.torch_dtype, seed=options.seed, progress=options.progress)
    log(f"draft layers hold {spec} merged into {source.describe()} (the float layers stay the model's own)")
    return skip_model(hf_draft), drafts


def result_line(out: Path, manifest: Manifest, seconds: float) -> str:
    """What a build made: the line ``export build`` prints on stdout, -q or not."""
    size = sum(e["bytes"] for e in manifest.files.values())
    return f"wrote {out} ({len(manifest.graphs)} graphs, {size / 1e6:.1f} MB) in {seconds:.1f}s"

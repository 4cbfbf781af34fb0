"""manifest.json: the one contract between export, engines and runtime.

The runtime reads only the manifest and the files it names, and checks names, dims, dtypes, sizes
and sha256 hashes against it at load time, so a tampered, truncated or half-written artifact is
refused with an error that says what to do.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ArtifactError
from .embed_table import entry_problem
from .integrity import hash_files, record_hashes, sha256_file, stale_files
from .paths import confined
from .swap import recover

# 2: layers read a paged past in place and return only the new K/V; 3: the past is a block of
# rows (B, nh, hd|W, W|hd), so a step binds the rows that run and no others (runtime.kvcache)
SCHEMA_VERSION = 3
KV_LAYOUT = "rows"  # see runtime.models.opt.CachedOPTLayer
WEIGHT_KINDS = ("embed", "layers", "head")  # the manifest's ``weights`` keys that name a format
WEIGHT_FORMATS = ("float", "int8", "int4")
# A linear weight W that a graph stores transposed, in the (in, out) layout MatMul reads, is named
# W + TRANSPOSED ("q_proj.weight.T"): export.weights writes it, the torch backend reads it back.
TRANSPOSED = ".T"
# Sibling projections of one input (q/k/v; gate/up) are one MatMul on their (in, out) weights
# concatenated along the output axis, named W1 + FUSED + W2 ... ("self_attn.q_proj.weight.T+
# self_attn.k_proj.weight.T+..."); the Split after it reads each part's width from the int64
# initializer named the same + WIDTHS (export.weights.fuse_sibling_matmuls, ``split_fused``).
FUSED = "+"
WIDTHS = ":widths"
# A product carried from a GGUF's Q4_1 blocks (export.gguf_blocks) is MatMulNBits at zero points 0
# plus its minimums' term, nodes named PRODUCT + MINS + "/..." ("/reshape", "/sum", "/term",
# "/add": the block sums of x times the minimums (blocks, N) float32, added); runtime.platform.kernels folds
# the term into its own product.
MINS = "/mins"
# A product carried as runs of columns of several types: nodes BASE + PART + "0" ..., joined by a Concat
PART = "/part"
# A GGUF's 8-bit embedding table (export.gguf_blocks.carry_embedding): TABLE + LEVELS (V, nb, block) uint8,
# TABLE + SCALES (V * nb,) and, for a type with minimums, TABLE + MINIMUMS (V * nb,)
LEVELS, SCALES, MINIMUMS = "_levels", "_scales", "_minimums"


def minimums_term(nodes, product_name: str) -> list:
    """The nodes of product ``product_name``'s minimums' term (MINS), in ``nodes``' order: what
    export.gguf_blocks writes after the product and runtime.platform.kernels folds into its own."""
    prefix = f"{product_name}{MINS}/"
    return [n for n in nodes if n.name.startswith(prefix)]
MANIFEST_NAME = "manifest.json"
DRAFT_HEAD = "head_draft"  # the graph name (and file stem) of export's --draft-head
DRAFT_LAYERS = "layers_draft"  # the weights entry of export's --draft-layers
DRAFT_LAYER_SUFFIX = ".draft.onnx"  # layer_NN.onnx -> layer_NN.draft.onnx: a fused layer, quantized
FORMAT = "skipdecode-opt-layers"
REBUILD_HINT = "rebuild it with `python -m export build --out DIR`"


def split_fused(weights: dict) -> dict:
    """``weights`` (initializer name -> array) with every fused weight replaced by its parts,
    split along the last (output) axis by the widths stored beside it; the widths go too."""
    import numpy as np

    out = {n: w for n, w in weights.items() if not n.endswith(WIDTHS)}
    for name in [n for n in out if FUSED in n]:
        widths = weights.get(name + WIDTHS)
        if widths is None:
            raise ArtifactError(f"fused weight {name!r} has no {name + WIDTHS!r} beside it: the graph "
                                f"was modified or comes from another export; {REBUILD_HINT}")
        parts = name.split(FUSED)
        array = out.pop(name)
        for part, piece in zip(parts, np.split(array, np.cumsum(widths)[:-1], axis=-1)):
            out[part] = piece
    return out


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "float32", "float16", "int64"
    dims: list  # ints for fixed sizes, names ("batch", "sequence", ...) for dynamic ones


@dataclass
class GraphSpec:
    name: str  # "embed", "layer_00" ... "layer_{L-1}", "head"
    file: str  # the .onnx file, relative to the artifact directory
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    data_file: str | None = None  # external weights (graphs over 2 GB), relative

    @classmethod
    def from_dict(cls, d: dict) -> "GraphSpec":
        return cls(d["name"], d["file"], [TensorSpec(**t) for t in d["inputs"]],
                   [TensorSpec(**t) for t in d["outputs"]], d.get("data_file"))


@dataclass
class ModelInfo:
    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    pre_layer_norm: bool  # False for OPT-350m (post-LayerNorm, project_in/out)
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    # Written since the Llama family (runtime.models); manifests before it are OPT's:
    architecture: str = "opt"  # the family its graphs were traced from: "opt", "llama", "qwen2", "qwen3"
    num_kv_heads: int | None = None  # heads of the K/V the layers store (grouped-query attention);
    # None: num_heads
    eos_token_ids: list[int] | None = None  # every id that ends a row by default, when the checkpoint
    # names several (Llama 3 Instruct: end of text, end of message, end of turn); None: eos_token_id

    @property
    def eos_ids(self) -> list[int]:
        """The ids that end a row when a call names none (transformers' generation_config EOS)."""
        return list(self.eos_token_ids or [self.eos_token_id])

    @property
    def kv_heads(self) -> int:
        """Heads of each layer's past K/V: the cache's and the graphs' second dim."""
        return self.num_kv_heads or self.num_heads


@dataclass
class Manifest:
    model: ModelInfo
    dtype: str  # "float32" or "float16": hidden states and KV cache
    opset: int
    graphs: list[GraphSpec]  # embed, layer_00 .. layer_{L-1}, head, in that order
    files: dict[str, dict]  # relative path -> {"sha256": hex, "bytes": int}; every file named
    tokenizer_dir: str  # relative directory holding the tokenizer files
    policy: dict  # default SkipPolicy fields for this model
    kv_cache: dict = field(default_factory=lambda: {"layout": KV_LAYOUT, "page_size": 32})  # the
    # layers' past: a block of rows whose width grows in steps of page_size positions (runtime.kvcache)
    source: dict = field(default_factory=dict)  # where the weights came from
    checks: dict = field(default_factory=dict)  # parity results recorded at export
    weights: dict = field(default_factory=dict)  # weight-only quantization per graph kind:
    # {"embed": "float", "layers": "int4", "head": "int4", "block_size": 32, "format": ...}, and
    # "head_draft": "int8" beside a draft head, "layers_draft": "int8" beside draft layers;
    # empty (and absent from manifests written before it) means float weights in the artifact's dtype
    fused: list[GraphSpec] = field(default_factory=list)  # each layer's variant on ONNX Runtime's
    # fused operators (export.fused: GroupQueryAttention over K stored as V is), layer_00 ..
    # layer_{L-1}, for the ONNX Runtime backend on the CPU; empty: none (TensorRT and torch read only
    # ``graphs``)
    draft_head: GraphSpec | None = None  # the float head quantized (export --draft-head), which lossless
    # rows' draft steps read on ONNX Runtime; None: none (drafts read the head)
    draft_layers: list[GraphSpec] = field(default_factory=list)  # each fused layer graph with its
    # products quantized (export --draft-layers), which lossless rows' draft steps run on ONNX
    # Runtime's CPU provider; empty: none (drafts run the fused layers)
    embed_table: dict | None = None  # {"file", "offset", "shape": [vocab, hidden]}: the embedding
    # graph only gathers rows of this table of ``dtype`` values in ``file``, which the ONNX Runtime
    # backend looks up instead of running it (runtime.artifact.embed_table); None: run the graph
    producer: str = "skipdecode-edge"
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT

    # -- lookup -------------------------------------------------------------------------------

    def graph(self, name: str) -> GraphSpec:
        for g in self.graphs:
            if g.name == name:
                return g
        raise ArtifactError(f"manifest has no graph named {name!r}")

    @property
    def page_size(self) -> int:
        return int(self.kv_cache["page_size"])

    @property
    def embed(self) -> GraphSpec:
        return self.graph("embed")

    @property
    def head(self) -> GraphSpec:
        return self.graph("head")

    def graph_weights(self, name: str) -> str:
        """The weights of graph ``name``: "float", "int8" or "int4"."""
        kind = name if name in ("embed", "head", DRAFT_HEAD) else "layers"
        return self.weights.get(kind, "float")

    @property
    def quantized(self) -> bool:
        return any(self.weights.get(k, "float") != "float" for k in WEIGHT_KINDS)

    @property
    def weights_label(self) -> str:
        """One line for people: "float32" or "int4 layers, int4 head (block 32, matmulnbits), float32 embed",
        and what a GGUF's blocks gave ("; the GGUF's blocks: 16 Q4_K, 76 Q5_0 products")."""
        if not self.quantized:
            return self.dtype
        w = self.weights
        parts = [f"{w.get(k, 'float')} {k}".replace("float", self.dtype) for k in ("layers", "head", "embed")]
        label = f"{parts[0]}, {parts[1]} (block {w.get('block_size')}, {w.get('format')}), {parts[2]}"
        types = w.get("from_gguf", {}).get("types")
        if types:  # a Q4_K_M file's products are of several widths, whatever "layers" says
            label += "; the GGUF's blocks: " + ", ".join(f"{n} {t}" for t, n in types.items()) + " products"
        return label

    @property
    def checked_graphs(self) -> list[GraphSpec]:
        """The graphs export checks against PyTorch one by one: ``graphs`` and the draft head."""
        return [*self.graphs, *filter(None, [self.draft_head])]

    @property
    def layers(self) -> list[GraphSpec]:
        return [self.graph(layer_name(i)) for i in range(self.model.num_layers)]

    # -- persistence --------------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = asdict(self)
        order = ["schema_version", "format", "producer", "dtype", "opset", "model", "policy",
                 "kv_cache", "source", "graphs", "files", "tokenizer_dir", "checks"]
        out = {k: d[k] for k in order}
        if self.weights:  # float artifacts keep the manifest they always had
            out["weights"] = d["weights"]
        if self.fused:
            out["fused"] = d["fused"]
        if self.draft_head is not None:
            out["draft_head"] = d["draft_head"]
        if self.draft_layers:
            out["draft_layers"] = d["draft_layers"]
        if self.embed_table is not None:
            out["embed_table"] = d["embed_table"]
        return out

    def save(self, directory: Path) -> None:
        """Write manifest.json atomically; it is the last file an export writes."""
        directory = Path(directory)
        tmp = directory / (MANIFEST_NAME + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(directory / MANIFEST_NAME)

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        return cls(model=ModelInfo(**d["model"]), dtype=d["dtype"], opset=d["opset"],
                   graphs=[GraphSpec.from_dict(g) for g in d["graphs"]], files=d["files"],
                   tokenizer_dir=d["tokenizer_dir"], policy=d["policy"], kv_cache=d["kv_cache"],
                   source=d.get("source", {}), checks=d.get("checks", {}), weights=d.get("weights", {}),
                   fused=[GraphSpec.from_dict(g) for g in d.get("fused", [])],
                   draft_head=GraphSpec.from_dict(d["draft_head"]) if d.get("draft_head") else None,
                   draft_layers=[GraphSpec.from_dict(g) for g in d.get("draft_layers", [])],
                   embed_table=d.get("embed_table"),
                   producer=d.get("producer", ""), schema_version=d["schema_version"],
                   format=d.get("format", FORMAT))


def layer_name(index: int) -> str:
    return f"layer_{index:02d}"


def file_entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def load_manifest(directory, check_hashes: bool | str = True) -> Manifest:
    """Read and validate ``directory/manifest.json`` and every file it names.

    Every path it names must stay inside ``directory`` (no absolute paths, ``..`` or links out).
    Sizes are always checked. ``check_hashes``:

    * ``True`` (default): the sha256 of every file whose fingerprint (size, mtime, inode, ctime)
      changed since it was last verified (at export, or an earlier load; see runtime.artifact.integrity),
      so a load hashes nothing of an untouched artifact and a modified file is still caught;
    * ``"full"``: the sha256 of every file, whatever the record says (``export verify`` does);
    * ``False``: no hashing at all.
    """
    if check_hashes not in (True, False, "full"):
        raise ArtifactError(f"check_hashes must be True, False or 'full', got {check_hashes!r}")
    directory = Path(directory)
    recover(directory, MANIFEST_NAME)  # a build killed between its two renames left it aside
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {directory} does not exist; {REBUILD_HINT}")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(
            f"{directory} has no {MANIFEST_NAME}: it is not an export, or the export was "
            f"interrupted before it finished (the manifest is written last); {REBUILD_HINT}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); {REBUILD_HINT}") from exc
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has schema_version {version!r}, but this runtime reads schema_version "
            f"{SCHEMA_VERSION}; re-export the model with this toolkit's `python -m export build`, "
            f"or use the toolkit version that wrote it")
    try:
        manifest = Manifest.from_dict(raw)
    except (KeyError, TypeError) as exc:
        raise ArtifactError(f"{path} is missing or has malformed field {exc}; {REBUILD_HINT}") from exc
    _check_structure(manifest, path)
    confined(directory, manifest.tokenizer_dir, path, REBUILD_HINT)
    for rel, entry in manifest.files.items():
        f = confined(directory, rel, path, REBUILD_HINT)
        if not f.is_file():
            raise ArtifactError(f"{f} is named in {MANIFEST_NAME} but missing; {REBUILD_HINT}")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise ArtifactError(
                f"{f} has {size} bytes, the manifest says {entry['bytes']}: the file was "
                f"truncated or modified after export; {REBUILD_HINT}")
    if check_hashes:
        _check_hashes(directory, manifest.files, full=check_hashes == "full")
    return manifest


def _check_hashes(directory: Path, files: dict[str, dict], full: bool) -> None:
    hashes = hash_files(directory, stale_files(directory, files, full), files)
    for rel, digest in hashes.items():
        if digest != files[rel]["sha256"]:
            raise ArtifactError(
                f"{directory / rel} does not match its sha256 in {MANIFEST_NAME} (expected "
                f"{files[rel]['sha256'][:16]}..., found {digest[:16]}...): the file was modified "
                f"or corrupted after export; {REBUILD_HINT}")
    if hashes:
        record_hashes(directory, hashes)  # all matched: the next load skips them


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_model(m: Manifest, path: Path) -> None:
    """The model entry is one the graphs can run: positive sizes, token ids inside the vocabulary,
    the layers' declared K/V and hidden shapes those sizes, a default policy SkipPolicy accepts."""
    from ..errors import PolicyError
    from ..policy import SkipPolicy, speedup_policies

    info = m.model
    sizes = {k: getattr(info, k) for k in ("num_layers", "hidden_size", "num_heads", "head_dim", "vocab_size",
                                         "max_position_embeddings")}
    if info.num_kv_heads is not None:
        sizes["num_kv_heads"] = info.num_kv_heads
    bad = {k: v for k, v in sizes.items() if not _is_count(v)}
    if bad:
        raise ArtifactError(f"{path}: model {bad} must be ints >= 1; {REBUILD_HINT}")
    if info.num_heads % info.kv_heads:
        raise ArtifactError(f"{path}: model num_heads {info.num_heads} is not a multiple of num_kv_heads "
                            f"{info.kv_heads}; {REBUILD_HINT}")
    ids = {k: getattr(info, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    ids.update({f"eos_token_ids[{i}]": v for i, v in enumerate(info.eos_token_ids or [])})
    outside = {k: v for k, v in ids.items()
               if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < info.vocab_size}
    if outside:
        raise ArtifactError(f"{path}: token ids {outside} are outside the vocabulary (0 to "
                            f"{info.vocab_size - 1}); {REBUILD_HINT}")
    kv, hd, hidden = info.kv_heads, info.head_dim, info.hidden_size
    shapes = {"past_key": [kv, hd], "past_value": [kv, hd], "hidden_states": [hidden]}
    for g in m.graphs[1:-1]:
        for t in g.inputs:
            fixed = [d for d in t.dims if isinstance(d, int)]
            if t.name in shapes and fixed != shapes[t.name]:
                raise ArtifactError(
                    f"{path}: {g.name}'s {t.name} has dims {t.dims}, but the model entry says "
                    f"{t.name} sizes {shapes[t.name]} (num_kv_heads / head_dim / hidden_size); {REBUILD_HINT}")
    p = {k: v for k, v in m.policy.items() if k not in ("speedup_policies", "deep_copies")}
    if "deep_copies" in m.policy:  # rows copying their prompt run deeper (runtime.decoding.copying)
        from ..decoding.copying import DeepCopies

        try:
            DeepCopies.from_manifest(m.policy["deep_copies"], info.num_layers)
        except ArtifactError as exc:
            raise ArtifactError(f"{path}: {exc}; {REBUILD_HINT}") from None
    try:
        default = SkipPolicy.from_fields(info.num_layers, p)
        if "speedup_policies" in m.policy:  # a model's own policy per speedup (runtime.policy)
            if m.policy.get("horizon") is None:
                raise PolicyError("speedup_policies need the horizon the model was fine-tuned over")
            speedup_policies(default, m.policy["speedup_policies"])
    except (TypeError, PolicyError) as exc:
        raise ArtifactError(f"{path}: policy {m.policy} is not a valid skip policy ({exc}); {REBUILD_HINT}") from None


def _check_structure(m: Manifest, path: Path) -> None:
    _check_model(m, path)
    expected = ["embed", *(layer_name(i) for i in range(m.model.num_layers)), "head"]
    names = [g.name for g in m.graphs]
    if names != expected:
        raise ArtifactError(
            f"{path} lists graphs {names}, expected {expected} for a {m.model.num_layers}-layer "
            f"model; {REBUILD_HINT}")
    fused = [g.name for g in m.fused]
    if fused and fused != expected[1:-1]:
        raise ArtifactError(f"{path} lists fused layer graphs {fused}, expected {expected[1:-1]}; {REBUILD_HINT}")
    if m.draft_head is not None and m.draft_head.name != DRAFT_HEAD:
        raise ArtifactError(f"{path} names its draft head {m.draft_head.name!r}, expected {DRAFT_HEAD!r}; {REBUILD_HINT}")
    drafts = [g.name for g in m.draft_layers]
    if drafts and drafts != fused:
        raise ArtifactError(f"{path} lists draft layer graphs {drafts}, expected one per fused layer graph "
                            f"{fused}; {REBUILD_HINT}")
    for g in [*m.checked_graphs, *m.fused, *m.draft_layers]:
        for rel in filter(None, (g.file, g.data_file)):
            if rel not in m.files:
                raise ArtifactError(f"{path}: graph {g.name} file {rel} has no sha256 entry; {REBUILD_HINT}")
    problem = None if m.embed_table is None else entry_problem(
        m.embed_table, m.files, m.model.vocab_size, m.model.hidden_size, m.dtype)
    if problem:
        raise ArtifactError(f"{path}: {problem}; {REBUILD_HINT}")
    layout, page = m.kv_cache.get("layout"), m.kv_cache.get("page_size")
    if layout != KV_LAYOUT or isinstance(page, bool) or not isinstance(page, int) or page < 1:
        raise ArtifactError(f"{path}: kv_cache {m.kv_cache} is not a {KV_LAYOUT!r} layout with an int "
                            f"page_size >= 1; {REBUILD_HINT}")
    if m.dtype not in ("float32", "float16"):
        raise ArtifactError(f"{path}: dtype {m.dtype!r} is not float32 or float16; {REBUILD_HINT}")
    if not isinstance(m.weights, dict):
        raise ArtifactError(f"{path}: weights {m.weights!r} is not an object; {REBUILD_HINT}")
    if drafts and m.weights.get(DRAFT_LAYERS) not in ("int8", "int4"):
        raise ArtifactError(f"{path} lists draft layer graphs but weights.{DRAFT_LAYERS} is "
                            f"{m.weights.get(DRAFT_LAYERS)!r}, not 'int8' or 'int4'; {REBUILD_HINT}")
    bad = {k: m.weights.get(k) for k in WEIGHT_KINDS if m.weights.get(k, "float") not in WEIGHT_FORMATS}
    if bad:
        raise ArtifactError(
            f"{path}: weights {bad} are not among {', '.join(WEIGHT_FORMATS)}: the artifact was written "
            f"by a newer toolkit or edited; upgrade skipdecode-edge or {REBUILD_HINT}")

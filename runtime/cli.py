"""What every command line of the toolkit shares: ``--version``, defaults in ``--help``, and one
rule for user errors: one line on stderr (``error: ...``), exit code 2, no traceback.

A user error is any ``SkipDecodeError`` (the toolkit raises nothing else on purpose); argparse's
own usage errors also exit 2. A traceback therefore always means a bug.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import warnings
from typing import Callable

from .errors import InvalidArgumentError, PolicyError, SkipDecodeError
from .version import __version__

USER_ERROR = 2  # exit code of every user error, the same as argparse's usage errors
# The extra (pyproject's optional-dependencies) that installs each optional package a command may
# import: a command run without it says which to install, in one line, instead of a traceback
EXTRAS = {"torch": "export", "transformers": "export", "onnx": "export", "polygraphy": "export",
          "gguf": "export", "accelerate": "export", "onnx_ir": "quant", "onnxruntime": "cpu",
          "starlette": "serve", "uvicorn": "serve", "anyio": "serve", "httpx": "serve",
          "prometheus_client": "serve", "jinja2": "serve", "ray": "ray", "sacrebleu": "eval",
          "rouge_score": "eval", "matplotlib": "bench"}
DISK_FULL = {errno.ENOSPC, errno.EDQUOT}  # where a write fails for want of space, not for a bug
BROKEN_PIPE = 128 + 13  # stdout's reader left (`| head`): what a shell reports for a tool killed by SIGPIPE


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default in --help and keeps descriptions' line breaks. A default of None
    is not shown: such an option's help says what happens without it ("(default: None)" beside
    "default: the artifact's" said it twice, and wrongly)."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0:  # a flag's default is its absence
            return action.help
        return super()._get_help_string(action)


def parser(prog: str, description: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser with ``--version`` and defaults shown in ``--help``."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)
    add_version(p)
    return p


def add_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__} (skipdecode-edge)")


def run(body: Callable[[], int | None]) -> int:
    """Run a command's body; a SkipDecodeError becomes one line on stderr and exit code 2.

    A reader of stdout that leaves early (``python -m runtime ART p | head -1``) ends the command
    quietly, as it ends any Unix tool, instead of with a BrokenPipeError traceback."""
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        code = body() or 0
        sys.stdout.flush()  # here, not at exit, where a closed pipe could no longer be caught
        return code
    except SkipDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
    except BrokenPipeError:
        # Python's own advice: point stdout at /dev/null so the interpreter's last flush stays silent
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if package not in EXTRAS:
            raise  # not an optional package: a bug
        print(f"error: this command needs the package {package}, which is not installed: "
              f"pip install 'skipdecode-edge[{EXTRAS[package]}]'", file=sys.stderr)
        return USER_ERROR
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        where = f" {exc.filename}" if exc.filename else " standard output"
        print(f"error: cannot write{where}: {exc.strerror}; free some space or write elsewhere", file=sys.stderr)
        with contextlib.suppress(OSError):  # the interpreter's last flush of stdout would fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return USER_ERROR
    finally:
        warnings.showwarning = shown


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """The toolkit's warnings name the first caller outside it; under a command that caller is the
    `python -m` launcher (``<frozen runpy>:88: UserWarning: ...``), so the command says it itself."""
    if filename.startswith("<frozen"):
        print(f"warning: {message}", file=file or sys.stderr)
    else:
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def progress(quiet: bool) -> bool:
    """Whether a command draws progress bars: not with -q, and only on a terminal (a bar's \\r
    redraws fill a log file with lines). Without them, transformers' and huggingface_hub's bars
    (e.g. "Loading weights") go too, here and in the child processes a command starts: their
    switch, HF_HUB_DISABLE_PROGRESS_BARS, is also this function's in a child."""
    show = not quiet and sys.stderr.isatty() and os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") != "1"
    if not show:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when those libraries are imported
        if "transformers" in sys.modules:  # already imported: its switch was read
            from transformers.utils import logging

            logging.disable_progress_bar()
    return show


def add_max_new_tokens(p, default: int | None, help: str, aliases=("--new-tokens",), type=int) -> None:
    """--max-new-tokens (transformers' and the API's name for the new-token limit), with the old
    spellings of a tool kept working but out of --help."""
    p.add_argument("--max-new-tokens", type=type, default=default, help=help)
    for alias in aliases:
        p.add_argument(alias, dest="max_new_tokens", type=type, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_prefill_chunk(group, default) -> None:
    """--prefill-chunk, the same in ``python -m runtime`` and ``python -m runtime serve``."""
    group.add_argument("--prefill-chunk", type=prefill_chunk, default=default,
                       help="prompt tokens a joining request runs per step while others decode: N, "
                            "'auto' (chunks of about one decode step) or 'none' (whole)")


def add_batch_invariant(group) -> None:
    """--batch-invariant / --no-batch-invariant, the same in ``python -m runtime`` and ``python -m
    runtime serve`` (``runtime.load(batch_invariant=...)``; neither: on for int8/int4 weights)."""
    invariant = group.add_mutually_exclusive_group()
    invariant.add_argument("--batch-invariant", dest="batch_invariant", action="store_const", const=True,
                           default=None, help="prefill each prompt alone, in chunks of its own pages, so that "
                                              "a greedy answer is the one it gets alone (default: on for "
                                              "int8/int4 weights, off for float ones)")
    invariant.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_const", const=False,
                           help="prefill prompts together and in load-sized chunks: earlier first tokens for "
                                "several prompts, answers that may depend on the batch under int8/int4")


def add_spin(group) -> None:
    """--spin / --no-spin, the same in ``python -m runtime`` and ``python -m runtime serve``: a
    command line's process is its own, so it may make ONNX Runtime's process-wide spinning pool
    where the cores are free (runtime.platform.cpu_idle); a library caller's default stays sleeping."""
    spin = group.add_mutually_exclusive_group()
    spin.add_argument("--spin", dest="spin", action="store_const", const=True, default="auto",
                      help="onnxruntime: worker threads busy-wait for the next operator instead of "
                           "sleeping, whatever else runs (default: they do where no other process "
                           "uses the cores at start, and sleep where one does)")
    spin.add_argument("--no-spin", dest="spin", action="store_const", const=False,
                      help="onnxruntime: worker threads sleep whenever they wait, as a library load's do")


def add_huge_pages(group, default: bool | str = False) -> None:
    """--huge-pages / --no-huge-pages: off by default in ``python -m runtime`` (a one-shot run may
    not repay the load), "auto" in ``python -m runtime serve`` (on wherever ONNX Runtime runs)."""
    huge = group.add_mutually_exclusive_group()
    huge.add_argument("--huge-pages", dest="huge_pages", action="store_const", const=True, default=default,
                      help="onnxruntime on Linux: move the weights ONNX Runtime packed onto 2 MiB pages "
                           "after loading (~2 ms a MiB at load; decode 6-11%% faster where transparent "
                           "huge pages are 'madvise', no more memory)" + (" (the default here)" if default else ""))
    huge.add_argument("--no-huge-pages", dest="huge_pages", action="store_const", const=False,
                      help="leave the packed weights on the pages they were allocated on")


def add_fused(group) -> None:
    """--no-fused, the same in ``python -m runtime`` and ``python -m runtime serve``."""
    group.add_argument("--no-fused", dest="fused", action="store_false",
                       help="onnxruntime on the CPU: run the plain layer graphs even where the artifact has "
                            "their fused-operator variant (GroupQueryAttention), which it runs by default")


def add_compile_steps(group) -> None:
    """--compile-steps, the same in ``python -m runtime`` and ``python -m runtime serve``."""
    group.add_argument("--compile-steps", action="store_true",
                       help="torch on CUDA: compile the captured steps (each layer, the embedding, the head) "
                            "with torch.compile (fewer, fused kernels: 1.24x-1.83x faster than transformers' "
                            "compiled generate at Llama-3.2-1B shapes on an H200, docs/benchmarks-gpu.md), "
                            "paying seconds of compiling for each new shape the first time")


def add_int4_kernel(group) -> None:
    """--int4-kernel and --deterministic, the same in ``python -m runtime`` and ``python -m runtime serve``."""
    from .platform.kernels import CHOICES

    group.add_argument("--int4-kernel", choices=(*CHOICES, "tinygemm"), default="auto",
                       help="onnxruntime on the CPU, int4 artifacts: the products on this project's kernel "
                            "(skipdecode: AVX-512 VNNI or AVX2, built with the machine's C compiler at first "
                            "use) or ONNX "
                            "Runtime's MatMulNBits; auto: skipdecode where it can run. torch: tinygemm runs the "
                            "4-bit products on PyTorch's own int4 product (auto: the Triton kernel on a GPU)")
    group.add_argument("--deterministic", action="store_true",
                       help="onnxruntime, int8/int4 artifacts: every product at float activations, so that a "
                            "request's greedy text is the one it gets alone whatever else is batched with it (the "
                            "default on this project's kernel for exports at --accuracy-level 1, the export's "
                            "default; on ONNX Runtime's MatMulNBits it costs 1.2x-40x: docs/design.md, \"Batch "
                            "invariance\")")


def prefill_chunk(text: str) -> int | str | None:
    """argparse type of --prefill-chunk: 'auto', 'none' (whole prompts) or a number of tokens >= 1."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or a number of tokens >= 1, got {text!r}")
    return value


def policy_fields(speedup: float | None, max_layers: int | None, min_layers: int | None,
                  warmup_layers: int | None) -> dict | None:
    """--speedup / --max-layers / --min-layers / --warmup-layers as the fields
    SkipPolicy.from_fields takes (None when none is given): each command line's policy flags."""
    if speedup is not None and (max_layers is not None or min_layers is not None):
        raise PolicyError("pass --speedup or --max-layers/--min-layers, not both")
    if speedup is not None:
        return {"speedup": speedup, "warmup_layers": warmup_layers}
    if max_layers is None and min_layers is None and warmup_layers is None:
        return None
    if max_layers is None or min_layers is None:
        raise PolicyError("--max-layers and --min-layers go together (--warmup-layers is optional)")
    return {"max_layers": max_layers, "min_layers": min_layers, "warmup_layers": warmup_layers}


def backend_options(args) -> dict:
    """The backend options of a command line's --threads, --spin, --huge-pages, --device, --compile-steps,
    --engine-dir (the runtime's and the server's, which share them), as ``runtime.load`` takes them."""
    options = {"threads": args.threads}
    if args.spin != "auto" and args.backend != "onnxruntime":
        raise InvalidArgumentError(f"--{'' if args.spin else 'no-'}spin applies to --backend onnxruntime "
                                   f"(its thread pools), not {args.backend}")
    if args.backend == "onnxruntime":
        options["spin"] = args.spin
    huge = getattr(args, "huge_pages", False)  # True, False or "auto" (the server's: on for onnxruntime)
    if huge is True and args.backend != "onnxruntime":
        raise InvalidArgumentError(f"--huge-pages applies to --backend onnxruntime (the weights it packs), "
                                   f"not {args.backend}")
    if huge and args.backend == "onnxruntime":
        options["huge_pages"] = True
    if not getattr(args, "fused", True):
        if args.backend != "onnxruntime":
            raise InvalidArgumentError(f"--no-fused applies to --backend onnxruntime, not {args.backend}")
        options["fused"] = False
    kernel = getattr(args, "int4_kernel", "auto")
    if kernel != "auto":
        takes = "torch" if kernel == "tinygemm" else "onnxruntime"  # (the torch backend's: auto or tinygemm)
        if args.backend != takes:
            raise InvalidArgumentError(f"--int4-kernel {kernel} applies to --backend {takes}, not {args.backend}")
        options["int4_kernel"] = kernel
    if getattr(args, "deterministic", False):
        if args.backend != "onnxruntime":
            raise InvalidArgumentError(f"--deterministic applies to --backend onnxruntime, not {args.backend}")
        options["deterministic"] = True
    if getattr(args, "compile_steps", False):
        if args.backend != "torch" or not (args.device or "").startswith("cuda"):
            raise InvalidArgumentError(f"--compile-steps compiles the torch backend's CUDA graph steps: pass it "
                                       f"with --backend torch --device cuda, not --backend {args.backend}"
                                       f"{f' --device {args.device}' if args.device else ''}")
        options["compile_steps"] = True
    if args.backend == "torch" and args.device:
        options["device"] = args.device
    elif args.backend == "onnxruntime" and args.device == "cpu":
        options["providers"] = ["CPUExecutionProvider"]  # the plain backend: numpy buffers in place
    elif args.backend == "onnxruntime" and args.device:
        options["device"] = args.device  # the IOBinding backend; it checks the device exists
    elif args.backend == "tensorrt":
        options = {"engine_dir": args.engine_dir} if args.engine_dir else {}
    return {k: v for k, v in options.items() if v is not None}

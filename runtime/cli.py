"""What every command line of the toolkit shares: ``--version``, defaults in ``--help``, and one
rule for user errors: one line on stderr (``error: ...``), exit code 2, no traceback.

A user error is any ``SkipDecodeError`` (the toolkit raises nothing else on purpose); argparse's
own usage errors also exit 2. A traceback therefore always means a bug.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from .errors import SkipDecodeError
from .version import __version__

USER_ERROR = 2  # exit code of every user error, the same as argparse's usage errors


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default in --help and keeps descriptions' line breaks. A default of None
    is not shown: such an option's help says what happens without it ("(default: None)" beside
    "default: the artifact's" said it twice, and wrongly)."""

    def _get_help_string(self, action):
        if action.default is None:
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
    """Run a command's body; a SkipDecodeError becomes one line on stderr and exit code 2."""
    try:
        return body() or 0
    except SkipDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR


def add_prefill_chunk(group, default) -> None:
    """--prefill-chunk, the same in ``python -m runtime`` and ``python -m runtime serve``."""
    group.add_argument("--prefill-chunk", type=prefill_chunk, default=default,
                       help="prompt tokens a joining request runs per step while others decode: N, "
                            "'auto' (chunks of about one decode step) or 'none' (whole)")


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

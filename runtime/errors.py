"""Typed errors shared by export, runtime and engines.

Every message states what was wrong, the limit it broke, and how to fix it. Users catch
``SkipDecodeError`` to handle all of them.
"""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a
    one-line error quotes of the library error it wraps."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class SkipDecodeError(Exception):
    """Base class of every error this toolkit raises on purpose.

    ``param``: the argument the error is about, where one is ("json_schema", "min_layers",
    "max_new_tokens", "prompt"), so that a caller (the server) maps errors to its own fields by this
    name, never by the message's words.
    """

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        self.param = param


class PolicyError(SkipDecodeError, ValueError):
    """A skip policy whose bounds cannot hold (e.g. min_layers > max_layers)."""


class ModelNotFoundError(SkipDecodeError, FileNotFoundError):
    """A --model that is neither a known alias, a hub id, nor an existing directory."""


class UnsupportedModelError(SkipDecodeError, ValueError):
    """A checkpoint this toolkit cannot export (not OPT, or missing files)."""


class HubDownloadError(SkipDecodeError, OSError):
    """The model hub could not be reached or did not have the requested model."""


class ArtifactError(SkipDecodeError, ValueError):
    """An artifact directory that is missing, incomplete, tampered with or of another schema."""


class InputTooLongError(SkipDecodeError, ValueError):
    """Prompt plus max_new_tokens exceeds the model's max_position_embeddings."""


class InvalidArgumentError(SkipDecodeError, ValueError, TypeError):
    """An argument of the wrong type or out of range (max_new_tokens=0, temperature="hot", ...).

    Both ``ValueError`` and ``TypeError`` are bases so that code written against either still
    catches it; ``SkipDecodeError`` catches it with every other deliberate error.
    """


class EmptyPromptError(InvalidArgumentError):
    """A prompt that encodes to zero tokens (a tokenizer without BOS turns "" into an empty row)."""


class UnknownBackendError(SkipDecodeError, ValueError):
    """A backend name that is not one of runtime.backends.BACKENDS."""


class CorruptCheckpointError(UnsupportedModelError):
    """A checkpoint file that exists but cannot be read (truncated or corrupted weights)."""


class VerificationError(SkipDecodeError, AssertionError):
    """An exported graph whose outputs differ from PyTorch beyond the stated tolerance."""

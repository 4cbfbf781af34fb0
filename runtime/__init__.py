"""SkipDecode runtime: load an exported artifact and generate with layer skipping.

    import runtime
    r = runtime.generate("artifacts/opt-1.3b", ["Hello, my name is"], max_new_tokens=32, speedup=2)
    print(r.texts, r.stats)
"""

from .errors import (ArtifactError, InputTooLongError, ModelNotFoundError, PolicyError,
                     SkipDecodeError, VerificationError)
from .engine import EngineClosedError, QueueFullError
from .generation_config import GenerationConfig
from .generator import GenerationStream, Generator, StepRequest, Stepper, generate, load
from .stats import GenerationResult, GenerationStats, StepStats, TokenEvent
from .policy import SkipPolicy

__all__ = [
    "load", "generate", "Generator", "GenerationConfig", "GenerationResult", "GenerationStats", "GenerationStream", "Stepper",
    "StepRequest",
    "TokenEvent", "StepStats", "SkipPolicy", "EngineClosedError", "QueueFullError", "SkipDecodeError", "ArtifactError", "InputTooLongError",
    "ModelNotFoundError", "PolicyError", "VerificationError",
]

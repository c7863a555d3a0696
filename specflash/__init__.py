"""SpecFlash: lossless speculative decoding you can watch, on any Hugging Face causal LM.

    import specflash
    target = specflash.load("smollm2-135m")
    run = specflash.generate(target, "What is 12 * 7?", method="pld", max_new_tokens=64)
    for step in specflash.stream(target, "Write a haiku", method="ar"): ...
    batch = specflash.generate_batch(target, ["What is 12 * 7?", "Write a haiku"], method="dflash")
"""

from .api import BatchRun, encode_prompt, generate, generate_batch, load, stream
from .config import SamplingConfig
from .drafters import METHODS
from .errors import SpecFlashError
from .trace import RunRecord, StepRecord

__all__ = [
    "METHODS",
    "BatchRun",
    "RunRecord",
    "SamplingConfig",
    "SpecFlashError",
    "StepRecord",
    "encode_prompt",
    "generate",
    "generate_batch",
    "load",
    "stream",
]

"""The one way every training and evaluation script runs from the command line.

Scripts differ in what they do and what they report; they share how they fail (a one-line
message and exit status 2 on bad input, never a traceback) and the `--threads` knob, which
matters on small shared CPUs where two threads fighting over two cores run ten times slower.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

from ..errors import SpecFlashError


def run_script(args: argparse.Namespace, work: Callable[[argparse.Namespace], Any],
               summary: Callable[[Any], str]) -> int:
    """Run `work(args)`; print `summary(result)` on stderr and return 0, or the error and 2."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the model-loading bar; stderr is for progress and errors
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        result = work(args)
    except SpecFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(result), file=sys.stderr)
    return 0

"""Errors a user can cause, each with its own class so callers (CLI, app, tests) can tell them apart.

Every message is written for the person who gave the bad input: it says what was wrong and what to
do instead. The CLI prints it on one line and exits 2; the app shows it as a gr.Error.
"""


class SpecFlashError(Exception):
    """Base class: anything the user can fix by changing their input or installing something."""


class EmptyPromptError(SpecFlashError):
    """The prompt has no tokens."""


class ContextLengthError(SpecFlashError):
    """Prompt plus the tokens asked for do not fit in the model's context window."""


class TokenLimitError(SpecFlashError):
    """A max_new_tokens that is not a positive integer."""


class UnknownMethodError(SpecFlashError):
    """A decoding method name that is not registered."""


class SamplingConfigError(SpecFlashError):
    """Temperature, top-k or top-p outside their valid range."""


class MethodConfigError(SpecFlashError):
    """A method's own knob (draft length, block size, tree depth...) outside its valid range."""


class DrafterMismatchError(SpecFlashError):
    """A drafter that does not fit the target: other vocabulary, hidden size, layer count or mask id."""


class ModelNotFoundError(SpecFlashError):
    """A path that does not exist or holds no model, or a hub id that cannot be had offline."""


class CheckpointError(SpecFlashError):
    """A checkpoint whose files are missing, corrupt, or whose tensors do not match its config."""


class UnknownPresetError(SpecFlashError):
    """A model preset name that is not registered."""


class PresetUnavailableError(SpecFlashError):
    """A known preset whose files cannot be had on this machine; the message says what to install."""


class ConversionError(SpecFlashError):
    """Fetching or converting a packaged model failed (checksum, disk space, unreadable file)."""


class UnbatchableMethodError(SpecFlashError):
    """A method asked to decode a batch that only decodes one sequence at a time."""


class UnsupportedModelError(SpecFlashError):
    """A model family the engine cannot serve (or not with the chosen method): names the family
    and what is missing."""

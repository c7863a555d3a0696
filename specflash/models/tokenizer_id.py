"""A short fingerprint of a tokenizer's vocabulary, recorded with data made by a model.

Why: token ids mean something only under the tokenizer that made them. A datastore harvested
from another model whose ids all fall inside the target's vocabulary cannot be told from the ids
alone (a Llama-3 fine-tune and a different tokenizer of the same size), and would draft text
that is never accepted: lossless still, but slower with no word of why. The harvest records this
fingerprint in its manifest, and the datastore refuses a folder whose record differs from the
target's (drafters/dflash.py `datastore_for`).
"""

from __future__ import annotations

import hashlib


def tokenizer_fingerprint(tokenizer) -> str:
    """16 hex digits of sha256 over the vocabulary's (token, id) pairs in id order: equal for
    tokenizers that map every token to the same id, different where one token moved."""
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256()
    for token, index in pairs:
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]

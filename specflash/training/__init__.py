"""Training for SpecFlash's drafters and heads: data from the target (`data`, built from local
text in `sources`), then the trainers. Each step runs as a module with a progress bar; nothing
here runs at import time."""

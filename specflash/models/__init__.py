"""Models: the target wrapper, tiny test models, presets and offline acquisition of real models."""

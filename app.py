"""Entry point for `python app.py` and Hugging Face Spaces: build the demo from app/, launch it.

Listens on 127.0.0.1:7860 unless GRADIO_SERVER_NAME / GRADIO_SERVER_PORT say otherwise (Spaces
set them); SPECFLASH_APP_MODEL picks the preset the model picker starts on.
"""

import os

from app.ui import build_demo

if __name__ == "__main__":
    demo = build_demo(default_model=os.environ.get("SPECFLASH_APP_MODEL", "smollm2-135m"))
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
    )

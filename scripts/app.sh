#!/usr/bin/env bash
# The README's launch command: set up .venv, fetch and convert the default model once, serve the app.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m specflash fetch-models >/dev/null
exec python app.py "$@"

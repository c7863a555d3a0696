#!/usr/bin/env bash
# The README's test command: set up .venv, then run pytest (fast tests unless told otherwise).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest "$@"

#!/usr/bin/env bash
# Open the tutorial notebooks in JupyterLab (sets up .venv first).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec jupyter lab notebooks/ "$@"

#!/usr/bin/env bash
# Create or reuse the project's virtual environment in .venv, install requirements.txt and the
# project itself (editable).
# Sourced by scripts/app.sh and scripts/test.sh; reinstalls only when requirements.txt changes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x "$venv/bin/python" ]; then
  echo "[specflash] creating $venv" >&2
  "$py" -m venv "$venv"
fi
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$root/requirements.txt" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[specflash] installing requirements (first run takes a few minutes)" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$root/requirements.txt"
  echo "$want" > "$stamp"
fi
# the project itself, editable, so any kernel or script in this venv imports specflash from here
if ! "$venv/bin/pip" show -q specflash >/dev/null 2>&1; then
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root" 2>/dev/null \
    || "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -e "$root"
fi
export PATH="$venv/bin:$PATH"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # app/ and tests/ import from the repo root
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
cd "$root"

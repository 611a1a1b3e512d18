#!/usr/bin/env bash
# Make bench/.venv with PyTorch from PyPI (by package name, as every registry
# use here must be), for the CPU baselines in bench/cpu_ranks.sh. Idempotent:
# a venv that already imports torch is kept.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    exit 0
fi
if ! python3 -m venv "$VENV" 2>/dev/null; then
    # Debian splits venv out of python3.
    apt-get install -y -q python3-venv >/dev/null
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch numpy
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'

#!/usr/bin/env bash
# Create the project's virtual environment and install tensorpar into it.
# Reuses a torch that the base Python already has (a CUDA build on a GPU machine, say);
# installs torch==2.13.0 only when none is importable, and never a second torch.
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        echo "setup: base Python has torch $("$PYTHON" -c 'import torch; print(torch.__version__)'); reusing it"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: no torch importable; installing torch==2.13.0"
    "$PY" -m pip install --quiet --no-compile "torch==2.13.0"
fi
# Every package without compiling its bytecode at install time (torch 16 s -> 5 s here, the test extra's
# transformers, datasets, lm-eval, ... 23 s): thousands of modules of which a run imports a part, which Python
# compiles when it first imports them (the Makefile lets it keep them).
# The package and its test extra in one install: one resolution, one editable build.
"$PY" -m pip install --quiet --disable-pip-version-check --no-compile -e ".[test]"
echo "setup: $("$PY" -c 'import torch, tensorpar; print("torch", torch.__version__, "| tensorpar", tensorpar.__version__)')"

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
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e .
# The test extra's packages (transformers, datasets, lm-eval, ...: thousands of modules the tests import a few of)
# without compiling their bytecode at install time (23 s here): Python compiles what is imported, when it is.
"$PY" -m pip install --quiet --disable-pip-version-check --no-compile -e ".[test]"
echo "setup: $("$PY" -c 'import torch, tensorpar; print("torch", torch.__version__, "| tensorpar", tensorpar.__version__)')"

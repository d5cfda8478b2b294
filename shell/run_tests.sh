#!/usr/bin/env bash
# Set up the environment (idempotent), check the import layers, run the whole test suite on CPU.
#   bash shell/run_tests.sh                 # everything
#   bash shell/run_tests.sh -k transfer     # extra arguments go to pytest (one process)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash shell/setup_env.sh
VENV="${MSRL_VENV:-$ROOT/.venv}"
export PYTHONUNBUFFERED=1
# The import layers (pyproject.toml, [tool.importlinter]) first; a broken contract fails here.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/lint-imports" --no-cache --no-logo
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q "$@"

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
# Byte-compile the project's own modules once (every launch of the suite imports them in
# several processes; with PYTHONDONTWRITEBYTECODE set, as on CI's machines, none of them would
# write its .pyc and each would compile the sources again). Only changed files are redone.
"$VENV/bin/python" -m compileall -q -j 0 mindspeed_rl tests benchmarks tools >/dev/null
# The import layers (pyproject.toml, [tool.importlinter]) first; a broken contract fails here.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/lint-imports" --no-cache --no-logo
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q "$@"

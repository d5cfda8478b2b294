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
PYTEST=("$VENV/bin/python" -m pytest -p no:cacheprovider -q)
if [[ $# -gt 0 ]]; then  # a selection (a file, -k ...): one run, one process
  exec "${PYTEST[@]}" "$@"
fi
# The whole suite in two runs (docs/testing.md). First, alone, the modules that bound how
# fast something happens on a loaded machine: the fault tests (a hung rank reported within
# the collective timeout; they run two jobs of their own at once), the code interpreter's
# tests (64 sandboxed calls in flight, each killed at its timeout) and the benchmarks' smoke
# runs. Then every other module on two pytest-xdist workers, a module per worker at a time,
# one thread each (2 cores).
SERIAL=(tests/test_faults.py tests/test_tools.py tests/test_sandbox.py tests/test_benchmarks.py)
status=0
"${PYTEST[@]}" "${SERIAL[@]}" || status=$?
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${PYTEST[@]}" -n 2 --dist loadfile \
  "${SERIAL[@]/#/--ignore=}" || status=$?
exit "$status"

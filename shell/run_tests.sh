#!/usr/bin/env bash
# Set up the environment (idempotent), check the import layers, run the whole test suite on CPU.
#   bash shell/run_tests.sh                 # everything
#   bash shell/run_tests.sh -k transfer     # extra arguments go to pytest (one process)
#   MSRL_TEST_WORKERS=2 bash shell/run_tests.sh   # on two pytest-xdist workers (not faster: docs/testing.md)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash shell/setup_env.sh
VENV="${MSRL_VENV:-$ROOT/.venv}"
export PYTHONUNBUFFERED=1
# The import layers (pyproject.toml, [tool.importlinter]) first; a broken contract fails here.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/lint-imports" --no-cache --no-logo
PYTEST=("$VENV/bin/python" -m pytest -p no:cacheprovider -q)
WORKERS="${MSRL_TEST_WORKERS:-1}"
if [[ $# -gt 0 || "$WORKERS" == 1 ]]; then  # the default, and any selection: one process
  exec "${PYTEST[@]}" "$@"
fi
# MSRL_TEST_WORKERS=2: the whole suite in two runs (measured slower than one: docs/testing.md).
# First, alone, the modules that bound how fast something happens on a loaded machine: the
# fault tests (a hung rank reported within the collective timeout; they run two jobs of
# their own at once), the code interpreter's tests (64 sandboxed calls in flight, each
# killed at its timeout) and the benchmarks' smoke runs. Then every other module on
# pytest-xdist workers, a module per worker at a time, one thread each.
SERIAL=(tests/test_faults.py tests/test_tools.py tests/test_sandbox.py tests/test_benchmarks.py)
status=0
"${PYTEST[@]}" "${SERIAL[@]}" || status=$?
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${PYTEST[@]}" -n "$WORKERS" --dist loadfile \
  "${SERIAL[@]/#/--ignore=}" || status=$?
exit "$status"

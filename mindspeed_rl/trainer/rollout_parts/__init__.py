"""The rollout phase from parts: a source of rows x a continuation x a scheduler.

    while not source.ready():
        rows = source.take()                               # this rank's rows of the pass
        continuation.advance(unfinished rows, scheduler.limits(source, rows))
        source.put(rows)
    released, own = source.close()
    metrics = rollout_metrics(released rows, the passes' work) | own

- ``sources.py``: fresh prompts; rows carried in the dock (partial rollout);
- ``continuations.py``: one model turn; tool turns (the agent loop, ``agent.py``);
- ``schedulers.py``: one pass; a per-pass token budget; step-wise;
- ``rows.py``: a row, its dock columns and tags; ``metrics.py``: the rollout's metrics.

Which parts a job runs is decided once, by ``config.features.rollout``
(``mindspeed_rl/config/features.py``), which the dry-run plan prints; ``composed.py``
builds them (:func:`compose`) and runs the loop (:class:`Rollout`). A new mode is a new
part with the same interface and a line in the tables of ``composed.py``.
"""

from mindspeed_rl.trainer.rollout_parts.composed import Rollout, compose

__all__ = ["Rollout", "compose"]

"""A second megatron-core layout over the same ranks: another TP x PP (x DP) for a frozen
role (the distillation teacher), its groups made once, current only inside
:meth:`SecondLayout.current`.

megatron-core keeps its groups in module globals of ``parallel_state`` (and modules built
under them keep their own group handles). A second layout is a second copy of those
globals: made by resetting them to their defaults, initialising the other layout, keeping
the result and putting the first layout's globals back. Inside ``current()`` megatron's
getters (the pipeline schedule, vocab-parallel reductions, ``mindspeed_rl``'s engine)
answer for the second layout; on leaving, the first is current again.

``destroy_model_parallel`` also destroys the gloo data-parallel groups it holds; the first
layout keeps using them, so the reset between the two runs without destroying any group.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist


def _globals() -> dict:
    from megatron.core import parallel_state as ps

    return {k: v for k, v in vars(ps).items() if k.startswith("_") and k[1:2].isupper()}


def _put(state: dict) -> None:
    from megatron.core import parallel_state as ps

    for name, value in state.items():
        setattr(ps, name, value)


@contextlib.contextmanager
def _keeping_groups() -> Iterator[None]:
    """``torch.distributed.destroy_process_group`` does nothing inside (megatron's reset
    of its globals then leaves the groups alive)."""
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


class SecondLayout:
    """Megatron groups of ``tensor_model_parallel_size`` x ``pipeline_model_parallel_size``
    over the whole world (data parallel over the rest), beside the current layout."""

    def __init__(self, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                 timeout_s: float) -> None:
        from megatron.core import parallel_state as ps

        from mindspeed_rl.parallel.groups import group_timeout_s

        self.tp, self.pp = tensor_model_parallel_size, pipeline_model_parallel_size
        first = _globals()
        try:
            with _keeping_groups():
                ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=self.tp,
                                         pipeline_model_parallel_size=self.pp,
                                         distributed_timeout_minutes=group_timeout_s(timeout_s) / 60)
            self._state = _globals()
        finally:
            _put(first)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """megatron's parallel state answers for this layout inside."""
        first = _globals()
        _put(self._state)
        try:
            yield
        finally:
            self._state = _globals()
            _put(first)

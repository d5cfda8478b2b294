"""The RL loop: the column contract, the phases, the algorithms, the roles, the iteration.

- ``columns.py``: every TransferDock column with its producer and consumer phases;
- ``flow.py``: the dock seen through that contract;
- ``context.py``: what a phase receives (``PhaseContext``) and the states it may change;
- ``phases.py`` / ``recipes.py``: what each phase does, and GRPO / PPO as phase lists;
- ``roles.py``: one build per role (actor, rollout engine, resharder, reference, critic,
  reward model), each from its config section;
- ``trainer.py``: the loop and its checkpoints; ``launch.py`` / ``launch_guard.py``: the
  launchers' bootstrap and how an early end is reported.

The megatron side of each role (micro-batches, schedule, optimizer, losses) is in
``mindspeed_rl/engine/``.
"""

from mindspeed_rl.engine.actor import MegatronActor, forward_logprobs
from mindspeed_rl.engine.micro_batches import RowBatch
from mindspeed_rl.trainer.trainer import RLTrainer

__all__ = ["MegatronActor", "RLTrainer", "RowBatch", "forward_logprobs"]

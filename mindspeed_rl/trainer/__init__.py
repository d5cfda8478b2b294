"""The RL trainer: roles, the column contract, phases, algorithms, the iteration loop.

- ``columns.py``: every TransferDock column with its producer and consumer phases;
- ``flow.py``: the dock seen through that contract;
- ``phases.py`` / ``recipes.py``: what each phase does, and GRPO / PPO as phase lists;
- ``roles.py``: actor (megatron + vLLM + resharder), reference, critic, reward model;
- ``actor.py``, ``critic.py``, ``optim.py``, ``schedule.py``, ``micro_batches.py``:
  the megatron side of each role;
- ``trainer.py``: the loop and its checkpoints; ``launch.py``: the launchers' bootstrap;
  ``launch_guard.py``: their one-line errors and exit statuses.
"""

from mindspeed_rl.trainer.actor import MegatronActor, forward_logprobs
from mindspeed_rl.trainer.micro_batches import RowBatch
from mindspeed_rl.trainer.trainer import RLTrainer

__all__ = ["MegatronActor", "RLTrainer", "RowBatch", "forward_logprobs"]

"""The RL loop: the column contract, the phases, the rollout's parts, the roles, the loop.

- ``columns.py``: every TransferDock column with its producer and consumer phases;
- ``flow.py``: the dock seen through that contract; ``context.py``: what a phase receives;
- ``phases.py``: what each phase does; ``recipes.py``: each phase name's function (the
  families' phase lists are ``mindspeed_rl/algorithms/grpo.py`` and ``ppo.py``);
- ``rollout_parts/``: the rollout as a source x a continuation x a scheduler;
- ``roles.py``, ``teacher_role.py``: one build per role (actor, rollout engine, resharder,
  reference, critic, reward model, distillation teacher), each from its config section;
- ``trainer.py``: the loop and its checkpoints; ``evaluation.py``: greedy evaluation;
  ``launch.py`` / ``launch_guard.py``: the launchers' bootstrap and how an early end is
  reported.

The megatron side of each role (micro-batches, schedule, optimizer, losses) is in
``mindspeed_rl/engine/``.
"""

from mindspeed_rl.trainer.trainer import RLTrainer

__all__ = ["RLTrainer"]

"""The names of an iteration's phases, defined once.

A phase's name is its timer (``timing/<name>``), its TransferDock consumer, its name in
the column contract (``mindspeed_rl/trainer/columns.py``) and, for a phase that runs
megatron micro-batches, its key in the batch plan's ``micro_batching``
(``mindspeed_rl/config/batch_plan.py``). Each algorithm family lists these names in the order
it runs them (``mindspeed_rl/algorithms/grpo.py``, ``ppo.py``); the trainer maps each name
to its function (``mindspeed_rl/trainer/recipes.py``).
"""

PAIRS = "pairs"  # DPO: the iteration's preference pairs into the dock
RESHARDING_TO_INFER = "resharding_to_infer"
ROLLOUT = "rollout"
RESHARDING_TO_TRAIN = "resharding_to_train"
REWARD_MODEL = "reward_model"
REWARD = "reward"
DYNAMIC_SAMPLING = "dynamic_sampling"
ADV = "adv"
VALUES = "values"
OLD_LOG_P = "old_log_p"
REFERENCE_MODEL = "reference_model"
TEACHER_MODEL = "teacher_model"
DISTILL_ADV = "distill_adv"
DISCOUNTED_RETURNS = "discounted_returns"
GAE = "gae"
CRITIC_UPDATE = "critic_update"
UPDATE = "update"
PREFERENCE_UPDATE = "preference_update"  # DPO's loss on the pairs

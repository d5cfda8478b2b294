"""The megatron training engine: how rows become micro-batches, run through megatron's
pipeline schedule, and turn into optimizer steps. No RL loop here (``trainer/`` has it).

- ``micro_batches.py``: fixed, token-budget and packed micro-batch layouts of rows;
- ``packing.py``: packed sequences (segment ids, the attention path megatron takes);
- ``schedule.py``: micro-batches through ``get_forward_backward_func``, forward-only rows,
  the tensor-parallel reductions;
- ``optim.py``: `TrainableModel` (DDP, the megatron optimizer, LR schedule, NaN guard);
- ``actor.py`` / ``critic.py``: the policy and value roles' losses and forwards;
- ``efficiency.py``: padding efficiency and model FLOPs per phase;
- ``logprob_parity.py``: the actor's log-probs against transformers' (tools/check_parity.py).
"""

"""DPO's keys (``pretrain_dpo.py``): what a preference-pair job's config means here, and its
checks.

A DPO job reads MindSpeed-LLM's keys from ``megatron_training`` (``is_pairwise_dataset``,
``dpo_loss_type``, ``dpo_beta``, ``dpo_label_smoothing``, ``pref_ftx``, ``ref_model`` ->
``ref_config.load``, ``refer_model_iter``). Its rows are pairs: ``global_batch_size``
pairs per iteration, each two rows (chosen, rejected) of one group, so
``rl_config.n_samples_per_prompt`` is 2 and ``actor_config.micro_batch_size`` counts pairs
(MindSpeed-LLM's meaning: a micro-batch of 1 holds one chosen and one rejected sequence).
One optimizer step per iteration, as MindSpeed-LLM's DPO trainer takes.
"""

from __future__ import annotations

import dataclasses

from mindspeed_rl.config.config_error import ConfigError, require

PAIR = 2  # rows per pair: the chosen and the rejected response


def resolve_pairs_rl(rl, written: dict, micro_batch_size: int):
    """rl_config of a DPO job: groups of two rows; the reference's forward micro-batches
    hold ``micro_batch_size`` pairs unless the file says otherwise. ``written``: the
    rl_config keys the file (or an override) gave."""
    if "n_samples_per_prompt" in written and written["n_samples_per_prompt"] != PAIR:
        raise ConfigError("rl_config.n_samples_per_prompt", "a DPO pair is 2 rows (chosen, "
                          "rejected)", "remove the key (pretrain_dpo.py sets 2)",
                          value=written["n_samples_per_prompt"])
    ref_rows = written.get("ref_forward_micro_batch_size", PAIR * micro_batch_size)
    return dataclasses.replace(rl, n_samples_per_prompt=PAIR,
                               ref_forward_micro_batch_size=ref_rows)


def check_preference_job(config) -> None:
    """Refuse, naming the key, what a DPO job cannot run (pretrain_dpo.py)."""
    mt, rl, actor = config.megatron_training, config.rl_config, config.actor_config
    require(mt.is_pairwise_dataset, "megatron_training.is_pairwise_dataset", False,
            "pretrain_dpo.py trains on preference pairs (prompt, chosen, rejected)",
            "set is_pairwise_dataset: true and point data_path at pairs (docs/dpo.md)")
    require(mt.dpo_beta > 0, "megatron_training.dpo_beta", mt.dpo_beta,
            "must be positive (the implicit reward's scale)", "use e.g. 0.1")
    require(0 <= mt.dpo_label_smoothing < 0.5, "megatron_training.dpo_label_smoothing",
            mt.dpo_label_smoothing, "is the probability that a label is flipped: in [0, 0.5)",
            "use 0 (plain DPO) or e.g. 0.1 (cDPO)")
    require(mt.dpo_label_smoothing == 0 or mt.dpo_loss_type == "sigmoid",
            "megatron_training.dpo_label_smoothing", mt.dpo_label_smoothing,
            f"only the sigmoid loss reads it (dpo_loss_type={mt.dpo_loss_type})",
            "set dpo_label_smoothing: 0 or dpo_loss_type: sigmoid")
    require(mt.pref_ftx >= 0, "megatron_training.pref_ftx", mt.pref_ftx,
            "must not be negative (the SFT term's coefficient)", "use 0 or a small positive value")
    require(mt.refer_model_iter == 1, "megatron_training.refer_model_iter", mt.refer_model_iter,
            "a resumed run here reloads the reference from the source its checkpoint records "
            "(the initial weights, or ref_model)", "remove the key; to start from another "
            "reference, set ref_model to that checkpoint")
    require(rl.mini_batch_size == mt.global_batch_size and rl.epochs == 1,
            "rl_config.mini_batch_size", rl.mini_batch_size,
            "DPO takes one optimizer step per iteration, on its global_batch_size pairs",
            "remove mini_batch_size and epochs (or set them to global_batch_size and 1)")
    require(actor.context_parallel_size == 1, "actor_config.context_parallel_size",
            actor.context_parallel_size, "DPO does not split sequences over context-parallel "
            "ranks here", "use context_parallel_size: 1 (pairs of up to seq_length tokens)")
    require(rl.use_kl_in_reward is False, "rl_config.use_kl_in_reward", True,
            "DPO has no reward", "remove the key")


def check_not_pairwise(config) -> None:
    """A pairwise data set given to an RL launcher."""
    require(not config.megatron_training.is_pairwise_dataset,
            "megatron_training.is_pairwise_dataset", True,
            f"preference pairs train with pretrain_dpo.py, not {config.algorithm.upper()}",
            "launch pretrain_dpo.py with this config, or remove the key")

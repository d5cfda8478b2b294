"""DPO's two phases of its own (its third, the reference's log-probs, is GRPO's):

    pairs -> reference_model -> preference_update

``pairs`` puts the iteration's ``global_batch_size`` preference pairs from the data into
the TransferDock, two rows each (chosen, then rejected) in one group; the reference reads
every row; ``preference_update`` gets whole pairs per training-DP rank and takes one
optimizer step on the DPO loss (``mindspeed_rl/engine/preference.py``).
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.engine.micro_batches import RowBatch
from mindspeed_rl.engine.preference import PAIR, PreferenceObjective, preference_step
from mindspeed_rl.trainer.context import PhaseContext

_ROW_COLUMNS = ("prompt_ids", "response_ids", "group_id", "sample_idx")


def pairs(ctx: PhaseContext) -> dict[str, float]:
    """The next ``global_batch_size`` pairs of the data set (every rank reads the same
    ones); rank r puts pairs r, r + world, ... into the dock."""
    items = ctx.train_data.next_batch(ctx.batch.prompts_per_iteration)
    first = ctx.state.groups_generated
    ctx.state.groups_generated += len(items)
    columns: dict[str, list[torch.Tensor]] = {name: [] for name in _ROW_COLUMNS}
    for i in range(ctx.ranks.rank, len(items), ctx.ranks.world):
        item = items[i]
        for k, response in enumerate((item.chosen_ids, item.rejected_ids)):
            columns["prompt_ids"].append(torch.tensor(item.prompt_ids, dtype=torch.int64))
            columns["response_ids"].append(torch.tensor(response, dtype=torch.int64))
            columns["group_id"].append(torch.tensor(first + i, dtype=torch.int64))
            columns["sample_idx"].append(torch.tensor(k, dtype=torch.int64))
    ctx.flow.put_rows(columns if columns["prompt_ids"] else {}, group_size=PAIR)
    prompt = sum(len(item.prompt_ids) for item in items)
    return {"tokens/prompt": float(PAIR * prompt),
            "tokens/response": float(sum(len(item.chosen_ids) + len(item.rejected_ids)
                                         for item in items)),
            "pairs/chosen_length_mean": sum(len(i.chosen_ids) for i in items) / len(items),
            "pairs/rejected_length_mean": sum(len(i.rejected_ids) for i in items) / len(items)}


def preference_update(ctx: PhaseContext) -> dict[str, float]:
    """One optimizer step on this training-DP rank's whole pairs, chosen before rejected."""
    mt, b = ctx.config.megatron_training, ctx.batch
    batch = ctx.flow.get([*_ROW_COLUMNS, "logprobs_ref"], b.responses_per_training_dp_rank,
                         "train", whole_groups=True)
    rows = _pair_rows(batch)
    objective = PreferenceObjective(beta=mt.dpo_beta, loss_type=mt.dpo_loss_type,
                                    label_smoothing=mt.dpo_label_smoothing,
                                    pref_ftx=mt.pref_ftx, vocab_size=ctx.vocab_size)
    stats = preference_step(ctx.roles.actor, rows, b.micro_batching[names.PREFERENCE_UPDATE],
                            objective)
    actor = ctx.roles.actor
    out = {f"actor/{k}": v for k, v in stats.items() if "/" not in k}
    out.update({k: v for k, v in stats.items() if "/" in k})
    out["actor/lr"] = actor.lr
    out["actor/skipped_steps"] = float(actor.step_guard.pop_skipped())
    return out


def _pair_rows(batch) -> RowBatch:
    """The dock's rows ordered pair by pair, chosen (sample 0) then rejected (sample 1)."""
    if batch is None:
        return RowBatch([], [], {"logprobs_ref": []})
    order = sorted(range(len(batch.rows)),
                   key=lambda i: (int(batch["group_id"][i]), int(batch["sample_idx"][i])))
    kinds = [int(batch["sample_idx"][i]) for i in order]
    if kinds != [0, 1] * (len(order) // PAIR) or len(order) % PAIR:
        raise RuntimeError(f"the dock delivered split pairs (samples {kinds})")
    return RowBatch([batch["prompt_ids"][i] for i in order],
                    [batch["response_ids"][i] for i in order],
                    {"logprobs_ref": [batch["logprobs_ref"][i] for i in order]})

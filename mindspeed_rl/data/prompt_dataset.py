"""The dataset of a run: tokenized prompts and their answers (or any other items, e.g. the
preference pairs of `mindspeed_rl.data.pairwise`), and a resumable, deterministic,
epoch-shuffled read position."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptItem:
    """One prompt, ready for the rollout engine and the verifiers."""

    prompt_ids: list[int]  # [prompt_len] token ids, chat template applied when enabled
    answer: str  # gold answer for the verifiers ("" when the dataset has none)
    prompt_text: str  # the text the ids encode (the rendered chat template)
    source_row: int  # row in its data file, counted from 0, for error messages and logs
    source_file: str = ""


class PromptDataset(Sequence):
    """Prompts (or other items) in file order, plus a shuffled read position for training.

    Epoch e visits the prompts in the permutation drawn from ``(seed, e)`` (file
    order when ``shuffle`` is False); ``next_batch`` returns the next
    ``global_batch_size`` prompts of that order and moves on to epoch e + 1 when
    fewer than ``global_batch_size`` remain (the tail of an epoch is skipped, so
    every batch is full). The position (epoch, offset) is what the checkpoint
    stores: ``state_dict()`` / ``load_state_dict()``.

    item_name: what the items are called in error messages ("prompts", "pairs").
    length_key: the config key of the length filter applied before (named when a resume
      finds another item count); None when no item was filtered out by length.
    """

    def __init__(self, items: Sequence, *, seed: int = 1234, shuffle: bool = True,
                 num_dropped: int = 0, source: str = "", item_name: str = "prompts",
                 length_key: str | None = "rl_config.max_prompt_length"):
        self._items = list(items)
        self.item_name = item_name
        self.length_key = length_key
        self.seed = int(seed)
        self.shuffle = shuffle
        self.num_dropped = num_dropped  # prompts filtered out as longer than max_prompt_length
        self.source = source
        self.epoch = 0
        self.offset = 0  # prompts of this epoch's order already returned
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        return self._items[index]

    def order(self, epoch: int) -> np.ndarray:
        """Indices of the prompts in the order of ``epoch``: [num_prompts]."""
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self))
            else:
                self._order = np.arange(len(self))
            self._order_epoch = epoch
        return self._order

    def next_indices(self, global_batch_size: int) -> list[int]:
        """Dataset indices of the next ``global_batch_size`` prompts; advances the position."""
        if not 1 <= global_batch_size <= len(self):
            raise ValueError(f"global_batch_size={global_batch_size} must be between 1 and the "
                             f"{len(self)} {self.item_name} of {self.source or 'the dataset'}")
        if self.offset + global_batch_size > len(self):
            self.epoch, self.offset = self.epoch + 1, 0
        indices = self.order(self.epoch)[self.offset:self.offset + global_batch_size]
        self.offset += global_batch_size
        return indices.tolist()

    def next_batch(self, global_batch_size: int) -> list[PromptItem]:
        """The next ``global_batch_size`` prompts; advances the position."""
        return [self._items[i] for i in self.next_indices(global_batch_size)]

    def batches(self, global_batch_size: int) -> Iterator[list[PromptItem]]:
        """Endless successive ``next_batch`` results (the trainer stops after train_iters)."""
        while True:
            yield self.next_batch(global_batch_size)

    def sequential_batches(self, batch_size: int,
                           num_prompts: int | None = None) -> Iterator[list[PromptItem]]:
        """The first ``num_prompts`` (default all) prompts in file order, in batches of
        ``batch_size``, the last one possibly shorter; for evaluation. Does not touch
        the training position."""
        end = len(self) if num_prompts is None else min(num_prompts, len(self))
        for start in range(0, end, batch_size):
            yield self._items[start:min(start + batch_size, end)]

    def state_dict(self) -> dict:
        """The read position, for the trainer's checkpoint."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "num_prompts": len(self)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position from ``state_dict``; fails if the dataset or seed changed,
        since the position would then point at different prompts."""
        if state["num_prompts"] != len(self):  # (the key keeps its name for old checkpoints)
            after = (f" (after the {self.length_key.rpartition('.')[2]} filter)"
                     if self.length_key else "")
            same = f" and {self.length_key}" if self.length_key else ""
            raise ValueError(f"the checkpoint's data position is for {state['num_prompts']} "
                             f"{self.item_name} but {self.source or 'the dataset'} has "
                             f"{len(self)}{after}; resume with the same data{same}")
        if state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data order used seed {state['seed']} but "
                             f"megatron_training.seed is {self.seed}; resume with the same seed")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def slice_per_dp_rank(batch: Sequence, dp_rank: int, dp_size: int) -> list:
    """The contiguous share of a global batch read by one data-parallel rank."""
    if len(batch) % dp_size != 0:
        raise ValueError(f"a batch of {len(batch)} prompts does not split over {dp_size} "
                         "data-parallel ranks")
    per_rank = len(batch) // dp_size
    return list(batch[dp_rank * per_rank:(dp_rank + 1) * per_rank])

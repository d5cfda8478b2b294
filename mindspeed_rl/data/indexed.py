"""Prompt data in MindSpeed-RL's packed Megatron indexed-dataset format.

MindSpeed-RL's preprocessing (``R1AlpacaStyleInstructionHandler``) writes, for an output
prefix ``P``, one Megatron indexed dataset (``.bin`` + ``.idx``) per field::

    P_packed_input_ids_document.{bin,idx}       the prompt, chat template applied
    P_packed_attention_mask_document.{bin,idx}  ones
    P_packed_labels_document.{bin,idx}          the gold answer's token ids

and its configs set ``data_path: P``. Both directions use megatron-core's own
``IndexedDataset`` / ``IndexedDatasetBuilder``; the answer is the decoded ``labels``
(special tokens skipped), as MindSpeed-RL's verifiers read it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

FIELDS = ("input_ids", "attention_mask", "labels")


def field_prefix(prefix: str, field: str) -> str:
    return f"{prefix}_packed_{field}_document"


def is_indexed_prefix(path: str) -> bool:
    """True when ``path`` is the prefix of a packed prompt dataset (its input_ids exist)."""
    base = field_prefix(str(path), "input_ids")
    return os.path.isfile(base + ".idx") and os.path.isfile(base + ".bin")


def read_indexed_prompts(prefix: str, data_path_key: str = "megatron_training.data_path"
                         ) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompt token ids, answer token ids)`` of every document, in file order."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    missing = [f for f in ("input_ids", "labels")
               if not os.path.isfile(field_prefix(prefix, f) + ".idx")]
    if missing:
        raise FileNotFoundError(
            f"{prefix}: the packed dataset has no {missing} field "
            f"({field_prefix(prefix, missing[0])}.idx); MindSpeed-RL's preprocessing writes "
            f"it with dataset_additional_keys: [labels] (set {data_path_key})")
    prompts = IndexedDataset(field_prefix(prefix, "input_ids"))
    labels = IndexedDataset(field_prefix(prefix, "labels"))
    if len(prompts) != len(labels):
        raise ValueError(f"{prefix}: {len(prompts)} prompts but {len(labels)} labels; "
                         "rewrite the dataset")
    return ([prompts[i].tolist() for i in range(len(prompts))],
            [labels[i].tolist() for i in range(len(labels))])


def write_indexed_prompts(prefix: str, rows: Iterable[tuple[Sequence[int], Sequence[int]]]
                          ) -> int:
    """Write (prompt ids, answer ids) rows as MindSpeed-RL's packed format; returns the count."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    builders = {f: IndexedDatasetBuilder(field_prefix(prefix, f) + ".bin", dtype=np.int32)
                for f in FIELDS}
    count = 0
    for prompt_ids, answer_ids in rows:
        values = {"input_ids": list(prompt_ids), "attention_mask": [1] * len(prompt_ids),
                  "labels": list(answer_ids)}
        for f, builder in builders.items():
            builder.add_item(torch.tensor(values[f], dtype=torch.int64))
            builder.end_document()
        count += 1
    for f, builder in builders.items():
        builder.finalize(field_prefix(prefix, f) + ".idx")
    return count

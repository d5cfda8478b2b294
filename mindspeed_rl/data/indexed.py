"""Prompt data in MindSpeed-RL's packed Megatron indexed-dataset format.

MindSpeed-RL's preprocessing (``R1AlpacaStyleInstructionHandler``) writes, for an output
prefix ``P``, one Megatron indexed dataset (``.bin`` + ``.idx``) per field::

    P_packed_input_ids_document.{bin,idx}       the prompt, chat template applied
    P_packed_attention_mask_document.{bin,idx}  ones
    P_packed_labels_document.{bin,idx}          the gold answer's token ids

and its configs set ``data_path: P``. Both directions use megatron-core's own
``IndexedDataset`` / ``IndexedDatasetBuilder``; the answer is the decoded ``labels``
(special tokens skipped), as MindSpeed-RL's verifiers read it.

Preference pairs (``AlpacaStylePairwiseHandler``, DPO) are four such datasets::

    P_packed_chosen_input_ids_document.{bin,idx}    prompt ids + chosen response ids
    P_packed_chosen_labels_document.{bin,idx}       -100 per prompt token, then the chosen ids
    P_packed_rejected_input_ids_document.{bin,idx}  prompt ids + rejected response ids
    P_packed_rejected_labels_document.{bin,idx}     -100 per prompt token, then the rejected ids

one document per pair, int32; the prompt ends at the first label that is not -100.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

FIELDS = ("input_ids", "attention_mask", "labels")
PAIR_FIELDS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
IGNORE_INDEX = -100  # the label of a prompt token: not trained on


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
    return _write_fields(prefix, FIELDS, ({"input_ids": list(p), "attention_mask": [1] * len(p),
                                           "labels": list(a)} for p, a in rows))


def _write_fields(prefix: str, fields: Sequence[str], documents: Iterable[dict]) -> int:
    """One megatron-core indexed dataset per field (``field_prefix``), one document per
    item of ``documents`` (field -> token ids); returns the count."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    builders = {f: IndexedDatasetBuilder(field_prefix(prefix, f) + ".bin", dtype=np.int32)
                for f in fields}
    count = 0
    for values in documents:
        for f, builder in builders.items():
            builder.add_item(torch.tensor(values[f], dtype=torch.int64))
            builder.end_document()
        count += 1
    for f, builder in builders.items():
        builder.finalize(field_prefix(prefix, f) + ".idx")
    return count


def is_indexed_pair_prefix(path: str) -> bool:
    """True when ``path`` is the prefix of a packed pairwise dataset (its chosen_input_ids
    exist)."""
    base = field_prefix(str(path), "chosen_input_ids")
    return os.path.isfile(base + ".idx") and os.path.isfile(base + ".bin")


def read_indexed_pairs(prefix: str, data_path_key: str = "megatron_training.data_path"
                       ) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt ids, chosen ids, rejected ids)`` of every document, in file order.

    Each document is split at its first label that is not -100; one whose labels are all
    -100 (no response) fails, naming it, as does one whose chosen and rejected halves have
    different prompts.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    missing = [f for f in PAIR_FIELDS if not os.path.isfile(field_prefix(prefix, f) + ".idx")]
    if missing:
        raise FileNotFoundError(
            f"{prefix}: the packed pairwise dataset has no {missing} field "
            f"({field_prefix(prefix, missing[0])}.idx); rewrite it with tools/preprocess_data.py "
            f"--handler-name AlpacaStylePairwiseHandler (set {data_path_key})")
    fields = {f: IndexedDataset(field_prefix(prefix, f)) for f in PAIR_FIELDS}
    counts = {f: len(d) for f, d in fields.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{prefix}: its pairwise fields hold different document counts "
                         f"{counts}; rewrite the dataset")
    pairs = []
    for doc in range(counts["chosen_input_ids"]):
        halves = {}
        for side in ("chosen", "rejected"):
            ids = fields[f"{side}_input_ids"][doc].tolist()
            labels = fields[f"{side}_labels"][doc].tolist()
            if len(ids) != len(labels):
                raise ValueError(f"document {doc} of {field_prefix(prefix, side + '_labels')}: "
                                 f"{len(labels)} labels for {len(ids)} input ids; rewrite the "
                                 "dataset")
            start = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
            if start is None:
                raise ValueError(f"document {doc} of {field_prefix(prefix, side + '_labels')}: "
                                 f"every label is -100, so the {side!r} response is empty; a "
                                 "pair needs two non-empty responses: rewrite the dataset "
                                 "without it")
            halves[side] = (ids[:start], ids[start:])
        if halves["chosen"][0] != halves["rejected"][0]:
            raise ValueError(f"document {doc} of {prefix}_packed_*: the chosen and the rejected "
                             f"sequence have different prompts ({len(halves['chosen'][0])} and "
                             f"{len(halves['rejected'][0])} tokens before the first label); a "
                             "pair answers one prompt: rewrite the dataset")
        pairs.append((halves["chosen"][0], halves["chosen"][1], halves["rejected"][1]))
    return pairs


def write_indexed_pairs(prefix: str,
                        rows: Iterable[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> int:
    """Write (prompt ids, chosen ids, rejected ids) rows as MindSpeed-RL's packed pairwise
    format (module docstring); returns the count."""
    def documents():
        for prompt_ids, chosen_ids, rejected_ids in rows:
            prompt = [IGNORE_INDEX] * len(prompt_ids)
            yield {"chosen_input_ids": [*prompt_ids, *chosen_ids],
                   "chosen_labels": [*prompt, *chosen_ids],
                   "rejected_input_ids": [*prompt_ids, *rejected_ids],
                   "rejected_labels": [*prompt, *rejected_ids]}

    return _write_fields(prefix, PAIR_FIELDS, documents())

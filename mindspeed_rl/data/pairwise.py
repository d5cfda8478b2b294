"""Preference pairs for DPO: a prompt with a chosen and a rejected response.

Formats ``load_pair_dataset`` reads (``path``):

- ``.jsonl`` / ``.json`` / ``.parquet`` files, or a directory of them (read as
  `mindspeed_rl.data.prompts` reads prompt files), in MindSpeed-RL's
  ``AlpacaStylePairwiseHandler`` layout. Each row has the columns, by target name:

  ========  ===============  =========================================================
  target    default column   meaning
  ========  ===============  =========================================================
  prompt    ``instruction``  the user's request (required unless ``query`` gives it;
                             ``prompt`` when the file has no ``instruction`` column)
  query     ``input``        optional, appended to the prompt after a newline
  system    (none)           optional system message, put first
  history   (none)           optional earlier turns ``[[user, assistant], ...]``
  chosen    ``chosen``       the preferred response (required)
  rejected  ``rejected``     the other response (required)
  ========  ===============  =========================================================

  ``map_keys`` maps target names to the file's columns as MindSpeed-RL's preprocessing
  yaml does, e.g. ``{"prompt": "question", "query": "", "system": "system"}`` for
  Intel/orca_dpo_pairs (columns system/question/chosen/rejected): an empty value means
  the file has no such column; a target not named keeps its default column, and an
  optional default column the file lacks is read as absent.
- A pre-tokenized ``.parquet`` (``tools/preprocess_data.py --handler-name
  AlpacaStylePairwiseHandler --output F.parquet``): list<int32> columns ``prompt_ids``,
  ``chosen_ids``, ``rejected_ids`` and a string column ``prompt_text``; no tokenizer needed.
- MindSpeed-RL's packed indexed pairwise dataset: ``path`` is the prefix ``P`` of
  ``P_packed_{chosen,rejected}_{input_ids,labels}_document.{bin,idx}``
  (`mindspeed_rl.data.indexed`).

Token ids: the prompt is the chat template over [system, history..., user] with the
generation prompt; each response is its text encoded without special tokens, then the
tokenizer's ``eos_token_id``, as a sampled response ends. Bad rows are errors that name the
file, the row (counted from 0) and the column; no row is skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mindspeed_rl.data.indexed import (field_prefix, is_indexed_pair_prefix, is_indexed_prefix,
                                       read_indexed_pairs)
from mindspeed_rl.data.prompt_dataset import PromptDataset
from mindspeed_rl.data.prompts import PROMPT_TEXT_COLUMN, RawPrompt, tables, tokenize_prompts

# MindSpeed-RL's alpaca column names (InstructionDatasetAttr); "response" is the
# instruction handlers' single answer, which a pair replaces by chosen and rejected.
DEFAULT_MAP_KEYS: dict[str, str | None] = {
    "prompt": "instruction", "query": "input", "system": None, "history": None,
    "chosen": "chosen", "rejected": "rejected"}
# Columns of a pre-tokenized pairwise parquet (tools/preprocess_data.py).
PAIR_IDS_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
_RESPONSES = ("chosen", "rejected")
_ENCODE_CHUNK = 1024  # responses per batched tokenizer call


@dataclass(frozen=True)
class PairItem:
    """One preference pair, ready for a DPO step (prompt tokens are out of the loss)."""

    prompt_ids: list[int]  # [prompt_len] chat template applied, generation prompt at the end
    chosen_ids: list[int]  # [chosen_len] the preferred response, ending with eos_token_id
    rejected_ids: list[int]  # [rejected_len] the other response, ending with eos_token_id
    prompt_text: str  # the text prompt_ids encode (decoded for a packed dataset)
    source_row: int  # row (or packed document) in its file, counted from 0
    source_file: str


@dataclass(frozen=True)
class _TextPair:
    raw: RawPrompt  # the prompt (chat messages, or plain text without the template)
    chosen: str
    rejected: str
    keys: tuple[str, str]  # the file's chosen and rejected columns, for messages


def pair_columns(file: str, columns: list[str],
                 map_keys: dict[str, str | None] | None = None) -> dict[str, str | None]:
    """Target name -> the file's column (None: absent), checked against ``columns``."""
    map_keys = dict(map_keys or {})
    unknown = sorted(set(map_keys) - set(DEFAULT_MAP_KEYS))
    if unknown:
        fix = ("pairwise data has no single response: map 'chosen' and 'rejected'"
               if unknown == ["response"] else f"its keys are {list(DEFAULT_MAP_KEYS)}")
        raise ValueError(f"map_keys names {unknown}; {fix}")
    resolved = {}
    # the responses first: a prompt file given to DPO is told it has none
    for target in sorted(DEFAULT_MAP_KEYS, key=lambda t: t not in _RESPONSES):
        default = DEFAULT_MAP_KEYS[target]
        if target == "prompt" and default not in columns and "prompt" in columns:
            default = "prompt"  # this project's prompt files name it so (prompt_key)
        column = map_keys.get(target, default) or None
        if column is not None and not isinstance(column, str):
            raise ValueError(f"map_keys.{target} must be a column name or \"\", got {column!r}")
        if column is not None and column not in columns:
            if target in map_keys:
                raise ValueError(f"row 0 of {file} has no {column!r} column, which "
                                 f"map_keys.{target} names (columns: {columns}); fix "
                                 f"map_keys.{target}, or set it to \"\" when the file has none")
            if target in _RESPONSES:
                raise ValueError(
                    f"row 0 of {file} has no {column!r} column (columns: {columns}): a "
                    "pairwise (DPO) file has a chosen and a rejected response per prompt, and "
                    "prompt files (prompt + answer) train with pretrain_grpo.py; if the "
                    f"responses are under other names, set map_keys.{target}")
            if target == "prompt":
                raise ValueError(
                    f"row 0 of {file} has no {column!r} column (columns: {columns}), "
                    "MindSpeed-RL's alpaca name for the prompt; name the prompt's column in "
                    "map_keys, e.g. {\"prompt\": \"question\"}")
            column = None  # an optional column at its default name: absent
        resolved[target] = column
    if resolved["prompt"] is None and resolved["query"] is None:
        raise ValueError(f"map_keys leaves {file} without a prompt: name the prompt's column "
                         "in map_keys.prompt (or map_keys.query)")
    return resolved


def _text(value: Any, file: str, row: int, key: str, required: bool) -> str:
    if value is None:
        if required:
            raise ValueError(f"row {row} of {file} has no {key!r} field; fill it in or remove "
                             "the row")
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"row {row} of {file}: {key!r} must be a string, got "
                         f"{type(value).__name__} {str(value)[:80]!r}")
    return value


def _history(value: Any, file: str, row: int, key: str) -> list[dict[str, str]]:
    """Earlier turns ``[[user, assistant], ...]`` as chat messages."""
    if value is None:
        return []
    if not (isinstance(value, list) and all(
            isinstance(turn, (list, tuple)) and len(turn) == 2
            and all(isinstance(t, str) for t in turn) for turn in value)):
        raise ValueError(f"row {row} of {file}: {key!r} must be a list of [user, assistant] "
                         f"string pairs, got {str(value)[:80]!r}")
    return [m for user, assistant in value for m in (
        {"role": "user", "content": user}, {"role": "assistant", "content": assistant})]


def _row_pair(file: str, row: int, values: dict, columns: dict[str, str | None],
              apply_chat_template: bool) -> _TextPair:
    """One row as a prompt and two response texts; empty prompt or responses are errors."""
    parts = [_text(values.get(columns[t]), file, row, columns[t], required=False)
             for t in ("prompt", "query") if columns[t] is not None]
    content = "\n".join(p for p in parts if p)  # as alpaca joins instruction and input
    if not content.strip():
        named = [c for c in (columns["prompt"], columns["query"]) if c]
        raise ValueError(f"row {row} of {file} has an empty prompt ({' + '.join(map(repr, named))}"
                         "); fill it in or remove the row")
    system = (_text(values.get(columns["system"]), file, row, columns["system"], required=False)
              if columns["system"] else "")
    history = (_history(values.get(columns["history"]), file, row, columns["history"])
               if columns["history"] else [])
    responses = {}
    for target in _RESPONSES:
        key = columns[target]
        responses[target] = _text(values.get(key), file, row, key, required=True)
        if not responses[target].strip():
            raise ValueError(f"row {row} of {file}: the {key!r} response is empty; a pair needs "
                             "two non-empty responses: fill it in or remove the row")
    if apply_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + history \
            + [{"role": "user", "content": content}]
        prompt: str | list = messages
    elif history:
        raise ValueError(f"row {row} of {file}: {columns['history']!r} holds earlier turns, "
                         "which need the chat template: enable apply_chat_template")
    else:
        prompt = f"{system}\n\n{content}" if system else content
    raw = RawPrompt(prompt=prompt, answer="", source_file=file, source_row=row)
    return _TextPair(raw, responses["chosen"], responses["rejected"],
                     (columns["chosen"], columns["rejected"]))


def _eos_token_id(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        where = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer at {where} has no eos_token: a response must end as a "
                         "sampled one does; set eos_token in its tokenizer_config.json")
    return eos


def encode_responses(texts: list[str], tokenizer) -> list[list[int]]:
    """Each response's token ids (no special tokens added) ending with ``eos_token_id``
    (not doubled when the text already ends with the eos token)."""
    eos = _eos_token_id(tokenizer)
    out = []
    for start in range(0, len(texts), _ENCODE_CHUNK):
        chunk = texts[start:start + _ENCODE_CHUNK]
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            ids = list(ids)
            out.append(ids if ids and ids[-1] == eos else ids + [eos])
    return out


def tokenize_pairs(pairs: list[_TextPair], tokenizer,
                   apply_chat_template: bool = True) -> list[PairItem]:
    """PairItems for text pairs, in order (prompts as `tokenize_prompts` encodes them)."""
    if pairs and tokenizer is None:
        raise ValueError(f"{pairs[0].raw.source_file} is not pre-tokenized (no "
                         f"{list(PAIR_IDS_COLUMNS)} columns): a tokenizer is needed")
    prompts = list(tokenize_prompts([p.raw for p in pairs], tokenizer, apply_chat_template))
    responses = encode_responses([t for p in pairs for t in (p.chosen, p.rejected)], tokenizer)
    return [PairItem(prompt_ids=list(ids), chosen_ids=responses[2 * i],
                     rejected_ids=responses[2 * i + 1], prompt_text=text,
                     source_row=p.raw.source_row, source_file=p.raw.source_file)
            for i, (p, (ids, text)) in enumerate(zip(pairs, prompts))]


def _pre_tokenized_pairs(file: str, table) -> list[PairItem]:
    """The pairs of a pre-tokenized pairwise parquet (its ``PAIR_IDS_COLUMNS``)."""
    items = []
    for row in range(len(table)):
        values = table[row]
        for key in PAIR_IDS_COLUMNS:
            if values.get(key) is None:
                raise ValueError(f"row {row} of {file} has no {key!r} field; rewrite the file "
                                 "with tools/preprocess_data.py")
        items.append(PairItem(
            prompt_ids=list(values["prompt_ids"]), chosen_ids=list(values["chosen_ids"]),
            rejected_ids=list(values["rejected_ids"]),
            prompt_text=values.get(PROMPT_TEXT_COLUMN) or "", source_row=row, source_file=file))
    return items


def _file_pairs(path: str, tokenizer, map_keys, apply_chat_template: bool,
                data_path_key: str) -> list[tuple[PairItem, tuple[str, str]]]:
    """(pair, its file's chosen and rejected column names) for every row of ``path``."""
    out = []
    for file, table in tables(path, data_path_key):
        if set(PAIR_IDS_COLUMNS) <= set(table.column_names):
            out += [(item, PAIR_IDS_COLUMNS[1:]) for item in _pre_tokenized_pairs(file, table)]
            continue
        columns = pair_columns(file, table.column_names, map_keys)
        pairs = [_row_pair(file, row, table[row], columns, apply_chat_template)
                 for row in range(len(table))]
        out += [(item, pair.keys) for item, pair in
                zip(tokenize_pairs(pairs, tokenizer, apply_chat_template), pairs)]
    return out


def _packed_pairs(prefix: str, tokenizer, data_path_key: str) -> list[PairItem]:
    decode = tokenizer.decode if tokenizer is not None else (lambda ids: "")
    return [PairItem(prompt_ids=p, chosen_ids=c, rejected_ids=r, prompt_text=decode(p),
                     source_row=doc, source_file=prefix)
            for doc, (p, c, r) in enumerate(read_indexed_pairs(prefix, data_path_key))]


def check_pair(item: PairItem, seq_length: int | None, where: str,
               keys: tuple[str, str] = _RESPONSES) -> None:
    """The checks every pair passes, whatever its source: a prompt, two non-empty different
    responses, prompt + the longer response within ``seq_length``. ``where`` names the row
    (``row 3 of f.jsonl``), ``keys`` the responses' columns."""
    if not item.prompt_ids:
        raise ValueError(f"{where} has no prompt tokens; a pair answers a prompt: fix or "
                         "remove the row")
    for key, ids in zip(keys, (item.chosen_ids, item.rejected_ids)):
        if not ids:
            raise ValueError(f"{where}: the {key!r} response is empty; a pair needs two "
                             "non-empty responses: fill it in or remove the row")
    if item.chosen_ids == item.rejected_ids:
        raise ValueError(f"{where}: {keys[0]!r} and {keys[1]!r} are the same response "
                         f"({len(item.chosen_ids)} tokens); a pair prefers one response over a "
                         "different one: fix or remove the row")
    longer = 0 if len(item.chosen_ids) >= len(item.rejected_ids) else 1
    response = (item.chosen_ids, item.rejected_ids)[longer]
    total = len(item.prompt_ids) + len(response)
    if seq_length is not None and total > seq_length:
        raise ValueError(f"{where}: prompt ({len(item.prompt_ids)} tokens) + the longer response "
                         f"{keys[longer]!r} ({len(response)} tokens) = {total} tokens > "
                         f"seq_length {seq_length}; raise megatron_training.seq_length to "
                         f"{total} or more, or shorten or remove the row")


def load_pair_dataset(path: str, tokenizer: Any, seq_length: int | None, *,
                      map_keys: dict[str, str | None] | None = None, seed: int = 1234,
                      shuffle: bool = True, data_path_key: str = "megatron_training.data_path",
                      apply_chat_template: bool = True) -> PromptDataset:
    """Read, template, tokenize and check the preference pairs of ``path``.

    path: a .jsonl/.json/.parquet file, a directory of them, or the prefix of a packed
      pairwise dataset (module docstring).
    tokenizer: a transformers tokenizer with an eos token (None only for pre-tokenized or
      packed data; a packed dataset's ``prompt_text`` is then "").
    seq_length: a pair whose prompt + longer response has more tokens is an error (None: no
      limit); so are empty or identical responses: every row is trained on or refused.
    map_keys: target name -> the file's column (module docstring); text files only.
    seed, shuffle: the data order (``PromptDataset``).
    data_path_key: the config key named in the file errors.
    returns: a ``PromptDataset`` of ``PairItem`` in file order, with its resumable order.
    """
    if is_indexed_prefix(path) and not is_indexed_pair_prefix(path):
        raise ValueError(f"{path} is a prompt (GRPO) packed dataset (_packed_input_ids, no "
                         "_packed_chosen_*/_packed_rejected_*): it has no chosen/rejected "
                         "responses; prompt data trains with pretrain_grpo.py")
    if is_indexed_pair_prefix(path):
        checked = [(item, f"document {item.source_row} of {path}_packed_*", _RESPONSES)
                   for item in _packed_pairs(path, tokenizer, data_path_key)]
    else:
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"data file {path} not found, and no packed pairwise dataset "
                f"{field_prefix(path, 'chosen_input_ids')}.idx either; set {data_path_key}")
        checked = [(item, f"row {item.source_row} of {item.source_file}", keys) for item, keys
                   in _file_pairs(path, tokenizer, map_keys, apply_chat_template, data_path_key)]
    if not checked:
        raise ValueError(f"data file {path} has no rows; set {data_path_key}")
    for item, where, keys in checked:
        check_pair(item, seq_length, where, keys)
    return PromptDataset([item for item, _, _ in checked], seed=seed, shuffle=shuffle,
                         source=path, item_name="pairs", length_key=None)

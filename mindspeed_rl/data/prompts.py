"""Reading prompt files and turning prompts into token ids.

Data files: ``.jsonl`` / ``.json`` (JSON lines or one JSON array of rows) and
``.parquet``, or a directory of such files (read in name order), read with Python's
``json`` and pyarrow's parquet reader. A row holds the prompt under ``prompt_key`` -- a
string (sent as one user message) or a list of chat messages
``[{"role": ..., "content": ...}]`` -- and the gold answer under ``answer_key``. A file written by
``tools/preprocess_data.py`` has a ``prompt_ids`` column instead: it is used as
is, without a tokenizer. A MindSpeed-RL packed indexed dataset prefix (``P`` with
``P_packed_input_ids_document.{bin,idx}`` and ``..._labels_...``; see
`mindspeed_rl.data.indexed`) is read with megatron-core's reader: its prompts are token
ids already, its answers the decoded labels.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mindspeed_rl.data.indexed import (is_indexed_pair_prefix, is_indexed_prefix,
                                       read_indexed_prompts)
from mindspeed_rl.data.prompt_dataset import PromptDataset, PromptItem

logger = logging.getLogger(__name__)

# Columns of a pre-tokenized file (tools/preprocess_data.py).
PROMPT_IDS_COLUMN = "prompt_ids"
PROMPT_TEXT_COLUMN = "prompt_text"

_BUILDER_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_TOKENIZE_CHUNK = 1024  # prompts per batched tokenizer call


@dataclass(frozen=True)
class RawPrompt:
    """One row of a data file before tokenization."""

    prompt: str | list[dict[str, str]] | None  # None in a pre-tokenized file without it
    answer: str
    source_file: str
    source_row: int  # counted from 0
    prompt_ids: list[int] | None = None  # set when the file is pre-tokenized
    prompt_text: str | None = None
    answer_ids: list[int] | None = None  # an indexed dataset's labels, decoded by the loader


def tables(path: str, data_path_key: str = "megatron_training.data_path"):
    """(file, its rows) of every non-empty data file of ``path``, in order."""
    for file in data_files(path, data_path_key):
        if os.path.getsize(file) == 0:
            continue
        table = load_table(file)
        if len(table):
            yield file, table


def data_files(path: str, data_path_key: str = "megatron_training.data_path") -> list[str]:
    """The data files ``path`` names: itself, or the supported files of a directory."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, name) for name in os.listdir(path)
                       if os.path.splitext(name)[1] in _BUILDER_BY_SUFFIX)
        if not files:
            raise FileNotFoundError(f"data directory {path} holds no {sorted(_BUILDER_BY_SUFFIX)} "
                                    f"files; set {data_path_key}")
        builders = {_BUILDER_BY_SUFFIX[os.path.splitext(f)[1]] for f in files}
        if len(builders) > 1:
            raise ValueError(f"data directory {path} mixes JSON and parquet files; keep one "
                             f"format per directory ({data_path_key})")
        return files
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} not found; set {data_path_key}")
    if os.path.splitext(path)[1] not in _BUILDER_BY_SUFFIX:
        raise ValueError(f"data file {path} is not one of {sorted(_BUILDER_BY_SUFFIX)}; "
                         f"set {data_path_key}")
    return [path]


def _check_utf8(path: str) -> None:
    """Name the first line of a JSON file that is not UTF-8 (a decoder's error names
    neither the file nor the row)."""
    jsonl = path.endswith(".jsonl")
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                where = (f"row {line_number - 1} (line {line_number})" if jsonl
                         else f"line {line_number}")
                raise ValueError(
                    f"{where} of {path} is not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1}); re-encode the file as UTF-8, e.g. "
                    f"iconv -f latin1 -t utf-8") from None


class _Rows:
    """The rows of one data file: dicts in file order, and the union of their keys."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.column_names = list(dict.fromkeys(key for row in rows for key in row))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: str | int):
        """A column (a key missing from a row reads as None), or a row by number."""
        if isinstance(key, int):
            return self.rows[key]
        return [row.get(key) for row in self.rows]


def load_table(path: str) -> _Rows:
    """The rows of one file: pyarrow's parquet reader, or Python's JSON parser (rows as
    written: a message keeps exactly the keys it has). Errors name the file and the row."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return _Rows(pq.read_table(path).to_pylist())
        except Exception as e:
            raise ValueError(f"cannot read data file {path} as parquet: "
                             f"{type(e).__name__}: {e}") from e
    _check_utf8(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    rows = _json_document(path, text)
    if rows is None:
        rows = _json_lines(path, text)
    for row, value in enumerate(rows):
        if not isinstance(value, dict):
            raise ValueError(f"row {row} of {path} is a JSON {type(value).__name__}, not an "
                             'object; write one object per row, e.g. {"prompt": ..., '
                             '"answer": ...}')
    return _Rows(rows)


def _json_document(path: str, text: str) -> list | None:
    """A file that is one JSON document: its array of rows, or one object as one row; None
    when it holds more than one (JSON lines), or when a ``.jsonl`` file is not valid JSON
    (read line by line, its error names the row)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" or path.endswith(".jsonl"):
            return None
        raise ValueError(f"cannot read data file {path} as json: line {e.lineno} column "
                         f"{e.colno}: {e.msg}; write one JSON array of rows, or one JSON "
                         "object per line") from None
    return value if isinstance(value, list) else [value]


def _json_lines(path: str, text: str) -> list:
    """One JSON value per non-blank line (JSON lines)."""
    rows = []
    for line_number, line in enumerate(text.split("\n"), start=1):  # (not splitlines: a
        # string may hold U+2028 or a form feed, which are not line ends in JSON lines)
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"cannot read data file {path} as json: row {len(rows)} (line "
                             f"{line_number}) is not valid JSON: {e.msg} at column {e.colno}; "
                             "write one JSON object per line") from None
    return rows


# The columns that mark a pairwise (DPO) file: raw text, or pre-tokenized (pairwise.py).
_PAIR_COLUMN_SETS = ({"chosen", "rejected"}, {"chosen_ids", "rejected_ids"})


def _check_not_pairwise(path: str, table, answer_key: str | None) -> None:
    """A DPO file given to a prompt loader: say so instead of naming a missing answer. Only
    when the answer column is missing, so prompt files with extra columns still load."""
    columns = set(table.column_names)
    if answer_key is None or answer_key in columns:
        return
    for pair_columns in _PAIR_COLUMN_SETS:
        if pair_columns <= columns:
            chosen, rejected = sorted(pair_columns)
            raise ValueError(f"row 0 of {path} has {chosen!r} and {rejected!r} fields and no "
                             f"{answer_key!r} field: it is a pairwise (DPO) file, which trains "
                             "with pretrain_dpo.py; GRPO/PPO read prompts with answers (set "
                             "megatron_training.answer_key if the answers are under another key)")


def _row_keys(table, row: int) -> list[str]:
    return sorted(k for k, v in table[row].items() if v is not None)


def _missing_field(path: str, row: int, key: str, keys: list[str], fix: str) -> ValueError:
    return ValueError(f"row {row} of {path} has no {key!r} field (keys: {keys}); {fix}")


def read_prompt_rows(path: str, prompt_key: str = "prompt", answer_key: str | None = "answer",
                     data_path_key: str = "megatron_training.data_path") -> list[RawPrompt]:
    """All rows of ``path`` (a file or a directory of files), fields checked.

    A row without the prompt or the answer field fails with the file and row
    (counted from 0) named. ``answer_key=None``: the data has no answers (all "").
    Rows whose prompt is empty (blank text, no messages or only blank ones, no token ids)
    are skipped: one warning per file names it and counts them.
    """
    if is_indexed_pair_prefix(path) and not is_indexed_prefix(path):
        raise ValueError(f"{path} is a pairwise (DPO) packed dataset (its _packed_chosen_* and "
                         "_packed_rejected_* files hold preference pairs, no prompts with "
                         "answers); pairwise data trains with pretrain_dpo.py")
    if is_indexed_prefix(path):
        prompts, answers = read_indexed_prompts(path, data_path_key)
        return [RawPrompt(prompt=None, answer="", source_file=path, source_row=i,
                          prompt_ids=p, answer_ids=a)
                for i, (p, a) in enumerate(zip(prompts, answers))]
    rows: list[RawPrompt] = []
    skipped = []  # (file, its rows with an empty prompt, its row count)
    for file, table in tables(path, data_path_key):
        pre_tokenized = PROMPT_IDS_COLUMN in table.column_names
        columns = set(table.column_names)
        _check_not_pairwise(file, table, answer_key)
        prompts = table[prompt_key] if prompt_key in columns else None
        answers = table[answer_key] if answer_key is not None and answer_key in columns else None
        ids = table[PROMPT_IDS_COLUMN] if pre_tokenized else None
        texts = table[PROMPT_TEXT_COLUMN] if PROMPT_TEXT_COLUMN in columns else None
        empty = []
        for row in range(len(table)):
            prompt = prompts[row] if prompts is not None else None
            if pre_tokenized:
                if ids[row] is None:
                    raise _missing_field(file, row, PROMPT_IDS_COLUMN, _row_keys(table, row),
                                         "rewrite the file with tools/preprocess_data.py")
            elif prompt is None:
                raise _missing_field(file, row, prompt_key, _row_keys(table, row),
                                     "set megatron_training.prompt_key")
            if answer_key is None:
                answer = ""
            elif answers is None or answers[row] is None:
                raise _missing_field(file, row, answer_key, _row_keys(table, row),
                                     "set megatron_training.answer_key")
            else:
                answer = str(answers[row])
            if _is_empty_prompt(prompt, ids[row] if pre_tokenized else None):
                empty.append(row)
                continue
            rows.append(RawPrompt(
                prompt=prompt, answer=answer, source_file=file, source_row=row,
                prompt_ids=list(ids[row]) if pre_tokenized else None,
                prompt_text=texts[row] if texts is not None else None))
        if empty:
            skipped.append((file, empty, len(table)))
    if skipped and not rows:
        raise ValueError(f"all {sum(len(e) for _, e, _ in skipped)} rows of {path} have an "
                         "empty prompt (no text, no token ids); fill them in, or point "
                         f"{data_path_key} at another file")
    for file, empty, total in skipped:
        shown = ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5 else "")
        logger.warning("%s: %d of its %d rows have an empty prompt and are skipped (rows %s)",
                       file, len(empty), total, shown)
    return rows


def _is_empty_prompt(prompt, ids) -> bool:
    """A prompt with nothing to answer: training on it teaches nothing and its rollouts
    are the model talking to itself."""
    if ids is not None:
        return len(ids) == 0
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, list):
        return not any(isinstance(m, dict) and isinstance(m.get("content"), str)
                       and m["content"].strip() for m in prompt)
    return False


# MindSpeed-RL's qwen_retool template: after the question, how to state the answer.
RETOOL_ANSWER_INSTRUCTION = "The answer format must be: \\boxed{'The final answer goes here.'}"


@dataclasses.dataclass(frozen=True)
class ToolPrompt:
    """``megatron_training.prompt_type: qwen_retool``: the tools the model may call, told in
    the system message (after the dataset's own system message, or after
    ``DEFAULT_SYSTEM``), and an instruction on the answer's form after the question."""

    tools_block: str
    answer_instruction: str = RETOOL_ANSWER_INSTRUCTION


DEFAULT_SYSTEM = "You are a helpful assistant."


def _with_tools(messages: list[dict[str, str]], tools: ToolPrompt) -> list[dict[str, str]]:
    if messages[0]["role"] == "system":
        system = {"role": "system", "content": f"{messages[0]['content']}\n\n{tools.tools_block}"}
        messages = [system] + messages[1:]
    else:
        messages = [{"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{tools.tools_block}"}] \
            + messages
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last_user] = {"role": "user", "content": f"{messages[last_user]['content']}\n"
                                                      f"{tools.answer_instruction}"}
    return messages


def _messages(raw: RawPrompt, prompt_key: str,
              system_prompt: str | None, tools: ToolPrompt | None = None) -> list[dict[str, str]]:
    prompt = raw.prompt
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError(f"row {raw.source_row} of {raw.source_file}: {prompt_key!r} must be a "
                         "string or a list of chat messages {role, content}, got "
                         f"{type(prompt).__name__} {str(prompt)[:80]!r}")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return _with_tools(messages, tools) if tools is not None else messages


def prompt_text(raw: RawPrompt, tokenizer, apply_chat_template: bool = True,
                system_prompt: str | None = None, prompt_key: str = "prompt",
                tools: ToolPrompt | None = None) -> str:
    """The text the model sees for one prompt.

    With ``apply_chat_template``: the tokenizer's chat template over the messages
    (a string prompt becomes one user message, ``system_prompt`` a leading system
    message), ending with the assistant generation prompt. Without: the prompt
    string itself (``system_prompt`` and a blank line before it).
    """
    if apply_chat_template:
        return tokenizer.apply_chat_template(_messages(raw, prompt_key, system_prompt, tools),
                                             add_generation_prompt=True, tokenize=False)
    if tools is not None:
        raise ValueError("megatron_training.prompt_type=qwen_retool needs the chat template: "
                         "set apply_chat_template true")
    if not isinstance(raw.prompt, str):
        raise ValueError(f"row {raw.source_row} of {raw.source_file} holds chat messages but "
                         "apply_chat_template is false; enable it or store plain-text prompts")
    return raw.prompt if system_prompt is None else f"{system_prompt}\n\n{raw.prompt}"


def check_chat_template(tokenizer) -> None:
    """Fail fast when a chat template is asked for and the tokenizer has none."""
    if getattr(tokenizer, "chat_template", None) is None:
        where = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer at {where} has no chat_template; set apply_chat_template "
                         "false to feed the raw prompt text, or add a chat_template to its "
                         "tokenizer_config.json")


def tokenize_prompts(rows: Sequence[RawPrompt], tokenizer, apply_chat_template: bool = True,
                     system_prompt: str | None = None, prompt_key: str = "prompt",
                     progress: bool = False, tools: ToolPrompt | None = None
                     ) -> Iterator[tuple[list[int], str]]:
    """(prompt token ids, prompt text) for each row, in order.

    Pre-tokenized rows pass through. The text is rendered first and then encoded
    with ``add_special_tokens=False`` when a chat template is used (the template
    already holds the special tokens), with the tokenizer's defaults otherwise
    (e.g. a BOS token).
    """
    needs_tokenizer = any(r.prompt_ids is None for r in rows)
    if needs_tokenizer:
        if tokenizer is None:
            raise ValueError(f"{rows[0].source_file} is not pre-tokenized (no "
                             f"{PROMPT_IDS_COLUMN!r} column): a tokenizer is needed")
        if apply_chat_template:
            check_chat_template(tokenizer)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(rows), desc="tokenizing prompts", unit="prompt")
    for start in range(0, len(rows), _TOKENIZE_CHUNK):
        chunk = rows[start:start + _TOKENIZE_CHUNK]
        texts = [r.prompt_text if r.prompt_ids is not None
                 else prompt_text(r, tokenizer, apply_chat_template, system_prompt, prompt_key,
                                  tools)
                 for r in chunk]
        to_encode = [t for r, t in zip(chunk, texts) if r.prompt_ids is None]
        encoded = iter(tokenizer(to_encode, add_special_tokens=not apply_chat_template)["input_ids"]
                       if to_encode else [])
        for r, text in zip(chunk, texts):
            ids = r.prompt_ids if r.prompt_ids is not None else list(next(encoded))
            yield ids, (text if text is not None else _plain_prompt(r))
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()


def _plain_prompt(raw: RawPrompt) -> str:
    # A pre-tokenized file without prompt_text: show the original prompt if there is one.
    return raw.prompt if isinstance(raw.prompt, str) else ""


def load_prompt_dataset(path: str, tokenizer: Any = None, max_prompt_length: int | None = None, *,
                        prompt_key: str = "prompt", answer_key: str | None = "answer",
                        apply_chat_template: bool = True, system_prompt: str | None = None,
                        seed: int = 1234, shuffle: bool = True,
                        data_path_key: str = "megatron_training.data_path",
                        tools: ToolPrompt | None = None,
                        cut_to: int | None = None) -> PromptDataset:
    """Read, template, tokenize and length-filter the prompts of ``path``.

    path: a .jsonl/.json/.parquet file or a directory of them (module docstring).
    tokenizer: a transformers tokenizer (None only for pre-tokenized files).
    max_prompt_length: prompts with more tokens are dropped and counted
      (``PromptDataset.num_dropped``, and a log line); None keeps all.
    seed, shuffle: the data order (``PromptDataset``).
    data_path_key: the config key named in the file errors
      (e.g. ``megatron_training.test_data_path`` for the test set).
    tools: the tool description of ``prompt_type: qwen_retool`` (:class:`ToolPrompt`).
    cut_to: the kept prompts longer than this are cut to their first ``cut_to`` tokens
      (MindSpeed-RL reads its prompt data cut to ``seq_length``); None cuts nothing.
    """
    rows = read_prompt_rows(path, prompt_key, answer_key, data_path_key)
    if not rows:
        raise ValueError(f"data file {path} has no rows; set {data_path_key}")
    if rows[0].answer_ids is not None:   # indexed dataset: answers (and texts) as token ids
        if tokenizer is None:
            raise ValueError(f"{path}: decoding the indexed dataset's answers needs a tokenizer")
        rows = [dataclasses.replace(
            r, answer=tokenizer.decode(r.answer_ids, skip_special_tokens=True),
            prompt_text=tokenizer.decode(r.prompt_ids)) for r in rows]
    items: list[PromptItem] = []
    num_dropped = num_cut = 0
    for raw, (ids, text) in zip(rows, tokenize_prompts(rows, tokenizer, apply_chat_template,
                                                        system_prompt, prompt_key,
                                                        tools=tools)):
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            num_dropped += 1
            continue
        if cut_to is not None and len(ids) > cut_to:
            ids = list(ids[:cut_to])
            num_cut += 1
            text = tokenizer.decode(ids) if tokenizer is not None else text
        items.append(PromptItem(prompt_ids=ids, answer=raw.answer, prompt_text=text,
                                source_row=raw.source_row, source_file=raw.source_file))
    if not items:
        raise ValueError(f"all {len(rows)} prompts of {path} are longer than "
                         f"max_prompt_length={max_prompt_length} tokens; raise "
                         "rl_config.max_prompt_length")
    log = logger.warning if num_dropped else logger.info
    log("%s: %d prompts kept, %d dropped as longer than max_prompt_length=%s tokens%s",
        path, len(items), num_dropped, max_prompt_length,
        f", {num_cut} cut to seq_length={cut_to}" if cut_to is not None else "")
    return PromptDataset(items, seed=seed, shuffle=shuffle, num_dropped=num_dropped, source=path)

"""Prompt data: reading and tokenizing prompt files, the resumable prompt dataset,
the preference pairs of DPO, and the synthetic arithmetic set."""

from mindspeed_rl.data.arithmetic import make_arithmetic_problems, write_jsonl
from mindspeed_rl.data.pairwise import PairItem, load_pair_dataset
from mindspeed_rl.data.prompt_dataset import PromptDataset, PromptItem, slice_per_dp_rank
from mindspeed_rl.data.prompts import (PROMPT_IDS_COLUMN, PROMPT_TEXT_COLUMN, RawPrompt,
                                       ToolPrompt, check_chat_template, data_files, load_prompt_dataset,
                                       prompt_text, read_prompt_rows, tokenize_prompts)

__all__ = [
    "PROMPT_IDS_COLUMN", "PROMPT_TEXT_COLUMN", "PairItem", "PromptDataset", "PromptItem",
    "RawPrompt", "ToolPrompt", "check_chat_template", "data_files", "load_pair_dataset",
    "load_prompt_dataset", "make_arithmetic_problems", "prompt_text", "read_prompt_rows",
    "slice_per_dp_rank", "tokenize_prompts", "write_jsonl",
]

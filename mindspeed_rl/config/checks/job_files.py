"""Checks that read the disk, run by a launch and not by the dry run (`check_data_files`
runs them all): the data files and the expert map exist, the output folders can be written,
the tokenizer fits the model's embedding, and the tool sandbox runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from mindspeed_rl.config.checks.tool_turns import TOOL_PROMPT_TYPES, check_tool_sandbox
from mindspeed_rl.config.config_error import ConfigError, require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_data_files(config: RLJobConfig) -> None:
    """The data files exist and the output folders are writable (not needed, and not
    checked, by the dry-run)."""
    mt = config.megatron_training
    require(mt.tokenizer_name_or_path is not None, "megatron_training.tokenizer_name_or_path",
            None, "not set, and the model names no tokenizer", "set it to the HF directory "
            "holding the tokenizer files")
    for key, value in (("megatron_training.data_path", mt.data_path),
                       ("megatron_training.test_data_path", mt.test_data_path)):
        if value is not None and not Path(value).exists() and not _indexed_prefix(value):
            raise ConfigError(key, "no such file, directory or indexed-dataset prefix",
                              "check the path (relative paths resolve against the current "
                              f"working directory, {os.getcwd()})", value=value)
    expert_map = config.generate_config.expert_map_path
    require(expert_map is None or Path(expert_map).is_file(), "generate_config.expert_map_path",
            expert_map, "no such file", "check the path (relative paths resolve against the "
            f"current working directory, {os.getcwd()})")
    if config.features.multi_turn and mt.prompt_type is None:
        require(_indexed_prefix(mt.data_path), "megatron_training.prompt_type", None,
                f"multi_turn_enable with the raw prompts of {mt.data_path}: the tokenizer's "
                "chat template alone does not tell the model its tools", "set prompt_type: "
                f"{TOOL_PROMPT_TYPES[0]}, or train on data preprocessed with a tool template")
    check_output_dirs(config)
    check_tokenizer_fits(config)
    check_tool_sandbox(config)


def _indexed_prefix(path: str) -> bool:
    """A MindSpeed-RL packed indexed dataset prefix (P_packed_input_ids_document.idx)."""
    return Path(f"{path}_packed_input_ids_document.idx").is_file()


def check_output_dirs(config: RLJobConfig) -> None:
    """``log_dir`` and ``save`` can be written (checked before any rank starts work, so a
    bad path fails at once on every rank instead of on rank 0 mid-run).

    Nothing is created: the nearest existing folder must be a directory where a file
    can be made (a probe file is created and removed at once, which also catches
    read-only file systems and immutable folders, where permission bits say nothing).
    """
    import tempfile

    for key, value in (("megatron_training.log_dir", config.megatron_training.log_dir),
                       ("actor_config.save", config.actor_config.save)):
        if not value:
            continue
        path = Path(value)
        if path.exists() and not path.is_dir():
            raise ConfigError(key, "exists and is not a directory",
                              "point it to a directory, or move the file away", value=value)
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(key, f"cannot be created: {existing} is a file",
                              "point it below a directory", value=value)
        try:
            fd, probe = tempfile.mkstemp(prefix=".mindspeed_rl_probe_", dir=existing)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(key, f"cannot write in {existing} ({exc.strerror})",
                              "choose a writable directory", value=value) from None


def check_tokenizer_fits(config: RLJobConfig) -> None:
    """Every token id of the tokenizer has a row in the model's embedding (a local tokenizer
    only; a hub id is checked when it is loaded)."""
    mt, model = config.megatron_training, config.model
    source = mt.tokenizer_name_or_path or model.hf_dir
    own = model.hf_dir is not None and Path(source) == Path(model.hf_dir)  # the model's own
    key = "megatron_training.model" if own else "megatron_training.tokenizer_name_or_path"
    if not source or not Path(source).is_dir():
        return
    from transformers import AutoTokenizer

    try:
        num_tokens = len(AutoTokenizer.from_pretrained(source))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; name the folder
        raise ConfigError(key, f"the tokenizer in {source} cannot be loaded ({exc})",
                          "point it to a folder with tokenizer.json or tokenizer_config.json",
                          value=source) from None
    if num_tokens > model.vocab_size:
        raise ConfigError(
            key, f"the tokenizer in {source} has {num_tokens} tokens but the model's "
            f"vocab_size is {model.vocab_size} ({model.source}): ids >= {model.vocab_size} "
            "have no embedding", "use the tokenizer the model was trained with, or a model "
            "whose vocab_size covers it", value=source)

"""`load_config`: YAML file + dotted command-line overrides -> a validated `RLJobConfig`.

Everything here runs before torch.distributed is initialised and reads no
weights, so a bad config fails identically and at once on every rank.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from mindspeed_rl.algorithms import registry
from mindspeed_rl.config.checks import check_job
from mindspeed_rl.config.checks.job_files import check_data_files
from mindspeed_rl.config.checks.length_budgets import response_cut_warning
from mindspeed_rl.config.checks.training_features import check_runnable
from mindspeed_rl.config.config_error import ConfigError, did_you_mean
from mindspeed_rl.config.mindspeed_keys import UNDERSCORED_SECTIONS
from mindspeed_rl.config.model_spec import ModelSpec, read_model_spec, resolve_model_source
from mindspeed_rl.config.normalise import normalise
from mindspeed_rl.config.preference import resolve_pairs_rl
from mindspeed_rl.config.profiling import profiler_notices
from mindspeed_rl.config.schema import OPTIONAL_SECTIONS, SECTIONS, RLJobConfig
from mindspeed_rl.config.typed_sections import build_section, field_types, nested_section_type
from mindspeed_rl.config.yaml_source import parse_yaml_scalar, read_yaml_file

_OVERRIDE = "command-line override"



def load_config(path: str | os.PathLike, overrides: Sequence[str] = (), *,
                check_data: bool = True, algorithm: str = "grpo") -> RLJobConfig:
    """Load and validate a job config.

    ``overrides`` are ``dotted.key=value`` strings (values parsed as YAML
    scalars: ``8``, ``1e-6``, ``true``, ``[a, b]``) applied on top of the file.
    Relative paths (model, data, checkpoint and log directories) resolve
    against the current working directory. The model's architecture fields are
    always read (config.json or model yaml); data files are checked only when
    ``check_data`` (the dry-run passes False: it needs no data and no weights), which also
    refuses what the dry run plans but a launch cannot run yet
    (`training_features.check_runnable`).
    ``algorithm`` is the launcher's (``grpo`` or ``ppo``): it resolves
    ``rl_config.adv_estimator`` and decides which optional sections are required.

    Checks here do not depend on the world size; ``make_plan(config, world_size)``
    adds the layout and batch-divisibility checks.

    Raises:
        ConfigError: naming the dotted key, the value and the fix.
    """
    if isinstance(overrides, str):   # a lone "k=v" would otherwise be read letter by letter
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    config_path = Path(path).expanduser().absolute()
    raw = read_yaml_file(config_path, "--config")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("--config", f"{config_path} must hold a mapping of sections "
                          f"({', '.join(SECTIONS)}), not a {type(raw).__name__}",
                          "start the file with 'megatron_training:'", value=str(path))
    registry.algorithm(algorithm)  # a launcher's own name: ValueError when unknown
    present = {name for name in raw if name in OPTIONAL_SECTIONS}  # written, even if empty
    normalised = normalise(raw, config_path.name, algorithm)
    present -= normalised.dropped_sections
    raw = normalised.sections

    overridden = apply_overrides(raw, overrides)
    present |= {key.split(".")[0] for key in overridden}
    elsewhere = _dotted_key_index()
    sections = {name: (build_section(cls, raw[name], name, overridden=overridden,
                                     elsewhere=elsewhere)
                       if name not in OPTIONAL_SECTIONS or name in present else None)
                for name, cls in SECTIONS.items()}

    notices = list(normalised.notices)
    model = _with_model(sections, raw, normalised, config_path, overridden, elsewhere, notices,
                        need_tokenizer=check_data)
    warnings: list[str] = []
    sections["rl_config"] = _resolved_rl(sections, algorithm, config_path, warnings)
    if "pairs" in registry.algorithm(algorithm).always:  # DPO (config/preference.py)
        sections["rl_config"] = resolve_pairs_rl(sections["rl_config"], raw["rl_config"],
                                                 sections["actor_config"].micro_batch_size)
    notices += _gspo_notice(sections["rl_config"]) + _npu_only_notices(sections)
    notices += profiler_notices(sections["profiler_config"].integrated)
    warnings += _prompt_cut_warning(sections)
    for name in OPTIONAL_SECTIONS:
        if sections[name] is not None:
            sections[name] = _resolve_paths(sections[name])
    sections["profiler_config"] = _resolved_profiler(sections["profiler_config"])

    config = RLJobConfig(**sections, model=model, config_path=str(config_path),
                         algorithm=algorithm, notices=tuple(notices), warnings=tuple(warnings))
    config = dataclasses.replace(config, warnings=config.warnings + tuple(
        response_cut_warning(config)))   # it reads the job's features
    config = _prefix_caching_for_r3(config, "enable_prefix_caching" in raw["generate_config"])
    check_job(config)
    if check_data:
        check_runnable(config)
        check_data_files(config)
    return config


def _with_model(sections: dict, raw: dict, normalised, config_path: Path, overridden,
                elsewhere, notices: list[str], need_tokenizer: bool) -> ModelSpec:
    """Read the model (config.json or model yaml): its training keys fill the sections
    where the file left them out, architecture keys of the job are checked against it; the
    model path and tokenizer resolve. Returns the model."""
    megatron = sections["megatron_training"]
    model_path, is_hf_dir = resolve_model_source(megatron.model, config_path.parent)
    model = read_model_spec(model_path, is_hf_dir, job_architecture=normalised.architecture,
                            notices=notices)
    for dotted, value in model.job_settings:   # training keys of a MindSpeed-RL model yaml
        section, key = dotted.split(".")
        if key not in raw[section]:
            sections[section] = build_section(SECTIONS[section], {**raw[section], key: value},
                                              section, overridden=overridden,
                                              elsewhere=elsewhere)
    declared = normalised.declared_num_layers
    if declared is not None and declared != model.num_hidden_layers:
        raise ConfigError("actor_config.num_layers", f"the model ({model_path.name}) has "
                          f"{model.num_hidden_layers} layers", "remove num_layers, or list the "
                          "padding layers in noop_layers", value=declared)
    megatron = sections["megatron_training"]   # with the model yaml's training keys
    tokenizer = megatron.tokenizer_name_or_path
    if tokenizer is None:
        tokenizer = str(model_path) if is_hf_dir else model.tokenizer_name_or_path
    if tokenizer is None:
        missing = ConfigError("megatron_training.tokenizer_name_or_path", "not set, and the "
                              f"model yaml {model_path.name} names no tokenizer_name_or_path",
                              "set it to the HF directory holding the tokenizer files")
        if need_tokenizer:
            raise missing
        # MindSpeed-RL's early configs ship it blank for the user to fill in; the dry run
        # reads no tokenizer, a run does (check_data_files refuses it then).
        notices.append(f"{missing.key}: not set: the dry run reads no tokenizer, a run needs "
                       "one (set it to the HF directory holding the tokenizer files)")
    sections["megatron_training"] = dataclasses.replace(
        _resolve_paths(megatron), model=str(model_path),
        tokenizer_name_or_path=_resolve_tokenizer(tokenizer) if tokenizer else None)
    sections["actor_config"] = _resolve_paths(sections["actor_config"])
    sections["ref_config"] = _resolve_paths(sections["ref_config"])
    sections["generate_config"] = _resolve_paths(sections["generate_config"])
    return model


def _resolved_rl(sections: dict, algorithm: str, config_path: Path, warnings: list[str]):
    """rl_config with the defaults that depend on other keys: the mini-batch (the global
    batch) and the advantage estimator (the launcher's algorithm)."""
    rl = sections["rl_config"]
    gbs = sections["megatron_training"].global_batch_size
    if rl.mini_batch_size is None:
        rl = dataclasses.replace(rl, mini_batch_size=gbs)
    elif rl.mini_batch_size > gbs > 0:
        # MindSpeed-RL splits each data-parallel rank's share into mini-batches of
        # mini_batch_size: a larger one leaves the whole batch as one mini-batch.
        warnings.append(f"rl_config.mini_batch_size={rl.mini_batch_size} is larger than "
                        f"megatron_training.global_batch_size={gbs}: one mini-batch of all "
                        f"{gbs} prompts (one optimizer step per epoch), as MindSpeed-RL runs it; "
                        f"set mini_batch_size: {gbs} to say so")
        rl = dataclasses.replace(rl, mini_batch_size=gbs)
    return dataclasses.replace(rl, adv_estimator=_resolved_estimator(rl.adv_estimator,
                                                                     algorithm, config_path))


def _resolved_estimator(name: str | None, algorithm: str, config_path: Path) -> str:
    """rl_config.adv_estimator's registered name (an alias resolved; null: the family's
    default), or a ConfigError naming the estimators the launcher runs."""
    family = registry.algorithm(algorithm)
    if name is None:
        return family.default_estimator
    own = [e.name for e in registry.estimators(algorithm)]
    chosen = registry.estimator(str(name))
    if chosen is not None and algorithm in chosen.algorithms:
        return chosen.name
    runs = (f"{family.launcher} runs {algorithm.upper()}, whose estimator is "
            f"{family.default_estimator}" + (f" (or {', '.join(own[1:])})" if own[1:] else ""))
    if chosen is None:
        raise ConfigError("rl_config.adv_estimator", f"is not an advantage estimator: {runs}",
                          f"use one of {own} (or leave it out)", value=name,
                          origin=str(config_path))
    missing = sorted(chosen.needs - family.builds)
    other = registry.algorithm(chosen.algorithms[0])
    why = f"{chosen.name} needs a {' and a '.join(missing)}, which {family.launcher} does " \
          "not build; " if missing else ""
    raise ConfigError("rl_config.adv_estimator", why + runs,
                      f"launch {other.launcher} for {chosen.name}, or use one of {own} "
                      "(or leave it out)", value=name, origin=str(config_path))


def _prompt_cut_warning(sections: dict) -> list[str]:
    """MindSpeed-RL reads prompts cut to seq_length tokens (after dropping those longer than
    max_prompt_length); a seq_length below max_prompt_length cuts the longer ones."""
    seq, prompt = sections["megatron_training"].seq_length, sections["rl_config"].max_prompt_length
    if not 0 < seq < prompt:
        return []
    return [f"megatron_training.seq_length={seq} is shorter than rl_config.max_prompt_length="
            f"{prompt}: prompts longer than {seq} tokens are cut to their first {seq} tokens "
            f"(those longer than {prompt} dropped first), as MindSpeed-RL reads its prompt data; "
            f"raise seq_length to {prompt} to keep whole prompts"]


def _prefix_caching_for_r3(config: RLJobConfig, written: bool) -> RLJobConfig:
    """router_replay R3 records the experts of every prompt token as vLLM computes them, and
    a cached prefix is not computed again: a job that asks for R3 runs without prefix caching
    (a notice; a warning when the file or an override turned it on)."""
    if not (config.features.replays_rollout_routing
            and config.generate_config.enable_prefix_caching):
        return config
    line = ("generate_config.enable_prefix_caching=true" + ("" if written else " (the default)")
            + ": turned off for rl_config.router_replay R3, which records the experts of every "
            "prompt token as vLLM computes them (a cached prefix is not computed again, so it "
            "would have no routes); prefix caching only saves prefill time")
    generate = dataclasses.replace(config.generate_config, enable_prefix_caching=False)
    if written:
        return dataclasses.replace(config, generate_config=generate,
                                   warnings=config.warnings + (line,))
    return dataclasses.replace(config, generate_config=generate, notices=config.notices + (line,))


def _npu_only_notices(sections: dict) -> list[str]:
    """Keys vLLM honours on one platform only: what they do, said once (with the plan)."""
    path = sections["generate_config"].expert_map_path
    if path is None:
        return []
    return [f"generate_config.expert_map_path={path}: vllm-ascend's expert map (EPLB), NPU "
            "only: passed to vLLM on NPU; vLLM on CUDA and CPU has no expert map and keeps its "
            "own expert placement (the same tokens are generated)"]


def _gspo_notice(rl) -> list[str]:
    if rl.policy_loss == "gspo" and rl.loss_agg_mode not in (None, "seq-mean-token-mean"):
        return [f"rl_config.loss_agg_mode={rl.loss_agg_mode} with policy_loss: gspo: GSPO is "
                "defined with seq-mean-token-mean (leave loss_agg_mode out for it); running "
                "the mode you set"]
    return []


def _dotted_key_index() -> dict[str, str]:
    """Every key of the schema -> its dotted name (for 'it belongs elsewhere' hints)."""
    index: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, tp in field_types(cls).items():
            nested = nested_section_type(tp)
            if nested is not None:
                walk(nested, f"{prefix}.{name}")
            else:
                index.setdefault(name, f"{prefix}.{name}")

    for section, cls in SECTIONS.items():
        walk(cls, section)
    return index


# ---- overrides ----------------------------------------------------------------------------

def parse_override(text: str) -> tuple[str, Any]:
    """``"rl_config.n_samples_per_prompt=8"`` -> ``("rl_config.n_samples_per_prompt", 8)``."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(None, f"command-line argument {text!r} is not a dotted.key=value "
                          "override", "write e.g. rl_config.n_samples_per_prompt=8")
    try:
        value = parse_yaml_scalar(value_text)
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value {value_text!r} is not valid YAML ({e.problem})",
                          "quote strings with special characters, write lists as [a, b]",
                          origin=_OVERRIDE) from None
    return key, value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> frozenset[str]:
    """Write each override into the parsed YAML ``raw``; return the dotted keys overridden.

    Keys are checked against the schema here (not against the file) so an
    override may set a key the file leaves at its default, but never a key
    that does not exist.
    """
    overridden = set()
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        if parts[0] in UNDERSCORED_SECTIONS and len(parts) > 1:  # '-' read as '_', as in a file
            parts[1] = parts[1].replace("-", "_")
            key = ".".join(parts)
        if parts[0] not in SECTIONS:
            hint = did_you_mean(parts[0], SECTIONS) or f"sections are: {', '.join(SECTIONS)}"
            raise ConfigError(key, "unknown section", hint, origin=_OVERRIDE)
        if len(parts) == 1:
            raise ConfigError(key, "is a section, not a key",
                              f"override one of its keys, e.g. {key}.<key>=value", origin=_OVERRIDE)
        cls, node = SECTIONS[parts[0]], raw
        for depth, part in enumerate(parts[1:], start=1):
            parent = ".".join(parts[:depth])
            node = _child_mapping(node, parts[depth - 1], parent)
            types_ = field_types(cls)
            if part not in types_:
                hint = did_you_mean(part, types_, f"{parent}.") or (
                    f"known keys: {', '.join(sorted(types_))}")
                raise ConfigError(".".join(parts[:depth + 1]), "unknown key", hint,
                                  origin=_OVERRIDE)
            nested = nested_section_type(types_[part])
            last = depth == len(parts) - 1
            if nested is not None and last:
                raise ConfigError(key, "is a section, not a key",
                                  f"override one of its keys, e.g. {key}.<key>=value",
                                  origin=_OVERRIDE)
            if nested is None and not last:
                raise ConfigError(key, f"{parent}.{part} is a key, not a section",
                                  f"write {parent}.{part}=value", origin=_OVERRIDE)
            cls = nested or cls
        node[parts[-1]] = value
        overridden.add(key)
    return frozenset(overridden)


def _child_mapping(node: dict, name: str, dotted: str) -> dict:
    child = node.get(name)
    if child is None:
        child = node[name] = {}
    if not isinstance(child, dict):
        raise ConfigError(dotted, "must be a section (mapping) to take an override",
                          "fix the config file", value=child)
    return child


# ---- paths --------------------------------------------------------------------------------

def _resolve_paths(section):
    """Make the section's path keys absolute against the current working directory.

    Megatron users launch from the directory their relative paths refer to;
    absolute paths keep meaning the same if anything later changes directory.
    """
    changes = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.metadata.get("path") and isinstance(value, str):
            changes[f.name] = str(Path(value).expanduser().absolute())
    return dataclasses.replace(section, **changes)


def _resolved_profiler(section):
    """``profile_save_path`` absolute; MindSpeed-RL's empty default is null (the log folder)."""
    settings = section.integrated
    if not settings.profile_save_path:
        settings = dataclasses.replace(settings, profile_save_path=None)
    return dataclasses.replace(section, integrated=_resolve_paths(settings))


def _resolve_tokenizer(value: str) -> str:
    """A tokenizer that exists locally (or is written as a path) becomes absolute; anything
    else is left as an HF hub id."""
    path = Path(value).expanduser()
    if path.exists() or value.startswith((".", "/", "~")):
        return str(path.absolute())
    return value

"""Applying the MindSpeed-RL key table to a parsed config file, every problem at once.

`normalise` turns the file's mapping into the schema's sections: keys of the schema stay,
Megatron keys move to the section that holds them here (MindSpeed-RL merges
``megatron_training`` into ``actor_config``), older names are rewritten, keys that do not
apply become notices. Unknown keys and values this project cannot honour are collected
and raised as one `ConfigErrors`, so a user fixes a file in one pass.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from mindspeed_rl.config.config_error import ConfigError, ConfigErrors, show_value
from mindspeed_rl.algorithms import registry
from mindspeed_rl.config.megatron_model_yaml import MEGATRON_TO_HF
from mindspeed_rl.config.model_spec import IMPLIED_SWITCHES
from mindspeed_rl.config.mindspeed_keys import (FAMILY_SECTIONS, GENERATE, HONOURED, MEGATRON,
                                                NOT_APPLICABLE, RL, SAMPLING, TOP, TRANSLATED,
                                                UNDERSCORED_SECTIONS, family_of,
                                                known_names, not_applicable_error,
                                                notice_line, row, typo_hint, underscored)
from mindspeed_rl.config.schema import SECTIONS, RLConfig, SamplingConfig

_MEGATRON_SCHEMA_SECTIONS = ("megatron_training", "actor_config")


@dataclass
class Normalised:
    """The file rewritten into the schema's sections, and what the rewrite found."""

    sections: dict[str, dict[str, Any]]
    notices: list[str] = field(default_factory=list)
    defaults_models: list[str] = field(default_factory=list)
    # megatron num_layers written without noop_layers: must equal the model's layers
    declared_num_layers: int | None = None
    # MindSpeed-RL's separate-worker format (reference and reward model on NPUs of their own)
    separate_workers: bool = False
    # optional sections the file writes but MindSpeed-RL would not build (left out here)
    dropped_sections: set[str] = field(default_factory=set)
    # architecture keys written in a job section (MindSpeed-RL merges them over the model
    # yaml): Megatron name -> (dotted key, value), checked against the model by the loader
    architecture: dict[str, tuple[str, Any]] = field(default_factory=dict)
    # ref_config keys of the separate-worker format: key -> value
    reference_layout: dict[str, Any] = field(default_factory=dict)
    # keys only MindSpeed-RL before 2025-05-15 had: the file counts mini_batch_size in
    # responses, as MindSpeed-RL did then
    dated_by: list[str] = field(default_factory=list)
    written: dict[str, Any] = field(default_factory=dict)   # the file as parsed ('-' as '_')
    # keys written with '-' (read as '_'): "section.key" -> "section.key-as-written"
    spellings: dict[str, str] = field(default_factory=dict)


def _fields(section: str) -> set[str]:
    cls = SamplingConfig if section == SAMPLING else SECTIONS[section]
    return {f.name for f in dataclasses.fields(cls)}


# Keys only MindSpeed-RL before 2025-05-15 had; rl_config.mini_batch_size counted responses
# until then (prompts since): a file holding one of them is read in those units.
_RESPONSES_ERA = {(RL, "experience_count"), (RL, "experience_count_actor"),
                  (RL, "experience_count_ref"), (RL, "experience_count_reward"),
                  (RL, "experience_count_rule_reward"), (RL, "colocate_actor_ref"),
                  (RL, "colocate_all_models"), (GENERATE, "micro_batch_size")}
_RESOURCES = ("actor_resource", "reference_resource", "reward_resource")


def normalise(raw: dict, file_name: str, algorithm: str = "grpo") -> Normalised:
    """Rewrite a parsed config (MindSpeed-RL's format or this project's) into the schema.

    Raises:
        ConfigErrors: listing every unknown key and every value that cannot be honoured.
    """
    out = Normalised({name: {} for name in SECTIONS})
    problems: list[ConfigError] = []
    translated: dict[str, tuple[str, Any]] = {}   # key -> (dotted where written, value)
    raw = out.written = _underscored_sections(raw, out, problems)
    out.separate_workers = _separate_workers(raw.get("rl_config"), problems)

    _top_level(raw, file_name, out, problems)
    _sections(raw, out, problems, translated)
    _stage(translated.pop("stage", None), algorithm, out, problems)
    _translate(out, problems, translated)
    if problems:
        raise ConfigErrors(problems, file_name)
    return out


def _underscored_sections(raw: dict, out: Normalised, problems: list) -> dict:
    """The file with '-' in the keys of MindSpeed-RL's sections read as '_', as its config
    classes read them (``mindspeed_keys.underscored``)."""
    raw = dict(raw)
    for section in UNDERSCORED_SECTIONS:
        if isinstance(raw.get(section), dict):
            raw[section], spelled = underscored(raw[section], section, problems, out.notices)
            out.spellings.update({f"{section}.{key}": f"{section}.{written}"
                                  for key, written in spelled.items()})
    return raw


def _top_level(raw: dict, file_name: str, out: Normalised, problems: list) -> None:
    """The keys beside the sections: ``defaults`` (Hydra's model list), MindSpeed-RL's
    top-level settings, and unknown sections."""
    for name, value in raw.items():
        if name in SECTIONS:
            continue
        r = row(TOP, name)
        if name == "defaults":
            out.defaults_models = _defaults_models(value, problems)
        elif r is None:
            fix = typo_hint(str(name), list(SECTIONS) + known_names(TOP)) or (
                f"sections are: {', '.join(SECTIONS)}")
            problems.append(ConfigError(str(name), f"unknown section in {file_name}", fix))
        elif not r.accepts(value):
            problems.append(ConfigError(str(name), f"cannot be honoured here: {r.detail}",
                                        f"remove the section ({r.needs})"))
        else:
            out.notices.append(f"{name}: {r.detail}")


def _sections(raw: dict, out: Normalised, problems: list, translated: dict) -> None:
    """Every key of every section, placed under today's name (or refused)."""
    for section in ("megatron_training", "actor_config", "ref_config", "rl_config",
                    "generate_config", "critic_config", "reward_config"):
        body = raw.get(section)
        if body is None:
            continue
        if not isinstance(body, dict):
            problems.append(ConfigError(section, f"expected a mapping of keys (section), got "
                                        f"{type(body).__name__}", f"write '{section}:' followed "
                                        "by indented key: value lines", value=body))
            continue
        if section == "reward_config" and out.separate_workers and not _has(
                raw.get("rl_config"), "reward_resource"):
            # MindSpeed-RL builds a reward-model worker only with reward_resource.
            out.dropped_sections.add(section)
            out.notices.append("reward_config: not read: without rl_config.reward_resource "
                               "MindSpeed-RL's separate-worker format builds no reward model "
                               "from it")
            continue
        for key, value in body.items():
            if section == "generate_config" and key == "sampling_config" and isinstance(
                    value, dict):
                sampling = out.sections["generate_config"].setdefault("sampling_config", {})
                for skey, svalue in value.items():
                    _place(out, problems, translated, "generate_config.sampling_config",
                           str(skey), svalue, sampling)
                continue
            _place(out, problems, translated, section, str(key), value,
                   out.sections[section])
    for section in ("teacher_config", "profiler_config"):  # read as written (schema keys)
        if isinstance(raw.get(section), dict):
            out.sections[section] = copy.deepcopy(raw[section])


def _stage(stage, algorithm: str, out: Normalised, problems: list) -> None:
    """``rl_config.stage`` (MindSpeed-RL's trainer name) against the launcher's algorithm."""
    if stage is None or stage[1] is None:
        return
    wanted = registry.algorithm_of_stage(stage[1])
    launcher = registry.algorithm(algorithm).launcher
    if wanted is None:
        problems.append(ConfigError(stage[0], "is not a stage this project runs",
                                    f"use one of {registry.stages()}", value=stage[1]))
    elif wanted.name != algorithm:
        problems.append(ConfigError(stage[0], f"cannot be honoured here: "
                                    f"{launcher} runs {algorithm.upper()}",
                                    f"launch {wanted.launcher} for {stage[1]}",
                                    value=stage[1]))
    elif stage[1] == "ray_dapo":
        _dapo_without_reference(out, stage)
    else:
        out.notices.append(f"{stage[0]}={show_value(stage[1])}: the launcher "
                           f"{launcher} runs it")
    if stage[1] == "ray_dapo" and out.sections["rl_config"].get("share_backbone"):
        problems.append(ConfigError("rl_config.share_backbone", "DAPO has no reference "
                                    f"model to share the backbone with ({stage[0]}="
                                    f"{show_value(stage[1])}), as MindSpeed-RL refuses",
                                    "set share_backbone: false", value=True))


def _separate_workers(rl: Any, problems: list) -> bool:
    """MindSpeed-RL's separate-worker format: ``use_integrated_worker`` false, or left out
    next to its resource keys (its default was false)."""
    if not isinstance(rl, dict):
        return False
    integrated = rl.get("use_integrated_worker")
    if integrated is not None and not isinstance(integrated, bool):
        problems.append(_not_a_flag("rl_config.use_integrated_worker", integrated))
        return False
    return integrated is False or (integrated is None and any(_has(rl, k) for k in _RESOURCES))


def _not_a_flag(dotted: str, value: Any) -> ConfigError:
    """A MindSpeed-RL switch given something other than true or false."""
    return ConfigError(dotted, "expected true or false",
                       f"e.g. {dotted.rsplit('.', 1)[-1]}: true", value=value)


def _has(section: Any, key: str) -> bool:
    return isinstance(section, dict) and section.get(key) is not None


def _dapo_without_reference(out: Normalised, stage: tuple[str, Any]) -> None:
    """MindSpeed-RL's DAPO trainer builds no reference model: no KL term."""
    rl = out.sections["rl_config"]
    kl = rl.get("init_kl_coef")
    if kl not in (None, 0):
        out.notices.append(f"rl_config.init_kl_coef={show_value(kl)}: not read: MindSpeed-RL's "
                           f"DAPO ({stage[0]}='ray_dapo') has no reference model")
    rl["init_kl_coef"] = 0.0
    out.notices.append(f"{stage[0]}='ray_dapo': the launcher pretrain_grpo.py runs it, without "
                       "a reference model (rl_config.init_kl_coef=0), as MindSpeed-RL's DAPO")


def _place(out: Normalised, problems: list, translated: dict, section: str, key: str,
           value: Any, target: dict) -> None:
    dotted = f"{section}.{key}"
    dotted = out.spellings.get(dotted, dotted)   # named as written
    family = family_of(section)
    if section == "ref_config":
        _place_reference_key(out, problems, key, value, target, dotted)
        return
    if section == "reward_config" and out.separate_workers and key in _LAYOUT:
        # the reward model's own NPUs and layout in MindSpeed-RL: co-located here
        out.notices.append(f"{dotted}={show_value(value)}: the reward model's layout on NPUs "
                           "of its own (MindSpeed-RL's separate workers, rl_config."
                           "reward_resource); here it runs on the actor's ranks in the actor's "
                           "layout, which computes the same scores")
        return
    if key in _fields(section):
        target[key] = value
        return
    if section in _ROLE_SECTIONS:
        _place_role_key(out, problems, section, key, value, dotted)
        return
    if (family, key) in _RESPONSES_ERA:
        out.dated_by.append(dotted)
    if section in _MEGATRON_SCHEMA_SECTIONS and (key in MEGATRON_TO_HF or key in IMPLIED_SWITCHES) \
            and key != "num_layers" and value is not None:
        # MindSpeed-RL merges megatron_training over the model yaml: the loader checks the
        # value against the model (one architecture for training and vLLM).
        out.architecture[key] = (dotted, value)
        return
    if family == MEGATRON:
        for sibling in _MEGATRON_SCHEMA_SECTIONS:
            if sibling != section and key in _fields(sibling):
                _merge_megatron(out, problems, sibling, key, value, dotted)
                return
    r = row(family, key) if family else None
    if r is None:
        problems.append(_unknown(dotted, key, section, family))
    elif r.handling == TRANSLATED:
        translated[key] = (dotted, value)
    elif r.handling == HONOURED:   # a table row without its schema key: a bug of the table
        raise AssertionError(f"{dotted} is listed as honoured but the schema has no such key")
    elif r.accepts(value):
        out.notices.append(notice_line(dotted, value, r))
    else:
        problems.append(not_applicable_error(dotted, value, r))


# MindSpeed-RL's critic_config / reward_config are whole Megatron configs of their own; here
# those roles run inside the actor's job, so only their own keys are read.
_ROLE_SECTIONS = ("critic_config", "reward_config")
_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size")


def _place_reference_key(out: Normalised, problems: list, key: str, value: Any,
                         target: dict, dotted: str) -> None:
    """ref_config: ``load`` (and ``model``, the actor's); in MindSpeed-RL's separate-worker
    format also the reference worker's own Megatron settings (its layout, micro-batch)."""
    if key == "load" or key in _LAYOUT and value is None:  # null layout: the actor's
        target[key] = value
        return
    if key == "model":
        model = out.sections["megatron_training"].get("model")
        if model is not None and model != value:
            problems.append(ConfigError(dotted, f"differs from megatron_training.model="
                                        f"{show_value(model)}", "the reference is the "
                                        "starting policy: remove the key", value=value))
        return
    if not (row(MEGATRON, key) or key in _fields("megatron_training")
            or key in _fields("actor_config")):
        problems.append(_unknown(dotted, key, "ref_config", MEGATRON))
    elif not out.separate_workers:
        problems.append(ConfigError(dotted, "the reference model runs in the actor's layout "
                                    "and settings here (MindSpeed-RL's integrated worker, which "
                                    "refuses ref_config too); only ref_config.load is read",
                                    "remove the key", value=value))
    else:
        out.reference_layout[key] = value


def _place_role_key(out: Normalised, problems: list, section: str, key: str,
                    value: Any, dotted: str) -> None:
    if key == "model" and section == "critic_config":
        model = out.sections["megatron_training"].get("model")
        if model is not None and model != value:
            problems.append(ConfigError(dotted, f"differs from megatron_training.model="
                                        f"{show_value(model)}", "the critic shares the actor's "
                                        "architecture here (its weights come from "
                                        "critic_config.load): remove the key", value=value))
        return
    if key == "model":   # the reward model's architecture is its checkpoint's config.json
        out.notices.append(f"{dotted}: the reward model's architecture is read from the "
                           "config.json of reward_config.load")
        return
    if key in _fields("megatron_training") or key in _fields("actor_config"):
        out.notices.append(f"{dotted}: every role follows the run's "
                           f"{'megatron_training' if key in _fields('megatron_training') else 'actor_config'}"
                           f".{key} here (one job; the critic is saved in actor_config.save)")
        return
    r = row(MEGATRON, key)
    if r is not None and r.handling == NOT_APPLICABLE and r.accepts(value):
        out.notices.append(notice_line(dotted, value, r))
    elif r is not None and r.handling == NOT_APPLICABLE:
        problems.append(not_applicable_error(dotted, value, r))
    else:
        problems.append(_unknown(dotted, key, section, MEGATRON))


def _merge_megatron(out: Normalised, problems: list, target_section: str, key: str,
                    value: Any, dotted: str) -> None:
    """A Megatron key written in the other section; actor_config wins, as in MindSpeed-RL."""
    target = out.sections[target_section]
    if key == "model" and key in target and target[key] != value:
        problems.append(ConfigError(dotted, f"differs from {target_section}.model="
                                    f"{show_value(target[key])}", "one model serves every role "
                                    "here: write it once, in megatron_training", value=value))
        return
    if dotted.startswith("megatron_training.") and key in target:
        return   # actor_config already set it and overrides megatron_training
    target[key] = value


def _unknown(dotted: str, key: str, section: str, family: str | None) -> ConfigError:
    candidates = set(_fields(section)) if section in SECTIONS or section == SAMPLING else set()
    if family:
        candidates |= set(known_names(family))
        if family == MEGATRON:
            for sibling in _MEGATRON_SCHEMA_SECTIONS:
                candidates |= _fields(sibling)
    hint = typo_hint(key, sorted(candidates), f"{section}.")
    if hint is None:
        for other, sections in FAMILY_SECTIONS.items():
            other_row = row(other, key)
            if other != family and (other_row or any(
                    s in SECTIONS and key in _fields(s) for s in sections)):
                older = (f" (an older MindSpeed-RL key: {other_row.history})"
                         if other_row is not None and other_row.history else "")
                hint = (f"it belongs in another section{older}: did you mean "
                        f"{sections[0]}.{key}?")
                break
    named = "it" if dotted.endswith(f".{key}") else key   # a '-' read as '_'
    return ConfigError(dotted, "unknown key", hint or "never a MindSpeed-RL key: neither this "
                       "project nor any MindSpeed-RL version (2025-03 to 2026-04) has "
                       f"{named} in {section}; see docs/config.md for the keys of each section")


def _defaults_models(value: Any, problems: list) -> list[str]:
    """Model names of a hydra ``defaults:`` list (``- model: [qwen25_7b]``)."""
    names: list[str] = []
    items = value if isinstance(value, list) else [value]
    for item in items:
        if item == "_self_":
            continue
        if isinstance(item, dict) and set(item) == {"model"}:
            models = item["model"]
            models = models if isinstance(models, list) else [models]
            if all(isinstance(m, str) for m in models):
                names += models
                continue
        problems.append(ConfigError("defaults", "only a model list is understood here "
                                    "(- model: [<name>], read as model/<name>.yaml next to "
                                    "the config)", "keep just the model entry", value=item))
    return names


def _ints(text: Any) -> list[int] | None:
    if isinstance(text, int) and not isinstance(text, bool):
        return [text]
    if isinstance(text, (list, tuple)):
        items = list(text)
    elif isinstance(text, str):
        items = [t for t in text.replace(" ", "").split(",") if t]
    else:
        return None
    try:
        return [int(t) for t in items]
    except (TypeError, ValueError):
        return None


def _translate_dapo(out: Normalised, problems: list, translated: dict) -> None:
    """MindSpeed-RL's DAPO keys -> rl_config's (verl's names)."""
    rl = out.sections["rl_config"]
    metric = rl.get("filter_groups_metric")
    older = re.fullmatch(r"grpo/(.+)_rewards/mean", metric) if isinstance(metric, str) else None
    if older:
        # MindSpeed-RL named the verifier by its metric key until 2025-07-16
        rl["filter_groups_metric"] = older.group(1)
        out.notices.append(f"rl_config.filter_groups_metric={show_value(metric)}: the "
                           "verifier's metric name, as MindSpeed-RL wrote it until 2025-07-16 "
                           f"(release 2.1.0 included): translated to {show_value(older.group(1))}")
    sampling = out.sections["generate_config"].get("sampling_config", {})
    clip_higher = translated.pop("clip_higher_enable", None)
    if clip_higher is None or clip_higher[1] is not True:
        dropped = [k for k in ("clip_ratio_low", "clip_ratio_high") if k in rl]
        for key in dropped:
            del rl[key]
        if dropped and clip_higher is not None:
            out.notices.append(f"{clip_higher[0]}=false: rl_config.{' and '.join(dropped)} not "
                               "read (rl_config.clip_ratio on both sides)")
    token_level = translated.pop("token_level_loss", None)
    if token_level is not None and "loss_agg_mode" not in rl:
        rl["loss_agg_mode"] = "token-mean" if token_level[1] else "seq-mean-token-mean"
        out.notices.append(f"{token_level[0]}={show_value(token_level[1])}: translated to "
                           f"rl_config.loss_agg_mode={rl['loss_agg_mode']}")
    enable = translated.pop("overlong_buffer_enable", None)
    buffer = translated.pop("overlong_buffer", None)
    if enable is not None and enable[1] is True:
        if buffer is None:
            problems.append(ConfigError(enable[0], "needs overlong_buffer (its length in "
                                        "tokens)", "add overlong_buffer", value=enable[1]))
        else:
            rl["overlong_buffer_len"] = buffer[1]
            out.notices.append(f"{buffer[0]}={show_value(buffer[1])}: translated to "
                               "rl_config.overlong_buffer_len")
    elif buffer is not None:
        out.notices.append(f"{buffer[0]}: not read (overlong_buffer_enable is off)")
    factor = translated.pop("overlong_buffer_penalty_factor", None)
    if factor is not None:
        rl["overlong_penalty_factor"] = factor[1]
    limit = translated.pop("rollout_max_tokens", None)
    if limit is not None and limit[1] != sampling.get("max_tokens", limit[1]):
        problems.append(ConfigError(limit[0], "differs from generate_config.sampling_config."
                                    f"max_tokens={show_value(sampling.get('max_tokens'))}",
                                    "the overlong penalty is measured against max_tokens here: "
                                    "remove the key or make them equal", value=limit[1]))
    batches = translated.pop("filter_groups_max_batches", None)
    if batches is not None:
        value = batches[1]
        if isinstance(value, int) and not isinstance(value, bool):
            rl["max_num_gen_batches"] = max(value, 0)
            out.notices.append(f"{batches[0]}={value}: translated to rl_config."
                               f"max_num_gen_batches={max(value, 0)}")
        else:
            problems.append(ConfigError(batches[0], "expected an integer", "e.g. -1 (no limit)",
                                        value=value))
    train = translated.pop("filter_groups_train_batch_size", None)
    mt = out.sections["megatron_training"]
    gbs = mt.get("global_batch_size")
    if train is not None and train[1] != gbs and rl.get("filter_groups_enable") is True:
        # MindSpeed-RL: global_batch_size prompts per round, filter_groups_train_batch_size
        # groups trained; here: gen_batch_size per round, global_batch_size trained.
        rl["gen_batch_size"], mt["global_batch_size"] = gbs, train[1]
        out.notices.append(f"{train[0]}={show_value(train[1])}: translated to megatron_training."
                           f"global_batch_size={show_value(train[1])} (groups trained) and "
                           f"rl_config.gen_batch_size={show_value(gbs)} (prompts per round)")


# Keys renamed into a schema key: MindSpeed-RL's guide writes lora_filter (its configs and
# code read lora_ckpt_filter); MindSpeed-LLM's DPO names the reference's checkpoint ref_model.
_RENAMED = {"lora_filter": ("actor_config", "lora_ckpt_filter"),
            "ref_model": ("ref_config", "load")}


def _translate_renamed(out: Normalised, problems: list, translated: dict) -> None:
    """Each key of ``_RENAMED`` written into its schema key (refused when both disagree)."""
    for key, (section_name, name) in _RENAMED.items():
        item = translated.pop(key, None)
        if item is None:
            continue
        section = out.sections[section_name]
        dotted, value = item
        if section.get(name, value) != value:
            problems.append(ConfigError(dotted, f"contradicts {section_name}.{name}="
                                        f"{show_value(section[name])}",
                                        "keep one of them", value=value))
        else:
            section[name] = value
            out.notices.append(f"{dotted}={show_value(value)}: translated to "
                               f"{section_name}.{name}")


def _translate_workers(out: Normalised, problems: list, translated: dict) -> None:
    """MindSpeed-RL's worker formats: the integrated worker (every role on the actor's NPUs,
    as here) or separate workers (reference and reward model on NPUs of their own)."""
    rl, actor = out.sections["rl_config"], out.sections["actor_config"]
    integrated = translated.pop("use_integrated_worker", None)
    if integrated is not None and isinstance(integrated[1], bool):
        out.notices.append(f"{integrated[0]}={show_value(integrated[1])}: " + (
            "every role on every rank (the integrated worker), as here" if integrated[1] else
            "MindSpeed-RL's separate workers; here every role runs on the actor's ranks"))
    layout = out.reference_layout
    sizes = {k: layout.pop(k) for k in _LAYOUT if k in layout}
    if sizes:
        megatron = out.sections["megatron_training"]
        same = list(sizes.values()) == [actor.get(k, megatron.get(k, 1)) for k in sizes]
        written = ", ".join(f"{k}={show_value(v)}" for k, v in sizes.items())
        out.sections["ref_config"].update(sizes)  # its own layout; the actor's when equal
        out.notices.append(
            f"ref_config.{written}: " + ("the actor's layout too" if same else
            "the reference's layout on NPUs of its own (MindSpeed-RL's separate workers, "
            "rl_config.reference_resource); here the reference runs on the actor's ranks in "
            "that layout of its own (a second set of megatron groups), which computes the "
            "same log-probs"))
    mbs = layout.pop("micro_batch_size", None)
    if mbs is not None:
        # MindSpeed-RL's reference worker runs its forward in ref_config.micro_batch_size rows
        old = rl.get("ref_forward_micro_batch_size")
        rl["ref_forward_micro_batch_size"] = mbs
        out.notices.append(f"ref_config.micro_batch_size={show_value(mbs)}: translated to "
                           f"rl_config.ref_forward_micro_batch_size={show_value(mbs)}" + (
                               f" (its {show_value(old)} is not read: MindSpeed-RL's separate "
                               "reference worker reads ref_config's)" if old not in (None, mbs)
                               else ""))
    for key, value in layout.items():
        dotted = f"ref_config.{key}"
        r = row(MEGATRON, key)
        if r is not None and r.handling == NOT_APPLICABLE and not r.accepts(value):
            problems.append(not_applicable_error(dotted, value, r))
        else:
            out.notices.append(f"{dotted}={show_value(value)}: the reference follows the run's "
                               "settings here (it only computes log-probs of the starting "
                               "weights, or of ref_config.load)")


def _translate_history(out: Normalised, problems: list, translated: dict) -> None:
    """Keys of older MindSpeed-RL versions with a meaning today (mindspeed_keys ``history``)."""
    rl, actor = out.sections["rl_config"], out.sections["actor_config"]
    for key in ("experience_count", "experience_count_actor", "experience_count_ref",
                "experience_count_reward", "experience_count_rule_reward", "micro_batch_size"):
        item = translated.pop(key, None)
        if item is not None:
            family = GENERATE if key == "micro_batch_size" else RL
            out.notices.append(notice_line(item[0], item[1], row(family, key)))
    update = translated.pop("update_micro_batch_size", None)
    if update is not None:
        dotted, value = update
        if _written_rl(out).get("use_integrated_worker") is True:
            forward = actor.get("micro_batch_size")
            actor["micro_batch_size"] = value
            moved = []
            for name in ("actor_forward_micro_batch_size", "ref_forward_micro_batch_size"):
                if forward is not None and name not in rl:
                    rl[name] = forward
                    moved.append(f"rl_config.{name}={show_value(forward)}")
            out.notices.append(f"{dotted}={show_value(value)} (an older MindSpeed-RL key: "
                               f"{row(RL, 'update_micro_batch_size').history}): translated to "
                               f"actor_config.micro_batch_size={show_value(value)}"
                               + (f", and actor_config.micro_batch_size to {', '.join(moved)}"
                                  if moved else ""))
        else:
            out.notices.append(f"{dotted}={show_value(value)}: not read: MindSpeed-RL read it "
                               "only with rl_config.use_integrated_worker: true")
    mini = rl.get("mini_batch_size")
    if out.dated_by and mini is not None:
        n = rl.get("n_samples_per_prompt", _default(RLConfig, "n_samples_per_prompt"))
        if not _is_int(mini) or not _is_int(n) or n < 1 or mini % n:
            problems.append(ConfigError("rl_config.mini_batch_size", "counts responses in this "
                                        f"file's MindSpeed-RL version ({out.dated_by[0]} dates "
                                        "it before 2025-05-15), but is not a multiple of "
                                        f"rl_config.n_samples_per_prompt={show_value(n)}",
                                        "give a multiple of n_samples_per_prompt", value=mini))
        else:
            rl["mini_batch_size"] = mini // n
            out.notices.append(f"rl_config.mini_batch_size={mini}: counted responses in "
                               f"MindSpeed-RL before 2025-05-15 (as {out.dated_by[0]} dates "
                               f"this file): translated to {mini // n} prompts ({mini} / "
                               f"n_samples_per_prompt={n})")
    rule = translated.pop("rule_reward", None)
    if rule is not None:
        dotted, value = rule
        if not isinstance(value, bool):
            problems.append(_not_a_flag(dotted, value))
        elif not value:
            if "reward_config" not in out.written or "reward_config" in out.dropped_sections:
                problems.append(ConfigError(dotted, "leaves no reward: no rule verifiers and no "
                                            "reward model (reward_config, with "
                                            "rl_config.reward_resource in MindSpeed-RL's "
                                            "separate-worker format)", "set rule_reward: true "
                                            "with verifier_function, or add a reward model",
                                            value=value))
            else:
                dropped = [k for k in ("verifier_function", "verifier_weight") if k in rl]
                rl["verifier_function"], rl["verifier_weight"] = [], []
                out.notices.append(f"{dotted}=false: no rule verifiers, the reward model alone"
                                   + (f" (rl_config.{' and '.join(dropped)} not read)"
                                      if dropped else ""))


def _written_rl(out: Normalised) -> dict:
    rl = out.written.get("rl_config")
    return rl if isinstance(rl, dict) else {}


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _translate(out: Normalised, problems: list, translated: dict) -> None:
    _translate_workers(out, problems, translated)
    _translate_history(out, problems, translated)
    _translate_dapo(out, problems, translated)
    _translate_renamed(out, problems, translated)
    mt, actor = out.sections["megatron_training"], out.sections["actor_config"]
    if "model" not in mt and len(out.defaults_models) == 1:
        mt["model"] = out.defaults_models[0]
    model = mt.get("model")
    if out.defaults_models and isinstance(model, str) and "/" not in model \
            and not model.endswith((".yaml", ".yml")) and model not in out.defaults_models:
        problems.append(ConfigError("megatron_training.model", f"is not one of the defaults "
                                    f"models {out.defaults_models}", "name one of them",
                                    value=model))

    extend = translated.pop("moe_tp_extend_ep", None)
    if extend is not None:
        dotted, value = extend
        if not isinstance(value, bool):
            problems.append(_not_a_flag(dotted, value))
        elif value:
            tp = actor.get("tensor_model_parallel_size", 1)
            ep = actor.get("expert_model_parallel_size", 1)
            if actor.get("expert_tensor_parallel_size") not in (None, 1):
                problems.append(ConfigError(dotted, "contradicts actor_config."
                                            "expert_tensor_parallel_size="
                                            f"{actor['expert_tensor_parallel_size']}",
                                            "keep one of them", value=value))
            elif isinstance(tp, int) and isinstance(ep, int):
                actor["expert_tensor_parallel_size"] = 1
                actor["expert_model_parallel_size"] = ep * tp
                out.notices.append(f"{dotted}=true: translated to actor_config."
                                   f"expert_tensor_parallel_size=1, expert_model_parallel_size="
                                   f"{ep * tp} (EP {ep} x TP {tp})")

    noop = translated.pop("noop_layers", None)
    num = translated.pop("num_layers", None)
    if num is not None and not (isinstance(num[1], int) and not isinstance(num[1], bool)
                                and num[1] > 0):
        problems.append(ConfigError(num[0], "expected a positive integer", "e.g. num_layers: 96",
                                    value=num[1]))
        return
    if noop is None:
        if num is not None:
            out.declared_num_layers = num[1]
        return
    layers = _ints(noop[1])
    if layers is None:
        problems.append(ConfigError(noop[0], "expected layer numbers, e.g. \"5,95\"",
                                    "list the identity layers, comma-separated", value=noop[1]))
        return
    if num is None:
        problems.append(ConfigError(noop[0], "needs num_layers (the padded layer count, model "
                                    "layers + noop layers)", "add num_layers", value=noop[1]))
        return
    padded, pp = num[1], actor.get("pipeline_model_parallel_size", 1)
    if not isinstance(pp, int) or pp < 1 or padded % pp:
        problems.append(ConfigError(num[0], f"is not divisible by actor_config."
                                    f"pipeline_model_parallel_size={pp}", "noop layers pad "
                                    "num_layers to a multiple of the pipeline size",
                                    value=padded))
        return
    bad = [n for n in layers if not 0 <= n < padded]
    if bad or len(set(layers)) != len(layers):
        problems.append(ConfigError(noop[0], f"layer numbers must be distinct and in [0, "
                                    f"{padded})", "fix the list", value=noop[1]))
        return
    per_stage = padded // pp
    counts = [per_stage - sum(1 for n in layers if s * per_stage <= n < (s + 1) * per_stage)
              for s in range(pp)]
    listed = ",".join(map(str, counts))
    if actor.get("num_layer_list") not in (None, listed):
        problems.append(ConfigError(noop[0], f"gives stages {listed} but actor_config."
                                    f"num_layer_list={actor['num_layer_list']!r}",
                                    "keep one of them", value=noop[1]))
        return
    actor["num_layer_list"] = listed
    out.notices.append(f"{noop[0]}={show_value(noop[1])} with num_layers={padded}: translated "
                       f"to actor_config.num_layer_list={listed!r} (the real layers of each of "
                       f"the {pp} pipeline stages)")

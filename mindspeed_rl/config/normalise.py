"""Applying the MindSpeed-RL key table to a parsed config file, every problem at once.

`normalise` turns the file's mapping into the schema's sections: keys of the schema stay,
Megatron keys move to the section that holds them here (MindSpeed-RL merges
``megatron_training`` into ``actor_config``), older names are rewritten, keys that do not
apply become notices. Unknown keys and values this project cannot honour are collected
and raised as one `ConfigErrors`, so a user fixes a file in one pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mindspeed_rl.config.errors import ConfigError, ConfigErrors, show_value
from mindspeed_rl.config.mindspeed_keys import (FAMILY_SECTIONS, HONOURED, MEGATRON,
                                                NOT_APPLICABLE, SAMPLING, TOP, TRANSLATED,
                                                family_of, known_names, not_applicable_error,
                                                notice_line, row, typo_hint)
from mindspeed_rl.config.schema import SECTIONS, SamplingConfig

_MEGATRON_SCHEMA_SECTIONS = ("megatron_training", "actor_config")


@dataclass
class Normalised:
    """The file rewritten into the schema's sections, and what the rewrite found."""

    sections: dict[str, dict[str, Any]]
    notices: list[str] = field(default_factory=list)
    defaults_models: list[str] = field(default_factory=list)
    # megatron num_layers written without noop_layers: must equal the model's layers
    declared_num_layers: int | None = None


def _fields(section: str) -> set[str]:
    cls = SamplingConfig if section == SAMPLING else SECTIONS[section]
    return {f.name for f in dataclasses.fields(cls)}


_STAGES = {"ray_grpo": "grpo", "ray_dapo": "grpo", "ray_ppo": "ppo"}
_LAUNCHER = {"grpo": "pretrain_grpo.py", "ppo": "pretrain_ppo.py"}


def normalise(raw: dict, file_name: str, algorithm: str = "grpo") -> Normalised:
    """Rewrite a parsed config (MindSpeed-RL's format or this project's) into the schema.

    Raises:
        ConfigErrors: listing every unknown key and every value that cannot be honoured.
    """
    out = Normalised({name: {} for name in SECTIONS})
    problems: list[ConfigError] = []
    translated: dict[str, tuple[str, Any]] = {}   # key -> (dotted where written, value)

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

    stage = translated.pop("stage", None)
    if stage is not None and stage[1] is not None:
        wanted = _STAGES.get(stage[1])
        if wanted is None:
            problems.append(ConfigError(stage[0], "is not a stage this project runs",
                                        f"use one of {sorted(_STAGES)}", value=stage[1]))
        elif wanted != algorithm:
            problems.append(ConfigError(stage[0], f"cannot be honoured here: "
                                        f"{_LAUNCHER[algorithm]} runs {algorithm.upper()}",
                                        f"launch {_LAUNCHER[wanted]} for {stage[1]}",
                                        value=stage[1]))
        else:
            out.notices.append(f"{stage[0]}={show_value(stage[1])}: the launcher "
                               f"{_LAUNCHER[algorithm]} runs it")
        if stage[1] == "ray_dapo" and out.sections["rl_config"].get("share_backbone"):
            problems.append(ConfigError("rl_config.share_backbone", "DAPO has no reference "
                                        f"model to share the backbone with ({stage[0]}="
                                        f"{show_value(stage[1])}), as MindSpeed-RL refuses",
                                        "set share_backbone: false", value=True))
    _translate(out, problems, translated)
    if problems:
        raise ConfigErrors(problems, file_name)
    return out


def _place(out: Normalised, problems: list, translated: dict, section: str, key: str,
           value: Any, target: dict) -> None:
    dotted = f"{section}.{key}"
    family = family_of(section)
    if section == "ref_config":
        if key == "load":
            target[key] = value
        elif key == "model":
            model = out.sections["megatron_training"].get("model")
            if model is not None and model != value:
                problems.append(ConfigError(dotted, f"differs from megatron_training.model="
                                            f"{show_value(model)}", "the reference is the "
                                            "starting policy: remove the key", value=value))
        elif family and (row(family, key) or key in _fields("megatron_training")
                         or key in _fields("actor_config")):
            problems.append(ConfigError(dotted, "the reference model runs in the actor's layout "
                                        "and settings here (MindSpeed-RL's integrated worker); "
                                        "only ref_config.load is read", "remove the key",
                                        value=value))
        else:
            problems.append(_unknown(dotted, key, section, family))
        return
    if key in _fields(section):
        target[key] = value
        return
    if section in _ROLE_SECTIONS:
        _place_role_key(out, problems, section, key, value)
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


def _place_role_key(out: Normalised, problems: list, section: str, key: str,
                    value: Any) -> None:
    dotted = f"{section}.{key}"
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
            if other != family and (row(other, key) or any(
                    s in SECTIONS and key in _fields(s) for s in sections)):
                hint = f"it belongs in another section: did you mean {sections[0]}.{key}?"
                break
    return ConfigError(dotted, "unknown key", hint or "neither this project nor MindSpeed-RL "
                       f"has it in {section}; see docs/config.md for the keys of each section")


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


def _translate_lora_filter(out: Normalised, problems: list, translated: dict) -> None:
    """MindSpeed-RL's guide writes lora_filter; its configs and code read lora_ckpt_filter."""
    lora_filter = translated.pop("lora_filter", None)
    if lora_filter is None:
        return
    actor = out.sections["actor_config"]
    dotted, value = lora_filter
    if actor.get("lora_ckpt_filter", value) != value:
        problems.append(ConfigError(dotted, f"contradicts actor_config.lora_ckpt_filter="
                                    f"{show_value(actor['lora_ckpt_filter'])}",
                                    "keep one of them", value=value))
    else:
        actor["lora_ckpt_filter"] = value
        out.notices.append(f"{dotted}={show_value(value)}: translated to "
                           "actor_config.lora_ckpt_filter")


def _translate(out: Normalised, problems: list, translated: dict) -> None:
    _translate_dapo(out, problems, translated)
    _translate_lora_filter(out, problems, translated)
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
            problems.append(ConfigError(dotted, "expected true or false", "e.g. "
                                        "moe_tp_extend_ep: true", value=value))
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

"""``teacher_config``: the checks of on-policy distillation's teacher, and what the dry run
says about it (its weights, layout and memory).

The teacher is a frozen megatron model built in the actor's training layout on the same
ranks (co-located SPMD, like the reference), so its TP/PP are the actor's. It reads the
sampled tokens by id: it must share the student's tokenizer (its ``tokenizer*`` files are
compared with the student's). Its architecture is the ``config.json`` of
``teacher_config.load`` (it may be larger, or of another family), else the student's.
"""

from __future__ import annotations

import json
from pathlib import Path

from mindspeed_rl.algorithms.distillation import NAME as DISTILL
from mindspeed_rl.config.config_error import ConfigError
from mindspeed_rl.config.model_spec import read_model_spec
from mindspeed_rl.config.rank_parameters import params_per_rank


def check_teacher(config) -> None:
    """Refuse, naming the key: a distillation without a teacher, a teacher nothing reads,
    a missing teacher path, a teacher with another tokenizer or a shape the actor's layout
    cannot shard, and settings a teacher cannot run with."""
    teacher, rl = config.teacher_config, config.rl_config
    if rl.adv_estimator == DISTILL and teacher is None:
        raise ConfigError("teacher_config", f"rl_config.adv_estimator={DISTILL} needs a "
                          "teacher", "add 'teacher_config:' with load: <the teacher's HF "
                          "directory or checkpoint>")
    if teacher is None:
        return
    if rl.adv_estimator != DISTILL:
        raise ConfigError("teacher_config", f"only rl_config.adv_estimator={DISTILL} reads a "
                          f"teacher, but the job runs {rl.adv_estimator}",
                          f"set rl_config.adv_estimator: {DISTILL}, or remove teacher_config")
    if not Path(teacher.load).exists():
        raise ConfigError("teacher_config.load", "does not exist", "point it to the teacher's "
                          "HF directory, or a checkpoint converted by tools/convert_ckpt.py",
                          value=teacher.load)
    actor = config.actor_config
    for size in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = getattr(teacher, size)
        if value is not None and value < 1:
            raise ConfigError(f"teacher_config.{size}", "must be at least 1",
                              "use a positive size, or leave it out (the actor's)", value=value)
    if config.features.dynamic_sampling and not teacher.task_reward_coef:
        raise ConfigError("rl_config.filter_groups_enable", "dynamic sampling drops the groups "
                          "whose rewards are all equal, but with teacher_config."
                          "task_reward_coef=0 the reward plays no part in distillation's "
                          "advantages (every sampled token carries the teacher's signal)",
                          "set filter_groups_enable: false, or a non-zero "
                          "teacher_config.task_reward_coef", value=True)
    if rl.share_backbone:
        raise ConfigError("rl_config.share_backbone", "is the reference model's shortcut; "
                          "distillation's teacher is a model of its own",
                          "set share_backbone: false", value=True)
    arch = teacher_architecture(config)
    if arch is not None:
        tp, pp = teacher_sizes(config)
        heads, groups = arch["num_attention_heads"], arch.get("num_key_value_heads") or \
            arch["num_attention_heads"]
        if heads % tp or (groups % tp and tp % groups):
            raise ConfigError("teacher_config.tensor_model_parallel_size", f"the teacher's "
                              f"{heads} attention heads ({groups} KV heads, {teacher.load}) do "
                              f"not shard over TP={tp}", "use a TP that divides the teacher's "
                              "heads", value=tp)
        if arch["num_hidden_layers"] < pp:
            raise ConfigError("teacher_config.pipeline_model_parallel_size", f"the teacher's "
                              f"{arch['num_hidden_layers']} layers ({teacher.load}) are fewer "
                              f"than PP={pp} stages", "use a smaller PP", value=pp)
    check_teacher_tokenizer(config)


def teacher_sizes(config) -> tuple[int, int]:
    """The teacher's (TP, PP): its own keys, else the actor's."""
    t, a = config.teacher_config, config.actor_config
    return (t.tensor_model_parallel_size or a.tensor_model_parallel_size,
            t.pipeline_model_parallel_size or a.pipeline_model_parallel_size)


def check_teacher_world(config, world_size: int) -> None:
    """The teacher's TP x PP must tile the world (its DP is the rest)."""
    tp, pp = teacher_sizes(config)
    if world_size % (tp * pp):
        raise ConfigError("teacher_config.tensor_model_parallel_size",
                          f"TP={tp} x PP={pp} of the teacher does not divide the world of "
                          f"{world_size} ranks", "choose teacher_config TP and PP whose "
                          "product divides the world size", value=tp)


def teacher_architecture(config) -> dict | None:
    """The teacher's ``config.json`` (None: it has the student's architecture)."""
    path = Path(config.teacher_config.load) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _tokenizer_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("tokenizer*"))
            if p.is_file() and p.name != "tokenizer_config.json"}


def check_teacher_tokenizer(config) -> None:
    """The teacher scores the student's token ids: its tokenizer must map tokens to the
    same ids. Compared by the tokenizer files first, then (files differing) by vocabulary.
    A teacher directory without tokenizer files is taken as the student's tokenizer."""
    teacher_dir = Path(config.teacher_config.load)
    student = config.megatron_training.tokenizer_name_or_path
    theirs = _tokenizer_files(teacher_dir)
    if not theirs or student is None or not Path(student).is_dir():
        return
    if theirs == _tokenizer_files(Path(student)):
        return
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(str(teacher_dir)).get_vocab() != \
            AutoTokenizer.from_pretrained(student).get_vocab():
        raise ConfigError("teacher_config.load", f"the teacher's tokenizer ({teacher_dir}) maps "
                          f"tokens to other ids than the student's ({student}, megatron_training"
                          ".tokenizer_name_or_path)", "use a teacher trained with the student's "
                          "tokenizer (on-policy distillation compares the log-probs of the "
                          "same token ids)", value=str(teacher_dir))


def teacher_parameters(config) -> int:
    """The teacher's parameters on its heaviest rank, in its layout."""
    spec = (read_model_spec(Path(config.teacher_config.load), True)
            if teacher_architecture(config) is not None else config.model)
    tp, pp = teacher_sizes(config)
    dense, expert = params_per_rank(spec, tp=tp, pp=pp, ep=1, expert_tp=tp)
    return dense + expert


def teacher_weight_line(config, world_size: int) -> str:
    """The dry run's line naming the teacher's weights and layout."""
    t, a = config.teacher_config, config.actor_config
    arch = teacher_architecture(config)
    tp, pp = teacher_sizes(config)
    what = (f"{arch.get('model_type', '?')}, {arch.get('num_hidden_layers')} layers, hidden "
            f"{arch.get('hidden_size')}" if arch else "the student's architecture")
    where = ("the actor's layout" if (tp, pp) == (a.tensor_model_parallel_size,
                                                   a.pipeline_model_parallel_size)
             else f"its own layout, DP={world_size // (tp * pp)}")
    return (f"teacher    teacher_config.load={t.load} ({what}; TP={tp} PP={pp}, {where}; on "
            "host when idle)")

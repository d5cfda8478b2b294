"""The teacher of on-policy distillation (``teacher_config``): a frozen megatron model in
the actor's training layout, its weights from ``teacher_config.load`` (an HF directory, a
converted or saved checkpoint), offloaded to the host between its phases like the
reference. Its architecture is that directory's ``config.json`` (a larger model, or another
family sharing the tokenizer), else the student's."""

from __future__ import annotations

from pathlib import Path


def build_teacher(section, env, student_arch):
    """Returns (model, swap, vocab size) for ``section`` (``teacher_config``); ``env`` is
    roles.RoleEnv with the byte ledger set."""
    from mindspeed_rl.checkpoint import weight_source
    from mindspeed_rl.engine.actor import build_policy_model
    from mindspeed_rl.models.builder import describe_hf_dir
    from mindspeed_rl.trainer.roles import RoleSwap

    arch = (describe_hf_dir(section.load) if (Path(section.load) / "config.json").is_file()
            else student_arch)
    teacher = build_policy_model(arch, **env.model_options)
    weight_source.load_weights(teacher, arch, weight_source.classify(section.load,
                                                                     "teacher_config.load"))
    teacher.requires_grad_(False)
    swap = RoleSwap("teacher", lambda: {"param": list(teacher.parameters())}, env.ledger,
                    env.pin)
    return teacher, swap, arch.vocab_size

"""The teacher of on-policy distillation (``teacher_config``): a frozen megatron model, its
weights from ``teacher_config.load`` (an HF directory, a converted or saved checkpoint),
offloaded to the host between its phases like the reference. Its architecture is that
directory's ``config.json`` (a larger model, or another family sharing the tokenizer),
else the student's.

Its layout is the actor's training layout, or its own TP x PP over the same ranks
(``teacher_config.tensor_model_parallel_size`` / ``pipeline_model_parallel_size``): a
second set of megatron groups (``mindspeed_rl/parallel/second_layout.py``), current while
the teacher is built and while it computes."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Teacher:
    model: torch.nn.Module
    swap: object               # resharding.swap.RoleSwap: on the host between its phases
    vocab_size: int
    layout: object = None      # parallel.second_layout.SecondLayout, None: the actor's

    def current_layout(self):
        """Megatron's groups of the teacher's layout, current inside."""
        return self.layout.current() if self.layout is not None else contextlib.nullcontext()


def own_layout(section, actor_section) -> tuple[int, int] | None:
    """The teacher's (TP, PP) when it differs from the actor's, else None."""
    tp = section.tensor_model_parallel_size or actor_section.tensor_model_parallel_size
    pp = section.pipeline_model_parallel_size or actor_section.pipeline_model_parallel_size
    if (tp, pp) == (actor_section.tensor_model_parallel_size,
                    actor_section.pipeline_model_parallel_size):
        return None
    return tp, pp


def build_teacher(config, env, student_arch) -> Teacher:
    """The teacher of ``config.teacher_config``; ``env`` is roles.RoleEnv with the byte
    ledger set."""
    from mindspeed_rl.checkpoint import weight_source
    from mindspeed_rl.engine.actor import build_policy_model
    from mindspeed_rl.models.builder import describe_hf_dir
    from mindspeed_rl.parallel.second_layout import SecondLayout
    from mindspeed_rl.resharding.swap import RoleSwap

    section = config.teacher_config
    arch = (describe_hf_dir(section.load) if (Path(section.load) / "config.json").is_file()
            else student_arch)
    sizes = own_layout(section, config.actor_config)
    layout = (SecondLayout(*sizes, timeout_s=config.rl_config.collective_timeout_s)
              if sizes is not None else None)
    options = dict(params_dtype=env.model_options["params_dtype"])
    if sizes is None and arch is student_arch:
        options = env.model_options  # the actor's layout and shape: its own options
    teacher = Teacher(model=None, swap=None, vocab_size=arch.vocab_size, layout=layout)
    with teacher.current_layout():
        model = build_policy_model(arch, **{"sequence_parallel": False, **options})
        weight_source.load_weights(model, arch, weight_source.classify(section.load,
                                                                       "teacher_config.load"))
    model.requires_grad_(False)
    teacher.model = model
    teacher.swap = RoleSwap("teacher", lambda: {"param": list(model.parameters())},
                            env.ledger, env.pin)
    return teacher

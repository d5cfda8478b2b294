"""LoRA checkpoints out of megatron: the merged HF model and a PEFT adapter directory.

A LoRA trainer checkpoint holds the adapters (``<linear>.lora_A.weight`` /
``lora_B.weight``) and, unless ``actor_config.lora_ckpt_filter`` saved the adapters only,
the backbone; its common state records r, alpha, the target modules and the base model the
run started from (``initial_weights``). `load_lora_model` rebuilds the whole adapted model
(TP=PP=1) from it; `merge_adapters` then folds W + (alpha/r) B A for the HF export, and
`write_peft_adapter` writes the adapters in PEFT's format, renamed to the HF modules
(megatron's fused ``linear_qkv`` -> q/k/v_proj sharing A, B split by rows like the weight;
``linear_fc1`` -> gate/up_proj likewise), which ``peft.PeftModel.from_pretrained`` loads
onto the base HF model. A checkpoint written before ``linear_fc1``'s B was stored in the
global [gate; up] layout (no ``fc1_lora_B_layout`` in its lora record) holds it in the
rank-interleaved order of the TP it was saved at, which its RNG state records: the rows are
regrouped after loading (``mindspeed_rl.models.lora.regroup_gate_up_rows``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mindspeed_rl.checkpoint.megatron_dir import checkpoint_path, load_megatron_checkpoint
from mindspeed_rl.checkpoint.safe_load import restricted_unpickling
from mindspeed_rl.errors import CheckpointError
from mindspeed_rl.models.lora import (ADAPTER_MARKERS, FC1_B_LAYOUT_KEY, add_lora_adapters,
                                      is_adapter_name, regroup_gate_up_rows)


def keys_have_adapters(keys) -> bool:
    """Whether checkpoint tensor keys hold LoRA adapters."""
    return any(is_adapter_name(k) for k in keys)


def lora_common(mg_dir, iteration) -> dict:
    """The checkpoint's common state (its ``lora`` entry names r, alpha, targets)."""
    from megatron.core import dist_checkpointing

    path = checkpoint_path(mg_dir, iteration)
    with restricted_unpickling(path):
        common = dist_checkpointing.load_common_state_dict(str(path)).get("common", {})
    if "lora" not in common:
        raise CheckpointError(f"{path}: holds LoRA adapters but no record of their r and "
                              "alpha (common['lora']); it was not saved by this trainer")
    return common


def load_lora_model(model, arch, source) -> dict:
    """Add the recorded adapters to ``model`` (whole, TP=PP=1) and fill backbone and adapters
    from the checkpoint ``source`` (the backbone from the recorded base model when the
    checkpoint holds the adapters only). Returns the checkpoint's lora record."""
    from mindspeed_rl.checkpoint.weight_source import WeightSource, load_weights

    common = lora_common(source.path, source.iteration)
    lora = common["lora"]
    add_lora_adapters(model, lora["target_modules"], lora["r"], lora["alpha"], seed=0)
    if lora.get("adapters_only"):
        base = WeightSource.from_dict(common["initial_weights"])
        load_weights(model, arch, base)     # the backbone: the base model the run started from
        backbone = [k for k in model.state_dict() if not is_adapter_name(k)]
        load_megatron_checkpoint(model, source.path, iteration=source.iteration,
                                 exclude=backbone)
    else:
        load_megatron_checkpoint(model, source.path, iteration=source.iteration)
    regrouped = 0
    if FC1_B_LAYOUT_KEY not in lora:  # saved before B was stored in the global layout
        regrouped = regroup_gate_up_rows(model, _saved_tp(source, common))
    return dict(lora, base=common.get("initial_weights"), regrouped=regrouped)


def _saved_tp(source, common) -> int:
    """The TP a checkpoint without the global-layout record was saved at (its B rows are
    interleaved by it); CheckpointError when the checkpoint does not say."""
    from mindspeed_rl.checkpoint.trainer_state import saved_parallel_layout

    path = checkpoint_path(source.path, source.iteration)
    layout = saved_parallel_layout(path, common)
    if layout is None:
        raise CheckpointError(
            f"{path}: its LoRA adapters on linear_fc1 were saved in the rank-interleaved "
            "layout of the tensor parallelism it ran at, which this checkpoint does not "
            "record (no RNG state); it cannot be exported correctly: export it with the code "
            "that trained it, or retrain")
    return layout["actor_config.tensor_model_parallel_size"]


_HF_MODULE = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def peft_adapter_tensors(model, arch) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors of a whole adapted model (TP=PP=1)."""
    from mindspeed_rl.models.builder import global_parameter_names
    from mindspeed_rl.models.lora import adapted_modules

    names = global_parameter_names(model)
    wm = arch.weight_map
    out = {}
    for local, module in adapted_modules(model).items():
        global_weight = names[f"{local}.weight"]
        a = module.lora_A.weight.detach().float()
        # B's rows are laid out like the weight's: the weight map splits them the same way.
        for hf_name, b in wm.to_hf(global_weight, module.lora_B.weight.detach().float()):
            stem = "base_model.model." + hf_name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = a.clone()
            out[f"{stem}.lora_B.weight"] = b.contiguous()
    return out


def write_peft_adapter(model, arch, out_dir, lora: dict, base_model: str | None) -> Path:
    """``adapter_config.json`` + ``adapter_model.safetensors`` that PEFT loads."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = [h for t in lora["target_modules"] for h in _HF_MODULE[t]]
    config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=targets,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                        base_model_name_or_path=base_model)
    config.save_pretrained(str(out_dir))
    save_file(peft_adapter_tensors(model, arch), str(out_dir / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "mindspeed_rl_lora.json").write_text(json.dumps(
        {"megatron_target_modules": lora["target_modules"], "base": lora.get("base")},
        indent=2) + "\n")
    return out_dir


__all__ = ["ADAPTER_MARKERS", "keys_have_adapters", "load_lora_model", "peft_adapter_tensors",
           "write_peft_adapter"]

"""HF directory -> megatron-core TransformerConfig + layer spec + GPTModel for this rank.

The model is built for the parallel state megatron already holds
(`mindspeed_rl.parallel.groups.initialize_megatron_parallel`): this rank's TP shard,
PP stage (pre/post_process) and EP experts. Weights come either from an HF directory
(`load_hf_weights`, at any layout) or from a megatron distributed checkpoint
(`mindspeed_rl.checkpoint.load_megatron_checkpoint`).
"""

from __future__ import annotations

import os
from typing import Callable, Collection, Iterator

import torch

from mindspeed_rl.errors import CheckpointError
from mindspeed_rl.models.architecture import ModelArchitecture
from mindspeed_rl.models.hf_io import HFCheckpointReader, load_hf_config
from mindspeed_rl.models.registry import describe_model


def describe_hf_dir(hf_dir: str | os.PathLike) -> ModelArchitecture:
    """Read ``hf_dir/config.json`` and describe the model in megatron terms."""
    return describe_model(load_hf_config(hf_dir))


# MindSpeed-RL's context_parallel_algo -> megatron-core's cp_comm_type (what the core
# attention of `mindspeed_rl.models.attention` and Transformer Engine's read).
CP_COMM_TYPES = {"megatron_cp_algo": "p2p", "ulysses_cp_algo": "a2a"}


def build_transformer_config(arch: ModelArchitecture, *, params_dtype: torch.dtype = torch.float32,
                             sequence_parallel: bool = False, perform_initialization: bool = True,
                             context_parallel_algo: str = "megatron_cp_algo", **overrides):
    """The megatron TransformerConfig of ``arch`` for the current parallel state.

    ``overrides`` are further TransformerConfig fields (e.g. recompute settings, MoE aux loss).
    Context parallelism comes from the parallel state; ``context_parallel_algo`` (ring or
    Ulysses) becomes megatron's ``cp_comm_type``.
    ``perform_initialization=False`` skips the random init (faster when weights are loaded
    anyway) but megatron-core then also skips tagging parameters with their TP attributes
    (``tensor_model_parallel``, ``partition_dim``), which grad clipping, the distributed
    optimizer and the resharding flow read: use it only for whole-model (TP=1) conversion.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from mindspeed_rl.parallel.groups import context_parallel

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("call initialize_megatron_parallel() before building a megatron model")
    kwargs = dict(arch.transformer_config_kwargs)
    kwargs.update(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        context_parallel_size=context_parallel()[1],
        cp_comm_type=CP_COMM_TYPES[context_parallel_algo],
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Initialise on the host, then move: the same seed gives the same full weights at every TP.
        use_cpu_initialization=True,
        perform_initialization=perform_initialization,
    )
    kwargs.update(overrides)
    if kwargs.get("multi_latent_attention"):
        check_mla_tensor_parallel(kwargs)
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def check_mla_tensor_parallel(fields: dict) -> None:
    """megatron's MLA splits its down projections (output dim) and heads over TP ranks."""
    tp = fields["tensor_model_parallel_size"]
    sizes = {"num_attention_heads": fields["num_attention_heads"],
             "kv_lora_rank + qk_rope_head_dim": fields["kv_lora_rank"] + fields["qk_pos_emb_head_dim"]}
    if fields.get("q_lora_rank") is not None:
        sizes["q_lora_rank"] = fields["q_lora_rank"]
    for key, size in sizes.items():
        if size % tp:
            raise ValueError(f"tensor_model_parallel_size={tp} does not divide the model's {key}={size} "
                             "(multi-latent attention splits it over TP ranks); choose a TP that divides it")


def build_layer_spec(config, core_attention: type | None = None):
    """Megatron-core local decoder block spec (MoE layers per moe_layer_freq) with our core
    attention (`mindspeed_rl.models.attention.core_attention_class`, or ``core_attention``)
    in every layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mindspeed_rl.models.attention import core_attention_class

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    attention = core_attention or core_attention_class()
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = attention
    return spec


def build_gpt_model(arch: ModelArchitecture, config, *, pre_process: bool | None = None,
                    post_process: bool | None = None, parallel_output: bool = True,
                    core_attention: type | None = None):
    """This rank's GPTModel (its PP stage, TP shard and EP experts); ``core_attention``
    overrides the platform's choice (e.g. megatron's DotProductAttention, for comparison)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage()
    if post_process is None:
        post_process = ps.is_pipeline_last_stage()
    return GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(config, core_attention),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rotary_base,
    )


def build_model_from_hf_dir(hf_dir: str | os.PathLike, **config_kwargs):
    """(model, arch, config) with freshly initialised weights; see `load_hf_weights`."""
    arch = describe_hf_dir(hf_dir)
    config = build_transformer_config(arch, **config_kwargs)
    return build_gpt_model(arch, config), arch, config


# ---- naming: local (per stage / per EP rank) <-> global ---------------------------------------

def global_parameter_names(model, adapters: bool = False) -> dict[str, str]:
    """This rank's parameter names -> global names used by the weight map.

    Megatron numbers decoder layers per PP stage and experts per EP rank; the global
    name uses the layer's ``layer_number`` (1-based, global) and the expert's global id.
    The backbone's parameters only, or (``adapters=True``) only the LoRA adapters'
    (`mindspeed_rl.models.lora`), which the weight map does not know.
    """
    from mindspeed_rl.models.lora import is_adapter_name

    from megatron.core import parallel_state as ps

    layer_index = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    num_experts = model.config.num_moe_experts or 0
    ep_size = ps.get_expert_model_parallel_world_size()
    expert_offset = ps.get_expert_model_parallel_rank() * (num_experts // ep_size) if num_experts else 0
    return {local: _global_name(local, layer_index, expert_offset)
            for local, _ in model.named_parameters() if is_adapter_name(local) == adapters}


def _global_name(local: str, layer_index: dict[int, int], expert_offset: int = 0) -> str:
    """A local parameter or buffer name with the global layer number and expert id."""
    parts = local.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(layer_index[int(parts[2])])
        if "local_experts" in parts:
            k = parts.index("local_experts") + 1
            parts[k] = str(int(parts[k]) + expert_offset)
    return ".".join(parts)


# Buffers that are model weights (in the weight map and in HF checkpoints): the router's expert
# bias of aux-loss-free balancing (DeepSeek-V3's e_score_correction_bias).
WEIGHT_BUFFERS = ("router.expert_bias",)


def global_weight_buffer_names(model) -> dict[str, str]:
    """This rank's weight buffers (`WEIGHT_BUFFERS`) -> global names, as `global_parameter_names`."""
    layer_index = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    return {local: _global_name(local, layer_index) for local, buf in model.named_buffers()
            if buf is not None and local.endswith(WEIGHT_BUFFERS)}


@torch.no_grad()
def copy_model_weights(dst, src) -> None:
    """Copy ``src``'s parameters and weight buffers (`WEIGHT_BUFFERS`) into ``dst``, a model
    built the same way at the same layout (e.g. the reference from the starting policy)."""
    for p_dst, p_src in zip(dst.parameters(), src.parameters(), strict=True):
        p_dst.copy_(p_src)
    for name in global_weight_buffer_names(dst):
        dst.get_buffer(name).copy_(src.get_buffer(name))


def global_weight_names(model) -> dict[str, str]:
    """Parameters and weight buffers: local name -> global name."""
    return {**global_parameter_names(model), **global_weight_buffer_names(model)}


def weight_of(model, local: str) -> torch.Tensor:
    try:
        return model.get_parameter(local)
    except AttributeError:
        return model.get_buffer(local)


def tp_rank_and_size(is_expert: bool) -> tuple[int, int]:
    """(this rank's TP rank, the TP size) of a weight: the expert TP group's for an expert's
    weights, else the tensor-parallel group's."""
    from megatron.core import parallel_state as ps

    if is_expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _full_shape(param: torch.Tensor, tp_dim: int | None, tp_size: int) -> torch.Size:
    shape = list(param.shape)
    if tp_dim is not None:
        shape[tp_dim] *= tp_size
    return torch.Size(shape)


def check_hf_checkpoint(model, arch: ModelArchitecture, reader: HFCheckpointReader,
                        exclude: Collection[str] = ()) -> None:
    """Refuse an HF checkpoint whose tensor names or shapes do not fit ``arch`` (before loading).

    Names are checked for the whole model, shapes for this rank's parameters. ``exclude``:
    global megatron names the checkpoint need not hold (they are not loaded).
    """
    wm = arch.weight_map
    expected = set(wm.all_hf_names()) - {h for name in exclude for h in wm.hf_names(name)}
    present = set(reader.names())
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(
            f"{reader.dir}: {len(missing)} tensor(s) that config.json ({arch.name}) requires are "
            f"missing from the safetensors files, e.g. {missing[:3]}"
        )
    _say_skipped(wm, sorted(present - expected), reader)
    unexpected = sorted(n for n in present - expected if not wm.is_ignored_hf(n))
    if unexpected:
        raise CheckpointError(
            f"{reader.file_of(unexpected[0])}: tensor {unexpected[0]!r} is not part of a {arch.name} "
            f"model with this config.json ({len(unexpected)} unexpected tensor(s): {unexpected[:3]})"
        )
    for local, global_name in global_weight_names(model).items():
        if global_name in exclude:
            continue
        param = weight_of(model, local)
        is_expert = wm.is_expert(global_name)
        full = _full_shape(param, wm.tp_dim(global_name), tp_rank_and_size(is_expert)[1])
        for hf_name, shape in wm.expected_hf_shapes(global_name, full).items():
            if reader.shape(hf_name) != shape:
                raise CheckpointError(
                    f"{reader.file_of(hf_name)}: tensor {hf_name!r} has shape {list(reader.shape(hf_name))} "
                    f"but config.json ({arch.name}) implies {list(shape)} (megatron {global_name})"
                )


def _say_skipped(wm, names: list[str], reader: HFCheckpointReader) -> None:
    """One line per kind of skipped HF tensor (e.g. DeepSeek-V3's multi-token prediction)."""
    import logging

    reasons: dict[str, int] = {}
    for name in names:
        why = wm.skipped_hf_reason(name)
        if why is not None:
            reasons[why] = reasons.get(why, 0) + 1
    for why, count in reasons.items():
        logging.getLogger(__name__).warning("%s: skipping %d tensor(s) of %s", reader.dir, count, why)


@torch.no_grad()
def load_hf_weights(model, arch: ModelArchitecture, reader: HFCheckpointReader,
                    progress: Callable[[Iterator], Iterator] | None = None,
                    exclude: Collection[str] = ()) -> None:
    """Copy HF weights into this rank's shard of ``model`` (any TP/PP/EP layout).

    Parameters whose global megatron name is in ``exclude`` keep their values.
    """
    check_hf_checkpoint(model, arch, reader, exclude)
    wm = arch.weight_map
    items = [(local, name) for local, name in global_weight_names(model).items() if name not in exclude]
    for local, global_name in (progress(items) if progress else items):
        param = weight_of(model, local)
        full = wm.to_megatron(global_name, {h: reader.get(h) for h in wm.hf_names(global_name)})
        rank, size = tp_rank_and_size(wm.is_expert(global_name))
        shard = wm.split_tp(global_name, full, size)[rank]
        param.copy_(shard.to(param.dtype))


def hf_tensors_from_model(model, arch: ModelArchitecture, dtype: torch.dtype | None = None
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of a model built at TP=PP=EP=1 (the mg -> hf converter).

    Sharded layouts gather first (the resharding flow does that per parameter with
    `WeightMap.gather_tp`).
    """
    from megatron.core import parallel_state as ps

    if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size()) != (1, 1, 1):
        raise RuntimeError("hf_tensors_from_model needs the whole model on one rank (TP=PP=EP=1)")
    buffers = global_weight_buffer_names(model)
    for local, global_name in global_weight_names(model).items():
        param = weight_of(model, local).detach()
        for hf_name, tensor in arch.weight_map.to_hf(global_name, param):
            # Weight buffers stay float32 (megatron keeps them so; DeepSeek-V3 ships them so).
            yield hf_name, tensor if dtype is None or local in buffers else tensor.to(dtype)

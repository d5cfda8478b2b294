"""LoRA adapters on megatron-core's tensor-parallel linears (GRPO-LoRA).

An adapted linear computes ``y = W x + (alpha / r) * B (A x)`` with A [r, in] and
B [out, r]; B starts at zero (Hu et al. 2021), so step 0 is the base model exactly. The
backbone is frozen: megatron's DDP and optimizer only see ``requires_grad`` parameters, so
the frozen weights get no gradient buffer and no optimizer state.

The A/B split that keeps every layout exact (the one MindSpeed-LLM and PEFT use):

- column-parallel base (``linear_qkv``, ``linear_fc1``; W split by output rows): A whole on
  every TP rank, B split by rows like W. ``A x`` is computed before entering the
  tensor-parallel region, whose backward all-reduces the gradient of ``A x``, so A's
  gradient is the full one on every rank; with sequence parallelism ``A x`` is all-gathered
  along the sequence (backward: reduce-scatter) and A's gradient, partial over the
  sequence shards, is all-reduced by megatron like a norm's (``sequence_parallel`` tag).
- row-parallel base (``linear_proj``, ``linear_fc2``; W split by input columns): A split by
  columns like W, B whole. ``A_k x_k`` is all-reduced (with sequence parallelism:
  reduce-scattered) to ``A x`` before B; B's gradient under sequence parallelism is partial
  over the sequence shards and tagged like A above.

So each rank's merged shard ``W_k + s B_k A`` (column) or ``W_k + s B A_k`` (row) is exactly
that rank's shard of ``W + s B A``: `delta_weight` is what the resharding flow adds to the
backbone before vLLM receives it, and what the exporter merges.

``linear_fc1`` of a gated MLP (SwiGLU: llama, qwen2, qwen3) holds rank k's rows as
[gate_k; up_k], so its B does too. In checkpoints megatron-core stores the weight in the
global [gate; up] layout (``apply_swiglu_sharded_factory``), which loads at any TP; B is
stored the same way here. Checkpoints written before that (no ``fc1_lora_B_layout`` in
their lora record) hold B in the rank-interleaved order [gate_0; up_0; gate_1; up_1...] of
the TP they were saved at: :func:`rank_local_fc1_rows` loads them at that TP (a resume) and
:func:`regroup_gate_up_rows` converts the whole tensor (the exporter).

The adapters are added to the megatron modules in place (their class becomes a subclass
with the adapter path), so the backbone keeps megatron's parameter names and every weight
map, loader and checkpoint of the base model applies unchanged; the adapter parameters are
``<linear>.lora_A.weight`` and ``<linear>.lora_B.weight``.

Why not a library: megatron-core 0.16 has no LoRA for its parallel linears;
Megatron-Bridge's needs Transformer Engine, CUDA and transformers < 5; PEFT 0.21's
``LoraParallelLinear`` calls ``lora_B(lora_A(x))`` on megatron linears, which return
``(output, bias)`` tuples, rewrites the shared ``TransformerConfig.params_dtype`` to fp32,
and leaves the replicated factor untagged under sequence parallelism (silently wrong
gradients). PEFT is used for its adapter file format (`mindspeed_rl.checkpoint.lora_export`).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator

import torch

TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ADAPTER_MARKERS = (".lora_A.", ".lora_B.")
# The lora record's key and value (checkpoint common state) saying B of linear_fc1 is stored
# in the global [gate; up] layout; absent in checkpoints written before it was.
FC1_B_LAYOUT_KEY, FC1_B_GLOBAL = "fc1_lora_B_layout", "global_gate_up"


def is_adapter_name(name: str) -> bool:
    """Whether a parameter (or state-dict key) name belongs to a LoRA adapter."""
    return any(marker in name for marker in ADAPTER_MARKERS)


class _LoraMixin:
    """The adapter path of a megatron parallel linear; see the module docstring."""

    lora_column: bool
    lora_gate_up = False        # linear_fc1 of a gated MLP: B's rows are [gate_k; up_k]
    lora_rank_local_rows = False  # load a pre-layout checkpoint (rank_local_fc1_rows)

    def _init_lora(self, r: int, alpha: float, seed: int) -> None:
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        w = self.weight
        out_local, in_local = w.shape
        full_in = in_local if self.lora_column else in_local * tp
        self.lora_r, self.lora_scaling, self.lora_enabled = r, alpha / r, True
        # A as nn.Linear's kaiming-uniform (as LoRA/PEFT), drawn whole from a generator seeded
        # by (seed, layer) so every TP layout starts from the same full A.
        gen = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(full_in)
        a_full = (torch.rand(r, full_in, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        a = a_full if self.lora_column else a_full.chunk(tp, dim=1)[rank]
        self.lora_A = torch.nn.Linear(a.shape[1], r, bias=False, device=w.device, dtype=w.dtype)
        # B: this rank's output rows (column-parallel: out/tp; row-parallel: all of out)
        self.lora_B = torch.nn.Linear(r, out_local, bias=False, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()
        sharded = self.lora_B.weight if self.lora_column else self.lora_A.weight
        replicated = self.lora_A.weight if self.lora_column else self.lora_B.weight
        # megatron's TP attributes: grad-norm clipping counts a TP-split tensor once per
        # rank and a replicated one once; the resharding flow reads partition_dim.
        sharded.tensor_model_parallel = True
        sharded.partition_dim = 0 if self.lora_column else 1
        sharded.partition_stride = 1
        replicated.tensor_model_parallel = False
        # Under sequence parallelism the replicated factor sees one sequence shard per rank:
        # megatron all-reduces the grads of parameters tagged like this (as for norms).
        replicated.sequence_parallel = bool(self.sequence_parallel)

    def _lora_delta_output(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        a, b = self.lora_A.weight, self.lora_B.weight
        if self.lora_column:
            z = torch.matmul(x, a.t())                               # [s(/tp), b, r]
            if self.sequence_parallel:
                z = mappings.gather_from_sequence_parallel_region(z, group=self.tp_group)
            else:
                z = mappings.copy_to_tensor_model_parallel_region(z, group=self.tp_group)
        else:
            z = torch.matmul(x, a.t())                               # [s, b, r] partial sum
            if self.sequence_parallel:
                z = mappings.reduce_scatter_to_sequence_parallel_region(z, group=self.tp_group)
            else:
                z = mappings.reduce_from_tensor_model_parallel_region(z, group=self.tp_group)
        return torch.matmul(z, b.t()) * self.lora_scaling

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if self.lora_enabled:
            output = output + self._lora_delta_output(input_).to(output.dtype)
        return output, bias

    def delta_weight(self, source=lambda p: p) -> torch.Tensor:
        """This rank's shard of ``(alpha / r) B A``, the shape of its backbone shard.

        ``source(param)`` gives the tensor to read (a host copy while the training state
        is swapped out)."""
        a = source(self.lora_A.weight).float()
        b = source(self.lora_B.weight).float()
        return (b @ a) * self.lora_scaling

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = ({"weight": 0, "bias": 0, "lora_B.weight": 0} if self.lora_column
                else {"weight": 1, "lora_A.weight": 1})
        state = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if self.lora_gate_up and not self.lora_rank_local_rows:
            # B as the weight: megatron's MLP rewrites only linear_fc1's weight and bias into
            # the global [gate; up] layout, so B's rank-interleaved rows would be saved as
            # they lie and read wrongly at any other TP (and by the exporter, at TP 1).
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_B.weight"
            state[key] = apply_swiglu_sharded_factory(
                state[key], sharded_offsets, metadata.get("singleton_local_shards", False))
        return state


_CLASSES: dict[type, type] = {}


def _lora_class(base_cls: type, column: bool) -> type:
    if base_cls not in _CLASSES:
        _CLASSES[base_cls] = type(f"Lora{base_cls.__name__}", (_LoraMixin, base_cls),
                                  {"lora_column": column})
    return _CLASSES[base_cls]


def add_lora_adapters(model, target_modules, r: int, alpha: float, seed: int) -> int:
    """Adapt ``target_modules`` of every decoder layer of ``model`` (a GPTModel stage) and
    freeze everything else. Returns the number of adapted linears on this rank."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    unknown = set(target_modules) - set(TARGET_MODULES)
    if unknown:
        raise ValueError(f"actor_config.lora_target_modules: {sorted(unknown)} are not "
                         f"among {list(TARGET_MODULES)}")
    model.requires_grad_(False)
    count = 0
    for layer in model.decoder.layers:
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in target_modules or ".experts." in f".{name}.":
                continue
            if isinstance(module, ColumnParallelLinear):
                column = True
            elif isinstance(module, RowParallelLinear):
                column = False
            else:
                raise TypeError(f"{name}: {type(module).__name__} is not a megatron-core "
                                "parallel linear; LoRA adapts only those")
            module.__class__ = _lora_class(type(module), column)
            module.lora_gate_up = leaf == "linear_fc1" and bool(model.config.gated_linear_unit)
            global_name = f"decoder.layers.{layer.layer_number - 1}.{name}"
            module._init_lora(r, alpha, seed=zlib.crc32(f"{seed}:{global_name}".encode()))
            count += 1
    if count == 0:
        raise ValueError(f"actor_config.lora_target_modules={list(target_modules)}: the model "
                         "has none of these linears")
    return count


def adapted_modules(model) -> dict[str, torch.nn.Module]:
    """Local module name -> adapted linear, for this rank's stage."""
    return {name: m for name, m in model.named_modules() if isinstance(m, _LoraMixin)}


def has_adapters(model) -> bool:
    return any(isinstance(m, _LoraMixin) for m in model.modules())


def lora_settings(model) -> dict | None:
    """``{"r", "alpha", "target_modules"}`` of the model's adapters (None without any)."""
    modules = list(adapted_modules(model).items())
    if not modules:
        return None
    m = modules[0][1]
    targets = sorted({name.rsplit(".", 1)[-1] for name, _ in modules},
                     key=TARGET_MODULES.index)
    return {"r": m.lora_r, "alpha": m.lora_scaling * m.lora_r, "target_modules": targets}


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """The backbone alone (the shared-backbone reference): adapters skipped inside."""
    modules = [m for m in model.modules() if isinstance(m, _LoraMixin)]
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.lora_enabled = True


@contextlib.contextmanager
def rank_local_fc1_rows(model) -> Iterator[None]:
    """Inside, linear_fc1's B is described to dist_checkpointing as each rank's rows as they
    lie ([gate_k; up_k]), the layout of checkpoints written before the global one: loading
    such a checkpoint at the TP it was saved at restores B exactly."""
    modules = [m for m in adapted_modules(model).values() if m.lora_gate_up]
    for m in modules:
        m.lora_rank_local_rows = True
    try:
        yield
    finally:
        for m in modules:
            m.lora_rank_local_rows = False


@torch.no_grad()
def regroup_gate_up_rows(model, saved_tp: int) -> int:
    """Rewrite linear_fc1's whole B (a TP=1 model) from the rank-interleaved order of a
    checkpoint saved at ``saved_tp`` ([gate_0; up_0; gate_1; up_1...]) to [gate; up].
    Returns the number of tensors rewritten."""
    count = 0
    for m in adapted_modules(model).values():
        if m.lora_gate_up and saved_tp > 1:
            b = m.lora_B.weight
            rows, r = b.shape
            b.copy_(b.view(saved_tp, 2, rows // (2 * saved_tp), r).transpose(0, 1).reshape(rows, r))
            count += 1
    return count


@torch.no_grad()
def merge_adapters(model) -> None:
    """Fold every adapter into its backbone weight and zero B (the model then computes the
    same function with plain weights; used by the exporter on a copy of the model)."""
    for m in adapted_modules(model).values():
        m.weight.add_(m.delta_weight().to(m.weight.dtype))
        m.lora_B.weight.zero_()

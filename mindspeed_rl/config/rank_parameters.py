"""Parameters one rank holds in a sharded model: the plan's memory estimate counts these.

Megatron (training) shards column/row-parallel weights by TP (attention projections, the
dense MLP, shared experts, the padded vocabulary), replicates norms and the router, splits
layers by PP (``num_layer_list`` for uneven stages) and routed experts by EP x expert-TP.
Multi-latent attention (DeepSeek-V3) splits its up and output projections by heads; its
down projections are column-parallel in megatron-core's local spec (split by TP) and
replicated in vLLM. MoE models with dense first layers (``first_k_dense_replace``) count
each layer as what it is, so uneven stages are weighed by their own layers.
"""

from __future__ import annotations

from mindspeed_rl.config.model_spec import ModelSpec

_VOCAB_PADDING = 128


def padded_vocab_size(vocab_size: int) -> int:
    """Vocabulary rows megatron allocates: padded so every TP size dividing 128 splits it
    evenly. The padding does not depend on TP, so one checkpoint loads at every layout (the
    models' weight maps and the dry run read this one rule)."""
    return -(-vocab_size // _VOCAB_PADDING) * _VOCAB_PADDING


def attention_params_per_rank(model: ModelSpec, tp: int, *, split_down_projections: bool = True
                              ) -> int:
    """One layer's attention on one of ``tp`` ranks (GQA heads replicate when TP > KV heads)."""
    if model.is_mla:
        return model.mla_parameters(tp=tp, split_down_projections=split_down_projections)
    h, d = model.hidden_size, model.kv_channels
    q_heads = model.num_attention_heads // tp
    kv_heads = max(model.num_kv_heads // tp, 1)
    attention = 2 * h * q_heads * d + 2 * h * kv_heads * d + (2 * d if model.has_qk_norm else 0)
    if model.has_qkv_bias:
        attention += (q_heads + 2 * kv_heads) * d
    return attention


def layer_params_per_rank(model: ModelSpec, layer: int, *, tp: int, ep: int, expert_tp: int,
                          split_down_projections: bool = True) -> tuple[int, int]:
    """``(dense, routed_experts)`` parameters of decoder layer ``layer`` on one rank."""
    h = model.hidden_size
    dense = attention_params_per_rank(model, tp, split_down_projections=split_down_projections)
    dense += 2 * h                                         # input and pre-MLP norms
    if not model.is_moe_layer(layer):
        return dense + 3 * h * model.intermediate_size // tp, 0
    dense += model.router_parameters_per_layer()
    shared = model.shared_experts_intermediate_size
    if shared:
        dense += 3 * h * shared // tp + (0 if model.n_shared_experts else h)
    experts = (model.num_experts // ep) * 3 * h * model.moe_intermediate_size // expert_tp
    return dense, experts


def params_per_rank(model: ModelSpec, *, tp: int, pp: int, ep: int = 1,
                    expert_tp: int | None = None, stage_layers: list[int] | None = None,
                    split_down_projections: bool = True) -> tuple[int, int]:
    """Parameters held by the heaviest rank: ``(dense, routed_experts)``.

    With PP > 1 the heaviest stage is the one whose layers, plus the embedding (first
    stage) or the output layer and final norm (last stage; a tied model keeps a copy),
    weigh most. ``stage_layers``: layers per stage (even split when None).
    """
    expert_tp = expert_tp or tp
    h = model.hidden_size
    if stage_layers is None:
        stage_layers = [-(-model.num_hidden_layers // pp)] * pp
    vocab_shard = -(-padded_vocab_size(model.vocab_size) // tp) * h
    stages, first = [], 0
    for s, count in enumerate(stage_layers):
        layers = [layer_params_per_rank(model, i, tp=tp, ep=ep, expert_tp=expert_tp,
                                        split_down_projections=split_down_projections)
                  for i in range(first, first + count)]
        first += count
        dense = sum(d for d, _ in layers)
        if s == 0:
            dense += vocab_shard
        if s == pp - 1:
            dense += h + (vocab_shard if pp > 1 or not model.tie_word_embeddings else 0)
        stages.append((dense, sum(e for _, e in layers)))
    return max(stages, key=sum)

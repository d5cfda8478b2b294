"""The two shardings of the actor, described and validated in one place.

Training uses Megatron's TP x CP x PP x DP (with EP for MoE experts, optional
sequence parallelism, and context parallelism CP splitting each sequence); generation
uses vLLM's TP_g x DP_g with PP_g = 1.
Both must tile the same world of ranks (docs/resharding.md, docs/config.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


class LayoutError(ValueError):
    """A parallel layout that cannot tile the world; the message names the keys."""


@dataclass(frozen=True)
class ParallelLayout:
    """Training and generation layouts of one job, validated on construction.

    Field names match the YAML keys users write (MindSpeed-RL / Megatron style),
    so an error can name exactly what to change.
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: same as tensor_model_parallel_size
    sequence_parallel: bool = False
    infer_tensor_parallel_size: int = 1
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sequence_parallel":
                if not isinstance(value, bool):
                    raise LayoutError(f"sequence_parallel={value!r} must be true or false")
                continue
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{f.name}={value!r} must be a positive integer")

        ws = self.world_size
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if ws % (tp * pp):
            raise LayoutError(
                f"world_size={ws} is not divisible by tensor_model_parallel_size={tp} x "
                f"pipeline_model_parallel_size={pp} = {tp * pp}; choose TP and PP whose "
                f"product divides {ws}"
            )
        cp = self.context_parallel_size
        if ws % (tp * cp * pp):
            raise LayoutError(
                f"context_parallel_size={cp} does not divide world_size={ws} / "
                f"(tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp}) = "
                f"{ws // (tp * pp)} ranks; use a CP size that divides {ws // (tp * pp)}"
            )
        ep, etp = self.expert_model_parallel_size, self.expert_tp
        if ws % (etp * ep * pp):
            raise LayoutError(
                f"world_size={ws} is not divisible by expert_tensor_parallel_size={etp} x "
                f"expert_model_parallel_size={ep} x pipeline_model_parallel_size={pp} = "
                f"{etp * ep * pp}; lower expert_model_parallel_size"
            )
        if self.sequence_parallel and tp == 1:
            raise LayoutError(
                "sequence_parallel=true needs tensor_model_parallel_size > 1 "
                f"(got {tp}); set sequence_parallel: false or raise TP"
            )
        tpg = self.infer_tensor_parallel_size
        if ws % tpg:
            raise LayoutError(
                f"world_size={ws} is not divisible by infer_tensor_parallel_size={tpg}; "
                f"choose a vLLM TP size that divides {ws}"
            )

    # ---- derived sizes -------------------------------------------------------
    @property
    def expert_tp(self) -> int:
        """Tensor-parallel size of expert layers (defaults to the dense TP)."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Training DP size: world / (TP x CP x PP)."""
        return self.world_size // (self.tensor_model_parallel_size * self.context_parallel_size
                                   * self.pipeline_model_parallel_size)

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // (
            self.expert_tp * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        )

    @property
    def infer_data_parallel_size(self) -> int:
        """Generation DP size: world / TP_g (vLLM runs without pipeline parallelism)."""
        return self.world_size // self.infer_tensor_parallel_size

    def check_model(self, *, num_attention_heads: int, num_query_groups: int,
                    num_layers: int, num_experts: int | None = None,
                    num_layer_list: str | None = None,
                    context_parallel_algo: str = "megatron_cp_algo") -> None:
        """Check the divisibilities that depend on the model's shape (Ulysses context
        parallelism shards heads over TP x CP)."""
        tp, pp, tpg = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                       self.infer_tensor_parallel_size)
        cp = self.context_parallel_size
        if cp > 1 and context_parallel_algo == "ulysses_cp_algo":
            for what, heads in (("num_attention_heads", num_attention_heads),
                                ("num_key_value_heads", num_query_groups)):
                if heads % (tp * cp):
                    raise LayoutError(
                        f"context_parallel_algo='ulysses_cp_algo' shards attention heads over "
                        f"tensor_model_parallel_size={tp} x context_parallel_size={cp} = "
                        f"{tp * cp} ranks, which does not divide the model's {what}={heads}; "
                        "lower TP or CP so that TP x CP divides the query and KV heads, or "
                        "use context_parallel_algo: megatron_cp_algo (ring attention)"
                    )
        for key, size in (("tensor_model_parallel_size", tp), ("infer_tensor_parallel_size", tpg)):
            if num_attention_heads % size:
                raise LayoutError(
                    f"{key}={size} does not divide the model's num_attention_heads="
                    f"{num_attention_heads}"
                )
            if num_query_groups % size and size % num_query_groups:
                raise LayoutError(
                    f"{key}={size} and the model's num_key_value_heads={num_query_groups}: "
                    "one must divide the other"
                )
        if num_layer_list is not None:
            pipeline_stage_layers(num_layers, pp, num_layer_list)
        elif num_layers % pp:
            raise LayoutError(
                f"pipeline_model_parallel_size={pp} does not divide the model's "
                f"num_layers={num_layers}"
            )
        if num_experts is not None and num_experts % self.expert_model_parallel_size:
            raise LayoutError(
                f"expert_model_parallel_size={self.expert_model_parallel_size} does not divide "
                f"the model's num_experts={num_experts}"
            )

    def describe(self) -> str:
        return (
            f"world={self.world_size}: train TP={self.tensor_model_parallel_size} "
            f"CP={self.context_parallel_size} "
            f"PP={self.pipeline_model_parallel_size} DP={self.data_parallel_size} "
            f"EP={self.expert_model_parallel_size} SP={self.sequence_parallel}; "
            f"generate TP={self.infer_tensor_parallel_size} DP={self.infer_data_parallel_size}"
        )


def pipeline_stage_layers(num_layers: int, pipeline_model_parallel_size: int,
                          num_layer_list: str | None = None) -> list[int]:
    """Transformer layers of each pipeline stage.

    ``num_layer_list`` ("16,17,16,15", MindSpeed-LLM's key) gives them explicitly; without
    it the layers split evenly. Raises `LayoutError` naming the key when the list does not
    fit the model and the pipeline size.
    """
    pp = pipeline_model_parallel_size
    if num_layer_list is None:
        if num_layers % pp:
            raise LayoutError(f"pipeline_model_parallel_size={pp} does not divide the model's "
                              f"num_layers={num_layers}")
        return [num_layers // pp] * pp
    try:
        counts = [int(t) for t in str(num_layer_list).replace(" ", "").split(",") if t]
    except ValueError:
        raise LayoutError(f"num_layer_list={num_layer_list!r} must be comma-separated layer "
                          "counts, one per pipeline stage, e.g. '16,17,16,15'") from None
    if len(counts) != pp:
        raise LayoutError(f"num_layer_list={num_layer_list!r} names {len(counts)} stages but "
                          f"pipeline_model_parallel_size={pp}")
    if any(c < 1 for c in counts):
        raise LayoutError(f"num_layer_list={num_layer_list!r}: every pipeline stage needs at "
                          "least one layer")
    if sum(counts) != num_layers:
        raise LayoutError(f"num_layer_list={num_layer_list!r} adds up to {sum(counts)} layers "
                          f"but the model has num_layers={num_layers}")
    return counts

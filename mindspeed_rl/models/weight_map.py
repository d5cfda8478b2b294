"""The HF <-> megatron weight map engine: rules in, per-parameter conversions out.

Each architecture module declares *what* maps to what as a table of `Rule`s
(megatron name template, HF name templates, how the tensors combine). This
module knows *how*: fused QKV with grouped-query attention, fused gate/up of
SwiGLU MLPs, vocabulary padding, and tensor-parallel split/gather of each kind.

Everything here works on FULL (TP-unsharded) tensors named with GLOBAL megatron
names: layer ``i`` is the model's i-th decoder layer (not the PP stage's local
index) and expert ``j`` is the global expert id (not the EP rank's local index).
`mindspeed_rl.models.builder.global_parameter_names` turns a stage's local
names into global ones. Functions are pure: no torch.distributed, no globals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

COPY = "copy"          # one HF tensor, same layout
QKV = "qkv"            # q, k, v -> megatron's per-query-group interleaved linear_qkv
GATE_UP = "gate_up"    # gate, up -> [gate; up] along dim 0 (linear_fc1 of SwiGLU)
VOCAB = "vocab"        # one HF tensor whose dim 0 is the vocabulary, padded in megatron

# Rule scopes: which megatron parameters a rule produces.
GLOBAL = "global"      # once per model (embedding, final norm, output layer)
LAYER = "layer"        # every decoder layer
DENSE = "dense"        # decoder layers with a dense MLP
MOE = "moe"            # decoder layers with a mixture-of-experts MLP (once per layer)
EXPERT = "expert"      # decoder layers with MoE, once per expert

_LAYER_PREFIX_MG = "decoder.layers.{layer}."
_LAYER_PREFIX_HF = "model.layers.{layer}."


@dataclass(frozen=True)
class Rule:
    """One megatron parameter and the HF tensors it is made of.

    Templates may use ``{layer}`` and ``{expert}``; layer-scoped templates are
    relative to ``decoder.layers.{layer}.`` (megatron) and ``model.layers.{layer}.`` (HF).
    ``tp_dim`` is the dimension megatron partitions across tensor-parallel ranks
    (0 column-parallel, 1 row-parallel, None replicated), matching the
    ``partition_dim`` attribute megatron sets on the parameter.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str = COPY
    tp_dim: int | None = None
    scope: str = LAYER

    def full_names(self, layer: int | None = None, expert: int | None = None) -> tuple[str, tuple[str, ...]]:
        mg, hf = self.megatron, self.hf
        if self.scope != GLOBAL:
            mg = _LAYER_PREFIX_MG + mg
            hf = tuple(_LAYER_PREFIX_HF + h for h in hf)
        fmt = {"layer": layer, "expert": expert}
        return mg.format(**fmt), tuple(h.format(**fmt) for h in hf)


@dataclass(frozen=True)
class AttentionGeometry:
    """The shapes the tensor transforms need."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int          # rows the HF checkpoint has
    padded_vocab_size: int   # rows megatron has (vocab_size rounded up; layout-independent)


# ---- pure tensor transforms ------------------------------------------------------------

def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, geometry: AttentionGeometry) -> torch.Tensor:
    """HF q/k/v projections -> megatron linear_qkv.

    q: [heads * d, *rest], k and v: [groups * d, *rest] (rest is (hidden,) for weights, () for
    biases) -> [groups * (heads/groups + 2) * d, *rest], for each query group g its query
    heads, then k_g, then v_g. Contiguous groups make a TP split a plain chunk of dim 0.
    """
    ng, d = geometry.num_query_groups, geometry.head_dim
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(ng, -1, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def unpack_qkv(fused: torch.Tensor, geometry: AttentionGeometry, *, copy: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack_qkv`: megatron linear_qkv -> (q, k, v) in HF layout; with
    ``copy=False`` each may be a view of ``fused`` (one group: no copy at all)."""
    ng, d = geometry.num_query_groups, geometry.head_dim
    q_per_group = geometry.num_attention_heads // ng
    rest = fused.shape[1:]
    grouped = fused.reshape(ng, (q_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [q_per_group * d, d, d], dim=1)
    return tuple(_owned(t.reshape(-1, *rest), fused, copy) for t in (q, k, v))


def _owned(t: torch.Tensor, source: torch.Tensor, copy: bool) -> torch.Tensor:
    """``t``, cloned when ``copy`` and it still shares ``source``'s storage (a reshape of a
    non-contiguous split has already copied)."""
    shares = t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    return t.clone() if copy and shares else t


def pad_vocab(t: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """[vocab, hidden] -> [padded_vocab, hidden]; the extra rows are zeros (never sampled)."""
    extra = padded_vocab_size - t.shape[0]
    if extra < 0:
        raise ValueError(f"vocabulary of {t.shape[0]} rows exceeds padded size {padded_vocab_size}")
    if extra == 0:
        return t.clone()
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])], dim=0)


# ---- the map -----------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.local_experts\.(\d+)\.")


class WeightMap:
    """Two-way HF <-> megatron map of one model, per megatron parameter.

    ``moe_layers[i]`` says whether global decoder layer i has a mixture-of-experts MLP.
    """

    def __init__(self, rules: Iterable[Rule], geometry: AttentionGeometry, *, num_layers: int,
                 moe_layers: tuple[bool, ...] | None = None, num_experts: int = 0,
                 tie_embeddings: bool = False, ignored_hf: tuple[str, ...] = (),
                 skipped_hf: Mapping[str, str] | None = None):
        self.rules = tuple(rules)
        self.geometry = geometry
        self.num_layers = num_layers
        self.moe_layers = moe_layers or (False,) * num_layers
        self.num_experts = num_experts
        self.tie_embeddings = tie_embeddings
        # HF tensors that carry no information for megatron (rotary caches, the tied lm_head).
        self.ignored_hf_patterns = tuple(ignored_hf)
        self._ignored_hf = tuple(re.compile(p) for p in ignored_hf)
        # HF tensors that carry information megatron does not use (pattern -> why): ignored
        # like the above, but the converters say once that they were skipped.
        self._skipped_hf = {re.compile(p): why for p, why in (skipped_hf or {}).items()}
        self._entries: dict[str, tuple[Rule, tuple[str, ...]]] = {}
        for rule in self.rules:
            for layer, expert in self._instances(rule):
                mg, hf = rule.full_names(layer, expert)
                self._entries[mg] = (rule, hf)
        self._hf_to_mg = {h: mg for mg, (_, hf) in self._entries.items() for h in hf}

    def _instances(self, rule: Rule):
        if rule.scope == GLOBAL:
            if rule.megatron == "output_layer.weight" and self.tie_embeddings:
                return
            yield None, None
            return
        for layer in range(self.num_layers):
            moe = self.moe_layers[layer]
            if rule.scope == LAYER or (rule.scope == DENSE and not moe) or (rule.scope == MOE and moe):
                yield layer, None
            elif rule.scope == EXPERT and moe:
                for expert in range(self.num_experts):
                    yield layer, expert

    # ---- names ---------------------------------------------------------------------------
    def megatron_names(self) -> list[str]:
        """Every global megatron parameter name of the whole model (all stages, all experts)."""
        return list(self._entries)

    def hf_names(self, megatron_name: str) -> tuple[str, ...]:
        """The HF tensor names that make up one megatron parameter."""
        return self._entry(megatron_name)[1]

    def all_hf_names(self) -> list[str]:
        return list(self._hf_to_mg)

    def is_ignored_hf(self, hf_name: str) -> bool:
        return (any(p.fullmatch(hf_name) for p in self._ignored_hf)
                or self.skipped_hf_reason(hf_name) is not None)

    def skipped_hf_reason(self, hf_name: str) -> str | None:
        """Why an HF tensor is skipped (None: it is not one of the skipped ones)."""
        return next((why for p, why in self._skipped_hf.items() if p.fullmatch(hf_name)), None)

    def tp_dim(self, megatron_name: str) -> int | None:
        """The dimension megatron splits across TP ranks (None: replicated)."""
        return self._entry(megatron_name)[0].tp_dim

    def is_expert(self, megatron_name: str) -> bool:
        """Expert parameters are split across EP ranks (and across expert-TP ranks)."""
        return self._entry(megatron_name)[0].scope == EXPERT

    @staticmethod
    def layer_index(megatron_name: str) -> int | None:
        m = _LAYER_RE.match(megatron_name)
        return int(m.group(1)) if m else None

    def _entry(self, megatron_name: str) -> tuple[Rule, tuple[str, ...]]:
        if megatron_name == "output_layer.weight" and self.tie_embeddings:
            # With PP > 1 the last stage holds a copy of the tied embedding as its output layer.
            megatron_name = "embedding.word_embeddings.weight"
        try:
            return self._entries[megatron_name]
        except KeyError:
            raise KeyError(
                f"{megatron_name!r} is not a parameter of this model (global megatron names "
                f"look like {next(iter(self._entries))!r})"
            ) from None

    # ---- conversions (full tensors) ----------------------------------------------------
    def to_hf(self, megatron_name: str, tensor: torch.Tensor, *, copy: bool = True
              ) -> list[tuple[str, torch.Tensor]]:
        """One full megatron parameter -> [(hf_name, tensor), ...]; the tensors own their
        storage, or with ``copy=False`` may be views of ``tensor`` (for a reader that copies
        them anyway, as vLLM's weight loaders do)."""
        rule, hf = self._entry(megatron_name)
        g = self.geometry
        if rule.kind == COPY:
            return [(hf[0], _owned(tensor, tensor, copy))]
        if rule.kind == VOCAB:
            return [(hf[0], _owned(tensor[: g.vocab_size], tensor, copy))]
        if rule.kind == QKV:
            return list(zip(hf, unpack_qkv(tensor, g, copy=copy)))
        if rule.kind == GATE_UP:
            return [(name, _owned(half, tensor, copy))
                    for name, half in zip(hf, torch.chunk(tensor, 2, dim=0))]
        raise AssertionError(rule.kind)

    def to_megatron(self, megatron_name: str, hf_tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The HF tensors named by `hf_names(megatron_name)` -> the full megatron parameter."""
        rule, hf = self._entry(megatron_name)
        parts = [hf_tensors[h] for h in hf]
        if rule.kind == COPY:
            return parts[0].clone()
        if rule.kind == VOCAB:
            return pad_vocab(parts[0], self.geometry.padded_vocab_size)
        if rule.kind == QKV:
            return pack_qkv(*parts, self.geometry)
        if rule.kind == GATE_UP:
            return torch.cat(parts, dim=0)
        raise AssertionError(rule.kind)

    def expected_hf_shapes(self, megatron_name: str, megatron_shape: torch.Size) -> dict[str, tuple[int, ...]]:
        """The HF shapes a megatron parameter of ``megatron_shape`` is made of (for validation)."""
        meta = torch.empty(megatron_shape, device="meta")
        return {name: tuple(t.shape) for name, t in self.to_hf(megatron_name, meta)}

    # ---- tensor parallelism ----------------------------------------------------------
    def split_tp(self, megatron_name: str, full: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
        """Full parameter -> the TP shards megatron holds, in TP-rank order."""
        rule = self._entry(megatron_name)[0]
        if rule.tp_dim is None or tp_size == 1:
            return [full] * tp_size
        if rule.kind == GATE_UP:
            # Each shard is [gate_shard; up_shard] so the SwiGLU split stays local to the rank.
            gates = torch.chunk(torch.chunk(full, 2, dim=0)[0], tp_size, dim=0)
            ups = torch.chunk(torch.chunk(full, 2, dim=0)[1], tp_size, dim=0)
            return [torch.cat([g, u], dim=0) for g, u in zip(gates, ups)]
        return list(torch.chunk(full, tp_size, dim=rule.tp_dim))

    def gather_tp(self, megatron_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `split_tp`: TP shards in rank order -> the full parameter."""
        rule = self._entry(megatron_name)[0]
        if rule.tp_dim is None or len(shards) == 1:
            return shards[0]
        if rule.kind == GATE_UP:
            halves = [torch.chunk(s, 2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=rule.tp_dim)

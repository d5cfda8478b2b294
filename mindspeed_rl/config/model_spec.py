"""`ModelSpec`: the architecture fields of the model, read without weights or torch.

The fields use Hugging Face ``config.json`` names, whether they come from an
HF directory or from a ``configs/model/<name>.yaml``; the dry-run needs only
these numbers (parameter counts, divisibility, KV-cache size). Building the
megatron model itself is ``mindspeed_rl.models``' job.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed_rl.config.config_error import ConfigError, ConfigErrors, show_value
from mindspeed_rl.config.megatron_model_yaml import (MEGATRON_TO_HF, is_megatron_model_yaml,
                                                     translate_megatron_model)
from mindspeed_rl.config.mindspeed_keys import underscored
from mindspeed_rl.config.typed_sections import build_section
from mindspeed_rl.config.yaml_source import read_yaml_file

MODEL_KEY = "megatron_training.model"

# HF config.json keys a model yaml may carry (pasted from config.json) that the
# dry-run does not need; any other unknown key is reported as a likely typo.
_HF_KEYS_NOT_NEEDED = frozenset({
    "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
    "initializer_range", "use_cache", "use_sliding_window", "sliding_window",
    "max_window_layers", "attention_dropout", "transformers_version", "rope_scaling",
    "rope_parameters", "layer_types", "decoder_sparse_step", "mlp_only_layers",
    "output_router_logits", "router_aux_loss_coef", "use_qk_norm",
    # DeepSeek-V3's config.json: remote-code, MTP-training and FP8 entries the plan does not use
    "auto_map", "aux_loss_alpha", "ep_size", "pretraining_tp", "quantization_config",
    "rope_interleave",
})

# Model types whose attention has q/k/v biases without saying so in config.json.
_QKV_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe"})
# Model types with RMSNorm on queries and keys (one head_dim vector each per layer).
_QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})
# Multi-latent attention and DeepSeek MoE (transformers' DeepseekV3Config field names).
MLA_MODEL_TYPES = frozenset({"deepseek_v3"})


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE scaling of config.json's ``rope_scaling`` (YaRN for DeepSeek-V3), HF names."""

    type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Architecture of a decoder-only LM (Llama / Qwen2 / Qwen3 / Qwen3-MoE family), HF names."""

    source: str                                  # the config.json or model yaml read, absolute
    hf_dir: str | None = None                    # the HF directory when the model is one
    model_type: str
    architectures: tuple[str, ...] = ()
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None       # None: no GQA (= num_attention_heads)
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None                  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    attention_bias: bool | None = None           # None: implied by model_type (qwen2: true)
    num_experts: int | None = None               # MoE: routed experts per layer
    moe_intermediate_size: int | None = None
    num_experts_per_tok: int | None = None
    shared_expert_intermediate_size: int | None = None
    # DeepSeek-V3 (MLA_MODEL_TYPES): multi-latent attention, routed + shared experts, dense
    # first layers, group-limited sigmoid routing with an expert bias, YaRN RoPE
    n_routed_experts: int | None = None          # its name for num_experts
    n_shared_experts: int | None = None          # shared expert: n x moe_intermediate_size
    first_k_dense_replace: int | None = None     # the first k layers have a dense MLP
    moe_layer_freq: int | None = None            # DeepSeek's config.json: 1 (every later layer)
    q_lora_rank: int | None = None               # None: queries projected directly
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    n_group: int | None = None                   # expert groups of group-limited routing
    topk_group: int | None = None                # groups a token may route to
    routed_scaling_factor: float | None = None
    norm_topk_prob: bool | None = None
    scoring_func: str | None = None              # DeepSeek's config.json: sigmoid
    topk_method: str | None = None               # noaux_tc: the router's expert bias
    seq_aux: bool | None = None                  # its balancing loss is per sequence
    num_nextn_predict_layers: int | None = None  # MTP layers: not used by RL, not built
    rope_scaling: RopeScaling | None = None
    tokenizer_name_or_path: str | None = None    # model yaml only: where its tokenizer lives
    # MindSpeed-RL model yamls also carry training keys (moe_aux_loss_coeff): the job keys
    # they set unless the job file sets them, as (dotted key, value) pairs.
    job_settings: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.n_routed_experts is not None and self.num_experts is None:
            object.__setattr__(self, "num_experts", self.n_routed_experts)

    # ---- derived shape -------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V3)."""
        return self.model_type in MLA_MODEL_TYPES

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Per-head dimension (megatron's kv_channels)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def has_qkv_bias(self) -> bool:
        if self.attention_bias is not None:
            return self.attention_bias
        return self.model_type in _QKV_BIAS_MODEL_TYPES

    @property
    def has_qk_norm(self) -> bool:
        return self.model_type in _QK_NORM_MODEL_TYPES

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def qk_head_dim(self) -> int:
        """MLA: query/key head size (the part without RoPE + the RoPE part)."""
        return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)

    @property
    def kv_latent_dim(self) -> int:
        """MLA: what vLLM caches per token and layer (the KV latent + the RoPE key)."""
        return (self.kv_lora_rank or 0) + (self.qk_rope_head_dim or 0)

    @property
    def attention_width(self) -> int:
        """Mean width of the two attention matmuls (QK^T and PV) over all heads."""
        if self.is_mla:
            return self.num_attention_heads * (self.qk_head_dim + self.v_head_dim) // 2
        return self.num_attention_heads * self.kv_channels

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has routed experts (DeepSeek-V3: all but
        the first ``first_k_dense_replace``)."""
        return self.is_moe and layer >= (self.first_k_dense_replace or 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def describe(self) -> str:
        arch = ", ".join(self.architectures) or self.model_type
        if self.is_mla:
            attention = (f"{self.num_attention_heads} heads, multi-latent attention (q_lora_rank "
                         f"{self.q_lora_rank}, kv_lora_rank {self.kv_lora_rank}, qk "
                         f"{self.qk_nope_head_dim} + {self.qk_rope_head_dim} RoPE, v "
                         f"{self.v_head_dim})")
        else:
            attention = (f"{self.num_attention_heads} heads / {self.num_kv_heads} KV heads x "
                         f"{self.kv_channels}")
        moe = ""
        if self.is_moe:
            moe = (f", {self.num_experts} experts (top-{self.num_experts_per_tok}, "
                   f"moe_intermediate {self.moe_intermediate_size})")
            if self.is_mla:
                moe += (f" + {self.n_shared_experts or 0} shared in {self.num_moe_layers} MoE "
                        f"layers (the first {self.first_k_dense_replace or 0} dense), "
                        f"{self.scoring_func or 'softmax'} router"
                        + (" with expert bias" if self.topk_method == "noaux_tc" else "")
                        + (f", {self.n_group} groups / top-{self.topk_group}"
                           if self.n_group else "")
                        + (f", scaling {self.routed_scaling_factor:g}"
                           if self.routed_scaling_factor else ""))
        rope = (f", RoPE {self.rope_scaling.type} x{self.rope_scaling.factor:g}"
                if self.rope_scaling and self.rope_scaling.factor else "")
        return (f"{self.model_type} ({arch}): {self.num_hidden_layers} layers, hidden "
                f"{self.hidden_size}, {attention}, intermediate {self.intermediate_size}, vocab "
                f"{self.vocab_size}, {'tied' if self.tie_word_embeddings else 'untied'} "
                f"embeddings{moe}{rope}")

    # ---- parameter counts (the HF model, unpadded vocabulary) ------------------------------
    def parameter_counts(self) -> dict[str, int]:
        """Parameters by part; ``total`` matches ``sum(p.numel())`` of the HF model (buffers
        such as DeepSeek-V3's expert bias and its MTP layers, which it does not build, are
        not counted)."""
        h, layers = self.hidden_size, self.num_hidden_layers
        embedding = self.vocab_size * h
        moe_layers = self.num_moe_layers
        counts = {
            "embedding": embedding,
            "output_layer": 0 if self.tie_word_embeddings else embedding,
            "attention": layers * self.attention_parameters_per_layer(),
            "mlp": ((layers - moe_layers) * 3 * h * self.intermediate_size
                    + moe_layers * self.mlp_parameters_per_layer()),
            "norms": layers * 2 * h + h,        # two RMSNorms per layer + the final one
        }
        counts["total"] = sum(counts.values())
        return counts

    def num_parameters(self) -> int:
        return self.parameter_counts()["total"]

    def attention_parameters_per_layer(self) -> int:
        if self.is_mla:
            return self.mla_parameters(tp=1, split_down_projections=True)
        h, d = self.hidden_size, self.kv_channels
        q, kv = self.num_attention_heads * d, self.num_kv_heads * d
        bias = (q + 2 * kv) if self.has_qkv_bias else 0
        qk_norm = 2 * d if self.has_qk_norm else 0
        return h * q + 2 * h * kv + bias + q * h + qk_norm

    def mla_parameters(self, *, tp: int, split_down_projections: bool) -> int:
        """Multi-latent attention of one layer on one of ``tp`` ranks: the query and KV down
        projections (split by TP in megatron-core's local spec, whole in vLLM), their
        RMSNorms (whole), the up projections and the output projection (split by heads)."""
        h, heads = self.hidden_size, self.num_attention_heads // tp
        down = tp if split_down_projections else 1
        if self.q_lora_rank:
            q = (h * self.q_lora_rank // down + self.q_lora_rank
                 + self.q_lora_rank * heads * self.qk_head_dim)
        else:
            q = h * heads * self.qk_head_dim
        kv = (h * self.kv_latent_dim // down + self.kv_lora_rank
              + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + heads * self.v_head_dim * h

    def mlp_parameters_per_layer(self) -> int:
        """Gated MLP (gate, up, down) or, for MoE, one MoE layer's router + experts (+ shared
        expert)."""
        h = self.hidden_size
        if not self.is_moe:
            return 3 * h * self.intermediate_size
        return self.router_parameters_per_layer() + self.expert_parameters_per_layer() + (
            self.shared_expert_parameters_per_layer())

    def active_body_parameters(self) -> int:
        """Non-embedding matmul parameters one token passes through (MoE: the router, top-k
        routed experts and the shared experts; dense layers their MLP)."""
        h, moe_layers = self.hidden_size, self.num_moe_layers
        active_moe = (self.router_parameters_per_layer()
                      + (self.num_experts_per_tok or 1) * 3 * h * (self.moe_intermediate_size or 0)
                      + self.shared_expert_parameters_per_layer())
        dense = (self.num_hidden_layers - moe_layers) * 3 * h * self.intermediate_size
        return (self.num_hidden_layers * self.attention_parameters_per_layer() + dense
                + moe_layers * active_moe)

    def router_parameters_per_layer(self) -> int:
        return self.hidden_size * self.num_experts if self.is_moe else 0

    def expert_parameters_per_layer(self) -> int:
        """All routed experts of one layer (sharded by EP in training)."""
        if not self.is_moe:
            return 0
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def shared_experts_intermediate_size(self) -> int:
        """Hidden size of the shared expert(s) of a MoE layer (0: none)."""
        if not self.is_moe:
            return 0
        if self.n_shared_experts:
            return self.n_shared_experts * self.moe_intermediate_size
        return self.shared_expert_intermediate_size or 0

    def shared_expert_parameters_per_layer(self) -> int:
        """Shared experts (dense, TP-sharded); Qwen2-MoE's also has a sigmoid gate."""
        size = self.shared_experts_intermediate_size
        gate = self.hidden_size if size and not self.n_shared_experts else 0
        return 3 * self.hidden_size * size + gate


def resolve_model_source(value: str, config_dir: Path) -> tuple[Path, bool]:
    """Where ``megatron_training.model`` points: ``(path, is_hf_dir)``.

    Relative paths resolve against the current working directory. A bare name
    (``qwen25_7b``, MindSpeed-RL style) is looked up as ``model/<name>.yaml`` next
    to the job config, i.e. ``configs/model/``.
    """
    path = Path(value).expanduser()
    path = path if path.is_absolute() else Path.cwd() / path
    if path.is_dir():
        return path, True
    if path.name == "config.json" and path.is_file():
        return path.parent, True
    if path.suffix in (".yaml", ".yml"):
        return path, False
    bare = Path(value)
    if len(bare.parts) == 1 and not bare.suffix:
        candidate = config_dir / "model" / f"{value}.yaml"
        if candidate.is_file():
            return candidate, False
    known = sorted(p.stem for p in (config_dir / "model").glob("*.yaml"))
    fix = ("point it at an HF model directory (with config.json) or at configs/model/<name>.yaml"
           + (f"; model yamls next to this config: {', '.join(known)}" if known else ""))
    raise ConfigError(MODEL_KEY, f"{path} is neither an HF model directory nor a model .yaml "
                      "file", fix, value=value)


# Megatron switches of the architecture that config.json does not state: the model's type
# implies them (name -> (what it builds, whether the model has it)).
IMPLIED_SWITCHES = {
    # RMSNorms on each head's queries and keys (Qwen3, Qwen3-MoE), or on the query and
    # key/value latents of multi-latent attention (DeepSeek-V3)
    "qk_layernorm": ("q/k norms", lambda m: m.has_qk_norm or m.is_mla),
}


def read_model_spec(path: Path, is_hf_dir: bool, *,
                    job_architecture: dict[str, tuple[str, Any]] | None = None,
                    notices: list[str] | None = None) -> ModelSpec:
    """Read the architecture fields from ``<hf_dir>/config.json`` or a model yaml.

    ``job_architecture``: Megatron architecture keys the job's sections write (Megatron
    name -> (dotted key, value)). MindSpeed-RL merges them over its model yaml; here the
    model's file is the one source (vLLM reads config.json too), so a value it states must
    agree and one it leaves out is filled in; a switch its type implies
    (``IMPLIED_SWITCHES``) must agree with the type; a line for each goes to ``notices``.
    """
    job = dict(job_architecture or {})
    implied = {name: job.pop(name) for name in IMPLIED_SWITCHES if name in job}
    spec = _read_model_file(path, is_hf_dir, job, notices)
    _check_implied_switches(spec, implied, notices)
    return spec


def _check_implied_switches(spec: ModelSpec, job: dict[str, tuple[str, Any]],
                            notices: list[str] | None) -> None:
    """The job's ``IMPLIED_SWITCHES`` against the model that was read."""
    problems = []
    model = f"the model ({spec.model_type}, in {Path(spec.source).name})"
    for name, (dotted, value) in job.items():
        what, has = IMPLIED_SWITCHES[name]
        stated = f"{model} {'has' if has(spec) else 'has no'} {what}"
        if not isinstance(value, bool):
            problems.append(ConfigError(dotted, "expected true or false",
                                        f"remove the key ({stated})", value=value))
        elif value != has(spec):
            problems.append(ConfigError(dotted, f"{stated}: the architecture has one source "
                                        "here, the model's file, which vLLM reads too",
                                        "remove the key (the model's file decides: its "
                                        f"model_type, or {name} in a MindSpeed-RL model yaml)",
                                        value=value))
        elif notices is not None:
            notices.append(f"{dotted}={show_value(value)}: {stated}: the same")
    if problems:
        raise ConfigErrors(problems, spec.source)


def _read_model_file(path: Path, is_hf_dir: bool, job_architecture: dict[str, tuple[str, Any]],
                     notices: list[str] | None) -> ModelSpec:
    """`read_model_spec` without the switches the model's type implies."""
    if is_hf_dir:
        config_json = path / "config.json"
        if not config_json.is_file():
            raise ConfigError(MODEL_KEY, f"HF model directory {path} has no config.json",
                              "point megatron_training.model at a directory holding config.json "
                              "(and the tokenizer files), or at configs/model/<name>.yaml",
                              value=str(path))
        try:
            raw = json.loads(config_json.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(MODEL_KEY, f"cannot read {config_json}: {e}",
                              "restore the file from the model's release", value=str(path)) from None
        _merge_job_architecture(raw, job_architecture, config_json, notices, hf_names=True,
                                fill=False)
        # transformers 5 writes Qwen3-MoE's (and Mixtral's) expert count as num_local_experts
        if "num_experts" not in raw and raw.get("num_local_experts"):
            raw["num_experts"] = raw["num_local_experts"]
        # config.json is the HF library's file: many keys (token ids, dtypes...) are none of
        # our business, so unknown keys are ignored here (never in a model yaml).
        return build_section(ModelSpec, raw, "model", ignore_unknown=True,
                             source=f"in {config_json}",
                             given={"source": str(config_json), "hf_dir": str(path),
                                    "rope_scaling": rope_scaling_of(raw)})
    raw = read_yaml_file(path, MODEL_KEY)
    if is_megatron_model_yaml(raw):
        (name, body), = raw.items()
        problems: list[ConfigError] = []
        raw = {name: underscored(body, name, problems, notices)[0]}  # '-' read as '_'
        if problems:
            raise ConfigErrors(problems, str(path))
        _merge_job_architecture(raw[name], job_architecture, path, notices,
                                hf_names=False, fill=True)
        hf, settings = translate_megatron_model(raw, str(path))
        return build_section(ModelSpec, hf, "model", source=f"in {path}",
                             allowed_extra=frozenset({"rope_scaling"}),
                             given={"source": str(path), "hf_dir": None,
                                    "job_settings": tuple(settings.items()),
                                    "rope_scaling": rope_scaling_of(hf)})
    if isinstance(raw, dict):
        _merge_job_architecture(raw, job_architecture, path, notices, hf_names=True, fill=True)
    return build_section(ModelSpec, raw, "model", allowed_extra=_HF_KEYS_NOT_NEEDED,
                         source=f"in {path}", given={"source": str(path), "hf_dir": None,
                                                     "rope_scaling": rope_scaling_of(raw)})


def rope_scaling_of(raw: Any) -> RopeScaling | None:
    """config.json's ``rope_scaling`` (or transformers 5's ``rope_parameters``) as a
    `RopeScaling`; None without scaling. Keys other than YaRN's are not needed here."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") if isinstance(
        raw, dict) else None
    if not isinstance(scaling, dict):
        return None
    kind = scaling.get("type") or scaling.get("rope_type")
    if kind in (None, "default"):
        return None
    numbers = {f.name: scaling[f.name] for f in dataclasses.fields(RopeScaling)
               if f.name != "type" and isinstance(scaling.get(f.name), (int, float))
               and not isinstance(scaling.get(f.name), bool)}
    return RopeScaling(type=str(kind), **numbers)


def _merge_job_architecture(body: dict, job: dict[str, tuple[str, Any]] | None, where: Path,
                            notices: list[str] | None, *, hf_names: bool, fill: bool) -> None:
    """The job's architecture keys against the model's file ``body`` (see read_model_spec).
    ``fill``: a key the file leaves out takes the job's value (a model yaml, which is read
    only here); config.json is read again by the run, so there it must state the value."""
    problems = []
    for name, (dotted, value) in (job or {}).items():
        key = MEGATRON_TO_HF[name] if hf_names else name
        if key in body and body[key] == value:
            line = f"{dotted}={show_value(value)}: the model's {key} (in {where.name}) is the same"
        elif key not in body and fill:
            body[key] = value
            line = (f"{dotted}={show_value(value)}: translated to the model's {key}, which "
                    f"{where.name} leaves out (MindSpeed-RL merges the job's Megatron keys over "
                    "the model yaml)")
        else:
            stated = (f"is {show_value(body[key])}" if key in body else "does not state it")
            problems.append(ConfigError(dotted, f"the model's {key} {stated} (in {where}): the "
                                        "architecture has one source here, the model's file, "
                                        "which vLLM reads too", f"remove the key, or set {key} "
                                        "in the model's file", value=value))
            continue
        if notices is not None:
            notices.append(line)
    if problems:
        raise ConfigErrors(problems, str(where))

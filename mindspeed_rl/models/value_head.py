"""Scalar-head GPT models: the PPO critic and the reward model.

A scalar-head model is the decoder of an LM (embedding, layers, final norm) whose
vocabulary projection is replaced by one linear map ``hidden -> 1``: it outputs one
value per position. In HF terms it is ``LlamaForSequenceClassification`` /
``Qwen2ForSequenceClassification`` / ``Qwen3ForSequenceClassification`` with
``num_labels=1``: the body under ``model.*`` and the head as ``score.weight``
(``[1, hidden]``, no bias). Megatron names the head ``value_head.weight``.

API (everything else in this module serves these):

- `build_value_model(arch, config, *, head_seed=0)` -> `GPTValueModel`, this rank's
  stage. ``arch`` is the LM's `ModelArchitecture` (``describe_hf_dir``), ``config``
  its `build_transformer_config`. Called as ``model(input_ids [b, s], position_ids
  [b, s], attention_mask=None)``, the LAST pipeline stage returns ``values [b, s]``
  (float32, whatever the params dtype; identical on every TP rank, also under
  sequence parallelism); the other stages return their hidden states, as any
  megatron stage does inside the pipeline schedule.
- `load_value_weights_from_hf(model, arch, reader, *, require_score_head=False)` fills the
  model from an open HF checkpoint (`load_value_weights` in checkpoint/weight_source.py
  takes an HF directory or a megatron checkpoint directory of any layout):
  with a score head (sequence-classification HF dir, converted reward model, critic
  checkpoint) everything is loaded; without one (CausalLM HF dir, LM megatron
  checkpoint) the body is loaded, ``lm_head`` / ``output_layer`` ignored, and the head
  keeps its initial value, unless ``require_score_head=True`` (a reward model), which
  raises `CheckpointError` naming the file and the fix.
- `last_token_values(values, input_ids, pad_token_id)` pools like transformers'
  sequence classifiers: the value at the last non-pad token of each row.

The head is initialised at build time from its own generator, ``normal(0,
initializer_range)`` (the HF config's ``initializer_range``, 0.02 when absent; the
init transformers gives a new ``score`` layer), seeded by ``head_seed``: the same
seed gives the same head at every TP/PP layout. It is never tied to the embedding.

Parallelism: the head weight is replicated over TP. Without sequence parallelism
every TP rank sees the whole sequence and computes the full gradient itself. With
it, the hidden states at the head are split over the sequence, so each rank's
gradient is a partial sum: the weight is tagged ``sequence_parallel=True`` and
megatron's ``finalize_model_grads`` all-reduces it over TP (the trainer must set
``config.finalize_model_grads_func``, as for any SP model). The values are then
all-gathered over the sequence; the backward of that gather keeps each rank's slice.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from mindspeed_rl.errors import CheckpointError
from mindspeed_rl.models.architecture import ModelArchitecture
from mindspeed_rl.models.weight_map import COPY, GLOBAL, Rule, WeightMap

VALUE_HEAD = "value_head.weight"     # megatron (global) name of the head
SCORE = "score.weight"               # HF name of the head in *ForSequenceClassification
_LM_HEAD_HF = r"lm_head\.weight"
_LM_HEAD_MG = "output_layer.weight"
SCORE_RULE = Rule(VALUE_HEAD, (SCORE,), COPY, tp_dim=None, scope=GLOBAL)
DEFAULT_INIT_STD = 0.02


def is_sequence_classification(hf_config) -> bool:
    """True when config.json names a ``*ForSequenceClassification`` class."""
    return any(a.endswith("ForSequenceClassification") for a in getattr(hf_config, "architectures", None) or ())


def value_weight_map(lm_map: WeightMap) -> WeightMap:
    """The LM's map with ``score.weight`` <-> ``value_head.weight`` instead of the LM head.

    ``lm_head.weight`` of a CausalLM checkpoint becomes an ignored tensor: a critic
    starting from an LM keeps the body only.
    """
    rules = [r for r in lm_map.rules if r.megatron != _LM_HEAD_MG] + [SCORE_RULE]
    ignored = lm_map.ignored_hf_patterns + ((_LM_HEAD_HF,) if _LM_HEAD_HF not in lm_map.ignored_hf_patterns else ())
    return WeightMap(rules, lm_map.geometry, num_layers=lm_map.num_layers, moe_layers=lm_map.moe_layers,
                     num_experts=lm_map.num_experts, tie_embeddings=False, ignored_hf=ignored)


def value_architecture(arch: ModelArchitecture) -> ModelArchitecture:
    """``arch`` with the scalar-head weight map and untied embeddings (idempotent)."""
    if VALUE_HEAD in arch.weight_map.megatron_names():
        return arch
    return dataclasses.replace(arch, weight_map=value_weight_map(arch.weight_map),
                               share_embeddings_and_output_weights=False)


def head_init_std(arch: ModelArchitecture) -> float:
    return float(getattr(arch.hf_config, "initializer_range", None) or DEFAULT_INIT_STD)


def initial_head_weight(hidden_size: int, std: float, seed: int) -> torch.Tensor:
    """The full ``[1, hidden]`` initial head: normal(0, std) from a generator seeded by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((1, hidden_size), generator=g, dtype=torch.float32) * std


# ---------------------------------------------------------------------------------------
# the megatron modules
# ---------------------------------------------------------------------------------------
@functools.cache
def _megatron_classes() -> dict[str, type]:
    # They subclass megatron types: defined on first use, so that importing this module
    # (e.g. for the weight map) does not import megatron-core.
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    from megatron.core.transformer.module import MegatronModule

    class ValueHead(MegatronModule):
        """``hidden [s or s/tp, b, h] -> values [b, s]`` (float32); weight replicated over TP."""

        def __init__(self, config, device: torch.device):
            super().__init__(config=config)
            self.sequence_parallel = bool(config.sequence_parallel)
            self.weight = torch.nn.Parameter(
                torch.empty((1, config.hidden_size), dtype=config.params_dtype, device=device))
            if self.sequence_parallel:
                # Each TP rank sees only its slice of the sequence: its grad is a partial
                # sum that finalize_model_grads all-reduces over TP for tagged params.
                self.weight.sequence_parallel = True

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            # fp32 head: the values feed the value loss, GAE and reward scores, and the
            # cast costs one [s, b, h] copy next to a whole decoder.
            values = torch.nn.functional.linear(hidden.float(), self.weight.float())  # [s', b, 1]
            if self.sequence_parallel:
                # Every TP rank computes the same loss from the full values, so the
                # backward keeps this rank's slice instead of summing over TP.
                values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
            return values.squeeze(-1).transpose(0, 1).contiguous()  # [b, s]

    class GPTValueModel(GPTModel):
        """megatron-core GPTModel whose last stage ends in `ValueHead` instead of the LM head."""

        def __init__(self, *args, head_seed: int, head_std: float, **kwargs):
            kwargs["share_embeddings_and_output_weights"] = False
            super().__init__(*args, **kwargs)
            if self.mtp_process or self.config.defer_embedding_wgrad_compute:
                raise ValueError("scalar-head models support neither multi-token prediction "
                                 "nor defer_embedding_wgrad_compute")
            if self.post_process:
                # GPTModel always builds the vocabulary projection on the last stage; a
                # scalar-head model has none (a transient host allocation at build time).
                device = next(self.decoder.parameters()).device
                del self.output_layer
                self.value_head = ValueHead(self.config, device)
                with torch.no_grad():
                    self.value_head.weight.copy_(initial_head_weight(self.config.hidden_size, head_std, head_seed))

        def _postprocess(self, hidden_states, labels=None, **kwargs):
            if labels is not None:
                raise ValueError("a scalar-head model computes no LM loss: call it without labels")
            if not self.post_process:
                return hidden_states
            return self.value_head(hidden_states)  # [b, s]

        def shared_embedding_or_output_weight(self):
            return self.embedding.word_embeddings.weight if self.pre_process else None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
            # LanguageModule's version ties or pads the vocabulary output layer, which this
            # model lacks; every module here (the head included) shards itself.
            return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    return {"ValueHead": ValueHead, "GPTValueModel": GPTValueModel}


def __getattr__(name: str):
    if name in ("ValueHead", "GPTValueModel"):
        return _megatron_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_value_model(arch: ModelArchitecture, config, *, head_seed: int = 0,
                      head_std: float | None = None,
                      pre_process: bool | None = None, post_process: bool | None = None):
    """This rank's stage of a scalar-head GPT (its PP stage, TP shard, EP experts).

    ``arch``: the model's `ModelArchitecture` (LM or scalar-head form); ``config``: its
    `build_transformer_config` for the current parallel state. The body is randomly
    initialised (megatron's init) until loaded; the head gets the layout-independent
    init of ``head_seed`` (see the module docstring). The last stage returns
    ``values [b, s]`` float32.
    """
    from megatron.core import parallel_state as ps

    from mindspeed_rl.models.builder import build_layer_spec

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage()
    if post_process is None:
        post_process = ps.is_pipeline_last_stage()
    return _megatron_classes()["GPTValueModel"](
        config=config,
        transformer_layer_spec=build_layer_spec(config),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rotary_base,
        head_seed=head_seed,
        head_std=head_init_std(arch) if head_std is None else head_std,
    )


# ---------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------
def no_score_head_error(where: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: {what} has no score head ({SCORE!r} / megatron {VALUE_HEAD!r}), so it cannot be "
        "used as a reward model; use a sequence-classification checkpoint with num_labels=1 "
        "(e.g. LlamaForSequenceClassification / Qwen2ForSequenceClassification, converted with "
        "tools/convert_ckpt.py --load-model-type hf --save-model-type mg), or load it with "
        "require_score_head=False to start a critic with a new head")


def _hf_files(reader) -> str:
    from mindspeed_rl.models.hf_io import INDEX_FILE

    index = reader.dir / INDEX_FILE
    if index.is_file():
        return str(index)
    files = sorted({str(reader.file_of(n)) for n in reader.names()})
    return files[0] if len(files) == 1 else f"{reader.dir}/*.safetensors"


def _check_score_shape(reader, hidden_size: int) -> None:
    shape = reader.shape(SCORE)
    if shape != (1, hidden_size):
        num_labels = getattr(reader.config, "num_labels", None)
        raise CheckpointError(
            f"{reader.file_of(SCORE)}: tensor {SCORE!r} has shape {list(shape)}; a scalar head needs "
            f"[1, {hidden_size}] (config.json num_labels={num_labels}; only num_labels=1 is supported)")


def load_value_weights_from_hf(model, arch: ModelArchitecture, reader, *, require_score_head: bool = False,
                               progress=None) -> bool:
    """``checkpoint.weight_source.load_value_weights`` for an open `HFCheckpointReader`;
    returns whether the head was loaded."""
    from mindspeed_rl.models.builder import load_hf_weights

    varch = value_architecture(arch)
    if SCORE in reader or require_score_head or is_sequence_classification(reader.config):
        check_hf_score_head(reader, model.config.hidden_size)
        load_hf_weights(model, varch, reader, progress=progress)
        return True
    load_hf_weights(model, varch, reader, progress=progress, exclude=(VALUE_HEAD,))
    return False


def check_hf_score_head(reader, hidden_size: int) -> None:
    """An HF checkpoint (an open `HFCheckpointReader`: file headers only) holds a scalar
    score head of ``[1, hidden_size]``; otherwise `CheckpointError` naming the file."""
    if SCORE not in reader:
        archs = getattr(reader.config, "architectures", None) or ["?"]
        raise no_score_head_error(_hf_files(reader), f"{reader.dir} ({archs[0]})")
    _check_score_shape(reader, hidden_size)


def last_token_values(values: torch.Tensor, input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """``values [b, s]`` -> ``[b]``: each row's value at its last non-pad token.

    The pooling of transformers' ``*ForSequenceClassification`` (rightmost token that is
    not ``pad_token_id``; position 0 for an all-pad row).
    """
    positions = torch.arange(input_ids.size(1), device=input_ids.device)
    last = (positions * (input_ids != pad_token_id)).argmax(-1)  # [b]
    return values.gather(1, last.unsqueeze(1)).squeeze(1)

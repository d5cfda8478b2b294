"""Where the actor and the reference model get their weights: one rule, stated at start-up.

The rule (docs/config.md, "Which weights a run loads"):

1. ``actor_config.load`` holds a training checkpoint this project saved (and
   ``actor_config.finetune`` is false): the run **resumes** from it (weights, optimizer,
   RNG, data position).
2. Otherwise, when ``actor_config.load`` is set, the actor starts from its weights: a
   converted release checkpoint, a checkpoint saved here, a Megatron-LM / MindSpeed-LLM
   checkpoint (``torch_dist``, or the legacy ``mp_rank_XX`` files), or an HF directory.
   The safetensors of ``megatron_training.model`` are then **not** read.
3. Otherwise the actor starts from the safetensors of the HF directory
   ``megatron_training.model``; also when ``actor_config.load`` is ``actor_config.save``
   and holds no checkpoint yet (a job script's first launch).

The reference model is ``ref_config.load`` when set; otherwise the weights the run
started from: on a fresh start the actor's starting weights, on a resume the starting
source recorded in the checkpoint (``initial_weights`` of its common state).

Classifying sources reads only file names; `load_weights` and `load_value_weights` (a
critic's or reward model's scalar-head model) need torch and megatron.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from mindspeed_rl.checkpoint.tracker import TRACKER_FILE as _TRACKER
from mindspeed_rl.checkpoint.tracker import read_tracker
from mindspeed_rl.errors import CheckpointError

_META = "mindspeed_rl_meta.json"
# What a source is, by the files found there.
HF, DIST, LEGACY = "hf", "megatron_dist", "megatron_legacy"


@dataclass(frozen=True)
class WeightSource:
    """A set of initial weights: what kind, where, and which setting chose it."""

    kind: str                  # HF, DIST or LEGACY
    path: str
    iteration: int | None      # None: a release (converted) checkpoint or an HF directory
    chosen_by: str             # e.g. "actor_config.load"

    def describe(self) -> str:
        what = {HF: "HF safetensors", DIST: "megatron-core distributed checkpoint",
                LEGACY: "Megatron-LM legacy checkpoint (mp_rank_XX files)"}[self.kind]
        at = "" if self.kind == HF else (" release" if self.iteration is None
                                         else f" iteration {self.iteration}")
        return f"{self.path} ({what}{at}; {self.chosen_by})"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WeightSource":
        return cls(**data)


def _iteration(load: Path) -> tuple[int | None, Path] | None:
    if not (load / _TRACKER).is_file():
        return None
    iteration = read_tracker(load)
    folder = load / ("release" if iteration is None else f"iter_{iteration:07d}")
    return iteration, folder


def classify(path: str | Path, chosen_by: str) -> WeightSource:
    """What kind of weights ``path`` holds; CheckpointError when it is none of them."""
    path = Path(path)
    found = _iteration(path)
    if found is not None:
        iteration, folder = found
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: missing, though {path / _TRACKER} names it")
        if (folder / ".metadata").is_file():
            return WeightSource(DIST, str(path), iteration, chosen_by)
        if any(p.name.startswith("mp_rank_") for p in folder.iterdir()):
            return WeightSource(LEGACY, str(path), iteration, chosen_by)
        raise CheckpointError(f"{folder}: neither a distributed checkpoint (.metadata) nor "
                              "mp_rank_XX folders")
    if path.is_dir() and any(path.glob("*.safetensors")):
        return WeightSource(HF, str(path), None, chosen_by)
    raise CheckpointError(f"{path}: holds no weights ({_TRACKER} or *.safetensors); set "
                          f"{chosen_by} to a checkpoint or an HF directory")


def is_training_checkpoint(load: str | Path | None) -> bool:
    """True when ``load`` holds a checkpoint saved by this project's trainer (resumable)."""
    if not load:
        return False
    load = Path(load)
    found = _iteration(load) if load.is_dir() else None
    if found is None or found[0] is None or not (load / _META).is_file():
        return False
    # A damaged or missing latest folder still resumes, from an earlier one (resume_path).
    return (found[1] / ".metadata").is_file() or any(load.glob("iter_*/.metadata"))


def actor_start(hf_dir: str | None, load: str | None, finetune: bool = False,
                save: str | None = None) -> WeightSource | None:
    """The actor's initial weights by the rule above; None when the run resumes.

    ``load`` = ``save`` with no checkpoint there yet (a job script's first launch) starts
    from ``hf_dir``, and says so."""
    if load and is_training_checkpoint(load) and not finetune:
        return None
    if (load and save and not (Path(load) / _TRACKER).exists()
            and Path(load).absolute() == Path(save).absolute()):
        if not (hf_dir and any(Path(hf_dir).glob("*.safetensors"))):
            raise CheckpointError(
                f"actor_config.load = actor_config.save = {load} holds no checkpoint yet and "
                f"megatron_training.model ({hf_dir}) has no safetensors to start from: point "
                "megatron_training.model at the HF directory of the model")
        return WeightSource(HF, str(hf_dir), None,
                            f"megatron_training.model: actor_config.load = actor_config.save "
                            f"= {load} holds no checkpoint yet, so the run starts from the "
                            "model and will resume from there")
    if load:
        return classify(load, "actor_config.load")
    if hf_dir and any(Path(hf_dir).glob("*.safetensors")):
        return WeightSource(HF, str(hf_dir), None, "megatron_training.model")
    raise CheckpointError("no initial weights: point megatron_training.model to an HF directory "
                          "with safetensors, or actor_config.load to a checkpoint (converted by "
                          "tools/convert_ckpt.py, or Megatron-LM / MindSpeed-LLM's)")


def reference_start(ref_load: str | None, actor: WeightSource | None,
                    recorded: dict | None) -> WeightSource:
    """The reference model's weights: ref_config.load, else the run's starting weights."""
    if ref_load:
        return classify(ref_load, "ref_config.load")
    if actor is not None:
        return actor
    if recorded:
        source = WeightSource.from_dict(recorded)
        if not Path(source.path).exists():
            raise CheckpointError(f"the reference model is the policy the run started from, "
                                  f"{source.path}, which no longer exists; set ref_config.load")
        return WeightSource(source.kind, source.path, source.iteration,
                            f"recorded start of the resumed run, first chosen by "
                            f"{source.chosen_by}")
    raise CheckpointError("resuming a checkpoint that does not record the weights the run "
                          "started from: set ref_config.load to them (e.g. the converted "
                          "release checkpoint)")


def load_weights(model, arch, source: WeightSource) -> None:
    """Fill this rank's shard of ``model`` from ``source`` (any saved layout)."""
    if source.kind == HF:
        from mindspeed_rl.models.builder import load_hf_weights
        from mindspeed_rl.models.hf_io import HFCheckpointReader

        load_hf_weights(model, arch, HFCheckpointReader(source.path))
    elif source.kind == DIST:
        from mindspeed_rl.checkpoint.megatron_dir import load_megatron_checkpoint

        from mindspeed_rl.models.lora import is_adapter_name

        # LoRA adapters start fresh (B = 0) on top of a base model's checkpoint.
        adapters = [k for k in model.state_dict() if is_adapter_name(k)]
        load_megatron_checkpoint(model, source.path, iteration=source.iteration,
                                 exclude=adapters)
    else:
        from mindspeed_rl.checkpoint.legacy_megatron import load_legacy_megatron_checkpoint

        load_legacy_megatron_checkpoint(model, arch, source.path, iteration=source.iteration)


def load_value_weights(model, arch, load_dir: str | os.PathLike, *,
                       require_score_head: bool = False, iteration: int | None | str = "latest") -> bool:
    """Fill this rank's stage of a `build_value_model` model; returns whether the head was loaded.

    ``load_dir`` is an HF directory (config.json + safetensors) or a megatron checkpoint
    directory (``mindspeed_rl_meta.json``; ``iteration`` picks the folder, default the
    tracker's). With a score head in the checkpoint (``score.weight`` / ``value_head.weight``)
    body and head are loaded. Without one the body is loaded (``lm_head.weight`` /
    ``output_layer.weight`` ignored) and the head keeps its seeded init; with
    ``require_score_head=True`` that case raises `CheckpointError` naming the file instead,
    as does an HF dir whose config.json names a ``*ForSequenceClassification`` class but
    that holds no ``score.weight``. A ``score.weight`` other than ``[1, hidden]``
    (``num_labels`` > 1) is refused. Call on every rank (megatron checkpoints load
    collectively).
    """
    from mindspeed_rl.checkpoint.megatron_dir import META_FILE, checkpoint_tensor_keys, load_megatron_checkpoint
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.models.value_head import VALUE_HEAD, load_value_weights_from_hf

    load_dir = Path(load_dir)
    if not (load_dir / META_FILE).is_file():
        return load_value_weights_from_hf(model, arch, HFCheckpointReader(load_dir),
                                          require_score_head=require_score_head)
    if require_score_head:
        check_score_head(load_dir, model.config.hidden_size, iteration)
    if VALUE_HEAD in checkpoint_tensor_keys(load_dir, iteration):
        load_megatron_checkpoint(model, load_dir, iteration)
        return True
    load_megatron_checkpoint(model, load_dir, iteration, exclude=(VALUE_HEAD,))
    return False


def check_score_head(load_dir: str | os.PathLike, hidden_size: int,
                     iteration: int | None | str = "latest") -> None:
    """A reward model's checkpoint (HF directory or megatron checkpoint) holds a scalar score
    head; otherwise `CheckpointError` naming the file. Reads file headers and checkpoint
    metadata only, so a launch refuses it before any model is built."""
    from mindspeed_rl.checkpoint.megatron_dir import META_FILE, checkpoint_path, checkpoint_tensor_keys
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.models.value_head import VALUE_HEAD, check_hf_score_head, no_score_head_error

    load_dir = Path(load_dir)
    if not (load_dir / META_FILE).is_file():
        check_hf_score_head(HFCheckpointReader(load_dir), hidden_size)
    elif VALUE_HEAD not in checkpoint_tensor_keys(load_dir, iteration):
        raise no_score_head_error(str(checkpoint_path(load_dir, iteration)),
                                  f"the megatron checkpoint {load_dir} (an LM: it stores no {VALUE_HEAD!r})")


def recorded_start(load: str | Path) -> dict | None:
    """The ``initial_weights`` a resumable checkpoint in ``load`` recorded (None if absent)."""
    from megatron.core import dist_checkpointing

    from mindspeed_rl.checkpoint.safe_load import restricted_unpickling

    from mindspeed_rl.checkpoint.trainer_state import resume_path

    if _iteration(Path(load)) is None:
        return None
    folder = resume_path(load)  # verified before common.pt is opened; the one resumed
    with restricted_unpickling(folder):
        common = dist_checkpointing.load_common_state_dict(str(folder)).get("common", {})
    return common.get("initial_weights")


def hf_config_dir(hf_dir: str | None, load: str | None, tokenizer: str | None) -> str:
    """An HF-style directory holding config.json (vLLM and the architecture need one):
    the model's HF directory, else actor_config.load (converted checkpoints carry one),
    else the tokenizer directory (an HF release holds config.json beside its tokenizer)."""
    for candidate in (hf_dir, load, tokenizer):
        if candidate and (Path(candidate) / "config.json").is_file():
            return str(candidate)
    raise CheckpointError("no config.json for the model's architecture: point megatron_training."
                          "model at an HF directory, or actor_config.load at a checkpoint "
                          "converted by tools/convert_ckpt.py, or megatron_training."
                          "tokenizer_name_or_path at the model's HF release directory")

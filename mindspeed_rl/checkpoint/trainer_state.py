"""Trainer checkpoints: every trainable role's model, optimizer and LR schedule (the actor's
under the keys of a plain model checkpoint, the critic's prefixed ``critic.``), RNG, the
trainer's common state (iteration, data position...) and each rank's own state.

Written into the same directory layout as converted checkpoints (``iter_0000010/``
+ ``latest_checkpointed_iteration.txt`` + the HF config/tokenizer files), so a
training checkpoint is also an initial checkpoint for another run and converts
to HF with ``tools/convert_ckpt.py``. Saving is atomic: every rank writes into
``iter_XXXXXXX.tmp.<host>.<pid>`` (a name of this job's own, locked while it is
written); the ranks agree every shard was written, hash and fsync the files
(:mod:`~mindspeed_rl.checkpoint.manifest`); rank 0 writes the manifest, renames the
folder and only then moves the tracker file, fsyncing the folder after each rename. A
failed save (a full disk, a lost rank) removes the temporary folder and raises the same
error on every rank; the previous checkpoint stays valid and ``latest`` keeps naming it.
Temporary folders left by a killed run are removed by the next save; one whose lock is
held (another job saving into the same folder) is left alone. Loading verifies the
manifest; a damaged latest checkpoint falls back to the newest one that verifies
(:func:`resume_path`).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import re
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from torch.distributed.checkpoint.api import CheckpointException

from mindspeed_rl.checkpoint.manifest import describe_files, verify_checkpoint, write_manifest
from mindspeed_rl.checkpoint.megatron_dir import (META_FILE, TRACKER_FILE, reraise_untrusted,
                                                  root_cause, check_checkpoint_fits,
                                                  iteration_dir_name, write_meta)
from mindspeed_rl.checkpoint.safe_load import restricted_unpickling
from mindspeed_rl.checkpoint.staging import fsync_dir, fsync_file
from mindspeed_rl.checkpoint.tracker import read_tracker
from mindspeed_rl.errors import CheckpointError
from mindspeed_rl.parallel.groups import context_parallel
from mindspeed_rl.fault.collective import collective_failure_kind
from mindspeed_rl.fault.phase_tracker import injection_point
from mindspeed_rl.models.lora import is_adapter_name

_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rng_sharded_object(load: bool = False):
    """This rank's RNG states as a ShardedObject indexed by (PP, TP) rank, and by CP rank
    when context parallelism is on (the CP peers of a (PP, TP) rank are not replicas: one
    key for both made the save's coordinator see duplicate shards and the ranks disagree
    on the save's collectives); DP replicas."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = None if load else {"torch": torch.get_rng_state(),
                               "tracker": get_cuda_rng_tracker().get_states()}
    shape = [ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()]
    offset = [ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()]
    cp_rank, cp = context_parallel()
    if cp > 1:
        shape.append(cp)
        offset.append(cp_rank)
    return ShardedObject("rng_state", state, tuple(shape), tuple(offset),
                         replica_id=ps.get_data_parallel_rank())


def _per_rank_object(state: object | None, load: bool = False):
    """This rank's own state (e.g. the TransferDock cells it holds), one shard per rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("per_rank_state", None if load else state, (dist.get_world_size(),),
                         (dist.get_rank(),), replica_id=0)


def _prefixed(state: dict, prefix: str) -> dict:
    """Prefix every sharded key once (objects shared between model and optimizer entries
    included), so two roles' tensors never share a checkpoint key."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    done: set[int] = set()

    def add(x):
        if isinstance(x, ShardedBase) and id(x) not in done:
            done.add(id(x))
            x.key = prefix + x.key
        return x

    dict_list_map_inplace(add, state)
    return state


def _state_dict(trainables: dict, common: dict, *, loading: bool, with_optimizer: set[str],
                with_rng: bool, per_rank: object | None = None) -> dict:
    """The actor's model and optimizer under ``model``/``optimizer`` (the keys of a plain
    model checkpoint, so conversion and other runs read it); other roles' (the critic's)
    under ``<role>/...`` with their keys prefixed ``<role>.``. ``with_optimizer``: the
    roles whose optimizer state is included."""
    state = {"common": common}
    for name, role in trainables.items():
        model_sd = role.model.sharded_state_dict()
        if getattr(role, "checkpoint_adapters_only", False):
            # actor_config.lora_ckpt_filter: the adapters only; the backbone is the base
            # model recorded in common["initial_weights"].
            model_sd = {k: v for k, v in model_sd.items() if is_adapter_name(k)}
        part = {"model": model_sd}
        if name in with_optimizer:
            part["optimizer"] = role.optimizer.sharded_state_dict(
                model_sd, is_loading=loading, metadata=_OPTIM_METADATA)
        if name == "actor":
            state.update(part)
        else:
            state[name] = _prefixed(part, f"{name}.")
    if with_rng:
        state["rng_state"] = _rng_sharded_object(load=loading)
    state["per_rank_state"] = _per_rank_object(per_rank, load=loading)
    return state


def save_trainer_checkpoint(save_dir: str | os.PathLike, iteration: int, trainables: dict, *,
                            common: dict, hf_files_from: str | os.PathLike | None,
                            architecture: str, per_rank: object = None) -> Path:
    """Collectively save the training state at ``iteration``; returns the folder.

    ``trainables``: ``{"actor": ..., "critic": ...}`` (`TrainableModel`s: model,
    optimizer, LR schedule); ``common``: state identical on every rank;
    ``per_rank``: this rank's own state (restored on the same rank).
    """
    from megatron.core import dist_checkpointing

    save_dir = Path(save_dir)
    final = save_dir / iteration_dir_name(iteration)
    tmp, lock = None, None
    if _rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        _sweep_stale_saves(save_dir)
        tmp, lock = _claim_tmp(save_dir, final)
        if hf_files_from and not (save_dir / META_FILE).exists():
            from mindspeed_rl.models.hf_io import copy_metadata_files

            copy_metadata_files(hf_files_from, save_dir)
            write_meta(save_dir, architecture)
    # An optimizer that never stepped (PPO's actor during critic_warmup) has no state to
    # save (megatron's distributed optimizer refuses); it resumes fresh, as it was.
    stepped = {name for name, t in trainables.items() if t.scheduler.num_steps > 0}
    common = dict(common, iteration=iteration, optimizers_saved=sorted(stepped),
                  schedulers={name: t.scheduler.state_dict() for name, t in trainables.items()},
                  optimizer_layout=_optimizer_layout(trainables["actor"]),
                  parallel_layout=_parallel_layout())
    from mindspeed_rl.models.lora import FC1_B_GLOBAL, FC1_B_LAYOUT_KEY, lora_settings

    lora = lora_settings(trainables["actor"].model)
    if lora is not None:   # what tools/convert_ckpt.py needs to rebuild the adapters
        common["lora"] = dict(lora, adapters_only=bool(
            getattr(trainables["actor"], "checkpoint_adapters_only", False)),
            **{FC1_B_LAYOUT_KEY: FC1_B_GLOBAL})
    error = None
    try:
        tmp = Path(_broadcast_from_rank0(str(tmp) if tmp else None))
        # A rank whose own state cannot be serialized would fail inside the collective save
        # while the others wait there: every rank first learns whether every rank's can.
        errors = [e for e in _gather(unwritable(per_rank)) if e]
        if not errors:
            try:
                dist_checkpointing.save(_state_dict(trainables, common, loading=False,
                                                    with_optimizer=stepped, with_rng=True,
                                                    per_rank=per_rank), str(tmp))
                injection_point("checkpoint_write")  # test hook (MINDSPEED_RL_FAULT_INJECT)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported everywhere
                if collective_failure_kind(exc):  # a lost rank: no agreement can happen
                    raise
                error = f"rank {_rank()}: {root_cause(exc)}"
            # Every rank learns whether every rank wrote its shards before anything is renamed.
            errors = [e for e in _gather(error) if e]
        files = describe_files(tmp) if not errors else {}
        status = None
        if _rank() == 0:
            try:
                if errors:
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    _publish(tmp, final, files, iteration)
            except OSError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                status = f"rank 0: {type(exc).__name__}: {exc}"
        status = _broadcast_from_rank0(status)
    except BaseException:
        # A lost rank (timeout) or an interrupt: leave no half-written folder behind.
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _release(lock)
    if errors or status:
        raise CheckpointError(
            f"{final}: saving iteration {iteration} failed ({(errors or [status])[0]}); the "
            f"previous checkpoint in {save_dir} is unchanged and "
            f"{TRACKER_FILE} still names it")
    return final


_TMP = re.compile(r"iter_\d{7}\.tmp(\..+)?$")


def _lock_path(tmp: Path) -> Path:
    return tmp.parent / f".{tmp.name}.lock"


def _claim_tmp(save_dir: Path, final: Path):
    """A temporary folder only this job uses, and the lock that says a job is writing it."""
    tmp = save_dir / f"{final.name}.tmp.{socket.gethostname()}.{os.getpid()}"
    lock = open(_lock_path(tmp), "w")  # noqa: SIM115 - held until the save ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # a file system without locks: the unique name still keeps saves apart
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp, lock


def _release(lock) -> None:
    if lock is not None:
        Path(lock.name).unlink(missing_ok=True)
        lock.close()


def _sweep_stale_saves(save_dir: Path) -> None:
    """Remove temporary folders of killed saves; never one another live job is writing
    (its lock is held; a lock that cannot be taken at all leaves the folder too)."""
    for stale in save_dir.iterdir():
        if not (stale.is_dir() and _TMP.match(stale.name)):
            continue
        try:
            with open(_lock_path(stale), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(stale, ignore_errors=True)
                _lock_path(stale).unlink(missing_ok=True)
        except OSError:  # held by a live save (BlockingIOError), or no locks here
            continue


def _publish(tmp: Path, final: Path, files: dict, iteration: int) -> None:
    """Rank 0: manifest, rename, tracker; each step on disk before the next depends on it."""
    save_dir = final.parent
    write_manifest(tmp, files)
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    tracker_tmp = save_dir / f"{TRACKER_FILE}.tmp.{os.getpid()}"
    tracker_tmp.write_text(f"{iteration}\n")
    fsync_file(tracker_tmp)
    os.replace(tracker_tmp, save_dir / TRACKER_FILE)
    fsync_dir(save_dir)


# The folder each resumed load directory resolved to: the run's every reader (the
# recorded start, the trainer state) gets the same one, verified once.
_resolved: dict[tuple[Path, str], Path] = {}


def resume_path(load_dir: str | os.PathLike) -> Path:
    """Collective: the checkpoint a resume loads from ``load_dir``: the one the tracker
    names, or, when that one does not verify, the newest earlier one that does (a line
    names both). CheckpointError, naming the damage, when none verifies."""
    load_dir = Path(load_dir)
    # Rank 0's listing for every rank: a node-local or lagging file system may show the
    # others another tracker, and verification is collective over the same folders.
    listing = None
    if _rank() == 0:
        try:
            listing = (read_tracker(load_dir),
                       sorted(p.name for p in load_dir.glob("iter_" + "[0-9]" * 7)))
        except CheckpointError as exc:  # every rank raises it, none waits in the broadcast
            listing = str(exc)
        except OSError as exc:
            listing = f"{load_dir}: cannot be listed on rank 0 ({exc})"
    listing = _broadcast_from_rank0(listing)
    if isinstance(listing, str):
        raise CheckpointError(listing)
    iteration, names = listing
    key = (load_dir.absolute(), iteration)  # a later save moves the tracker: resolved anew
    if key in _resolved:
        return _resolved[key]
    latest = load_dir / iteration_dir_name(iteration)
    older = [load_dir / name for name in reversed(names) if name < latest.name]
    first_error = None
    for candidate in [latest, *older]:
        try:
            verify_checkpoint(candidate)  # the same verdict on every rank
        except CheckpointError as exc:
            first_error = first_error or exc
            continue
        if candidate != latest and _rank() == 0:
            print(f"resume: the latest checkpoint {latest} is damaged ({first_error}); "
                  f"resuming from {candidate}, the newest one that verifies", flush=True)
        _resolved[key] = candidate
        return candidate
    raise CheckpointError(f"{first_error}; no earlier checkpoint in {load_dir} verifies either")


def unwritable(state: object) -> str | None:
    """Why this rank's own state (``per_rank``) cannot be serialized, or None."""
    try:
        torch.save(state, io.BytesIO())
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
        return f"rank {_rank()}: its own state cannot be serialized: {root_cause(exc)}"
    return None


def _gather(value) -> list:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _broadcast_from_rank0(value):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _optimizer_layout(actor) -> dict:
    """The settings that fix how the optimizer state is sharded in the checkpoint."""
    return {"megatron_training.use_distributed_optimizer":
            bool(actor.ddp.ddp_config.use_distributed_optimizer),
            "megatron_training.bf16": bool(actor.model.config.bf16)}


def _parallel_layout() -> dict:
    """The training layout, which fixes how the optimizer, RNG and per-rank state are cut."""
    from megatron.core import parallel_state as ps

    return {"actor_config.tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "actor_config.pipeline_model_parallel_size":
                ps.get_pipeline_model_parallel_world_size(),
            "actor_config.context_parallel_size": context_parallel()[1]}


def saved_parallel_layout(path: Path, common: dict) -> dict | None:
    """The layout a trainer checkpoint was saved at: recorded in its common state, or (older
    checkpoints) read from the shard grid of its RNG state, one shard per (PP, TP) rank."""
    if common.get("parallel_layout"):
        return common["parallel_layout"]
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    try:
        with restricted_unpickling(path):
            metadata = load_sharded_metadata(str(path))
    except Exception:  # noqa: BLE001 - unreadable metadata: the load itself names the problem
        return None
    # One ShardedObject per (PP, TP[, CP]) rank, keyed rng_state/shard_<offset>_<shape>.
    shapes = {getattr(v, "global_shape", None) for k, v in metadata.items()
              if k.split("/")[0] == "rng_state"}
    shape = shapes.pop() if len(shapes) == 1 else None
    if shape is None or len(shape) not in (2, 3):
        return None
    return {"actor_config.tensor_model_parallel_size": int(shape[1]),
            "actor_config.pipeline_model_parallel_size": int(shape[0]),
            "actor_config.context_parallel_size": int(shape[2]) if len(shape) == 3 else 1}


def _check_parallel_layout(path: Path, saved: dict | None) -> None:
    """A resume runs at the layout it was saved at: its optimizer state, RNG states and each
    rank's own state are cut by it (the weights alone load at any layout)."""
    now = _parallel_layout()
    for key, value in (saved or {}).items():
        if now.get(key, value) != value:
            raise CheckpointError(
                f"{path}: was saved with {key}={value} and this run has {key}={now[key]}; a "
                "resume needs the layout it was saved at (its optimizer, RNG and per-rank "
                f"state are cut by it): set {key}: {value}, or start a new run from its "
                "weights (actor_config.finetune: true, or tools/convert_ckpt.py)")


def _check_optimizer_layout(path: Path, saved: dict | None, actor) -> None:
    """Optimizer state has no conversion between these layouts: name the key to set back."""
    if saved is None:  # written before the layout was recorded
        return
    now = _optimizer_layout(actor)
    for key, value in saved.items():
        if now.get(key, value) != value:
            raise CheckpointError(
                f"{path}: its optimizer state was saved with {key}={str(value).lower()} and "
                f"cannot be loaded with {key}={str(now[key]).lower()} (no conversion between "
                f"the two layouts); set {key}: {str(value).lower()}, or "
                "actor_config.no_load_optim: true to keep the weights and start a fresh "
                "optimizer")


def _load_model_part(role, model_state: dict) -> None:
    """The model's saved tensors back in place: all of them, or (adapter-only checkpoints)
    every adapter, the backbone having been loaded from the recorded base model."""
    if not getattr(role, "checkpoint_adapters_only", False):
        role.model.load_state_dict(model_state, strict=True)
        return
    result = role.model.load_state_dict(model_state, strict=False)
    missing = [k for k in result.missing_keys if is_adapter_name(k)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"adapter-only checkpoint: missing adapters {missing[:3]}, "
                           f"unexpected keys {result.unexpected_keys[:3]}")


def load_trainer_checkpoint(load_dir: str | os.PathLike, trainables: dict, *,
                            load_optimizer: bool = True, load_rng: bool = True
                            ) -> tuple[dict, object | None]:
    """Collectively restore a trainer checkpoint into ``trainables`` (the roles it saved);
    returns its common state (iteration, data position...) and this rank's own state."""
    from megatron.core import dist_checkpointing

    actor = trainables["actor"]
    check_checkpoint_fits(load_dir, actor.model)
    path = resume_path(load_dir)  # verified; an earlier one if the latest is damaged
    with restricted_unpickling(path):
        common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    saved_roles = set(common.get("schedulers", {"actor": None}))
    missing = sorted(set(trainables) - saved_roles)
    if missing:
        raise CheckpointError(f"{path}: holds no state of {missing} (it saved "
                              f"{sorted(saved_roles)}); resume a run with the same roles, or "
                              "start from a converted checkpoint")
    _check_parallel_layout(path, saved_parallel_layout(path, common))
    if load_optimizer:
        _check_optimizer_layout(path, common.get("optimizer_layout"), actor)
    optimizers = set(common.get("optimizers_saved", trainables)) if load_optimizer else set()
    optimizers &= set(trainables)
    for name in optimizers:
        trainables[name].prepare_optimizer_for_load()
    from mindspeed_rl.models.lora import FC1_B_LAYOUT_KEY, rank_local_fc1_rows

    lora = common.get("lora")
    # Written before linear_fc1's B was stored in the global layout: read at the TP it was
    # saved at (checked above), each rank's rows are its own, as they were saved.
    legacy = rank_local_fc1_rows(actor.model) if lora is not None and \
        FC1_B_LAYOUT_KEY not in lora else contextlib.nullcontext()
    try:
        with torch.no_grad(), restricted_unpickling(path):
            with legacy:
                request = _state_dict(trainables, {}, loading=True, with_optimizer=optimizers,
                                      with_rng=load_rng)
            state = dist_checkpointing.load(request, str(path))
            schedulers = common.get("schedulers") or {"actor": common.get("scheduler")}
            for name, role in trainables.items():
                part = state if name == "actor" else state[name]
                _load_model_part(role, part["model"])
                if name in optimizers:
                    role.optimizer.load_state_dict(part["optimizer"])
                if load_optimizer:
                    role.scheduler.load_state_dict(schedulers[name])
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - name the folder
        if collective_failure_kind(exc):
            raise
        reraise_untrusted(exc)
        raise CheckpointError(f"{path}: cannot be loaded into this run's models and optimizers: "
                              f"{root_cause(exc)}") from exc
    if load_rng:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        rng = state["rng_state"]
        torch.set_rng_state(rng["torch"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    return common, state["per_rank_state"]

"""Reading a megatron ``torch_dist`` checkpoint's pickled parts without running code from it.

A ``torch_dist`` checkpoint has three pickled parts: ``.metadata`` (torch's
``FileSystemReader`` reads it with plain ``pickle.load``), ``common.pt`` (``torch.load``)
and the sharded objects inside the ``.distcp`` files (torch's load planner reads them with
``torch.load(weights_only=False)``). A pickle can name any importable function and call it
(``os.system``), so a checkpoint someone else wrote could run their code while it loads;
a manifest only proves the files are the ones that were hashed, not who wrote them.

Within :func:`restricted_unpickling`, therefore, every checkpoint is read with

* ``.metadata``: an unpickler that admits only the classes torch's checkpoint metadata is
  made of (:data:`METADATA_GLOBALS`, plus torch's dtypes, layouts and memory formats);
* ``common.pt`` and sharded objects: ``torch.load(weights_only=True)`` (tensors, plain
  containers and numbers, and the classes megatron-core registers with torch).

A pickle that asks for anything else is refused before it is called, with the file and
the global it asked for named. Checkpoints written by this project, Megatron-LM and
MindSpeed-LLM need nothing else; a checkpoint that does can be loaded, if its author is
trusted, with ``actor_config.trust_checkpoint: true`` (the trainer) or ``--trust-checkpoint``
(tools/convert_ckpt.py), which restores plain pickle.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from pathlib import Path
from typing import Iterator

import torch

from mindspeed_rl.errors import CheckpointError

# What torch.distributed.checkpoint's Metadata (the `.metadata` file) is built from.
METADATA_GLOBALS = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
})

_TRUST_HINT = ("load it only if you trust whoever wrote it: set actor_config.trust_checkpoint: "
               "true (training) or pass --trust-checkpoint (tools/convert_ckpt.py)")

_trusted = False


class UntrustedPickleError(CheckpointError):
    """A checkpoint's pickle asked for a global outside the allow-list; nothing of it ran."""


def trust_checkpoints(trust: bool) -> None:
    """Process-wide: load pickled checkpoint parts with plain pickle (``trust``) or not."""
    global _trusted
    _trusted = bool(trust)


def _allowed(module: str, name: str) -> bool:
    if (module, name) in METADATA_GLOBALS:
        return True
    # torch pickles a dtype (layout, memory format) as the module attribute of that name.
    return module == "torch" and isinstance(
        getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise UntrustedPickleError(
                f"{self._source}: its pickle asks for {module}.{name}, which checkpoint "
                f"metadata never needs; it was not called and the checkpoint was not loaded; "
                f"{_TRUST_HINT}")
        return super().find_class(module, name)


class _PickleForMetadata:
    """Stands in for the ``pickle`` module in torch's filesystem reader: ``load`` restricted."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def load(self, file, **_):
        return _MetadataUnpickler(file, str(getattr(file, "name", "checkpoint .metadata"))).load()


def _weights_only_load(real_load, folder: Path):
    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True  # the planner passes False for sharded objects
        try:
            return real_load(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            where = (str(f) if isinstance(f, (str, os.PathLike))
                     else f"a sharded object in {folder}'s .distcp files")
            # torch's message is a paragraph; the line naming the refused global is the news.
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            reason = next((line for line in lines if "GLOBAL" in line), lines[0])
            raise UntrustedPickleError(
                f"{where}: refused by torch.load(weights_only=True) ({reason}); nothing in it "
                f"ran and the checkpoint was not loaded; {_TRUST_HINT}") from None
    return load


@contextlib.contextmanager
def restricted_unpickling(folder: str | os.PathLike) -> Iterator[None]:
    """While megatron reads the checkpoint ``folder``, its pickles cannot call code.

    Swaps the ``pickle`` torch's filesystem reader uses and ``torch.load`` (forced to
    ``weights_only=True``) for the duration; both are restored afterwards. Loading runs
    in the calling thread, so nothing else sees the swap in practice.
    """
    if _trusted:
        yield
        return
    import torch.distributed.checkpoint.default_planner as planner
    import torch.distributed.checkpoint.filesystem as fs
    from megatron.core.dist_checkpointing.strategies import common

    # The callers' own ``torch`` too: on CPU the platform adaptor gives megatron's modules
    # a copy of the torch namespace, which a swap of ``torch.load`` alone would miss.
    owners = {id(m): m for m in (torch, getattr(common, "torch", torch),
                                 getattr(planner, "torch", torch))}.values()
    real_pickle, real_loads = fs.pickle, [(m, m.load) for m in owners]
    fs.pickle = _PickleForMetadata(real_pickle)
    for owner, real_load in real_loads:
        owner.load = _weights_only_load(real_load, Path(folder))
    try:
        yield
    finally:
        fs.pickle = real_pickle
        for owner, real_load in real_loads:
            owner.load = real_load

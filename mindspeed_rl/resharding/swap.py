"""Swap the training state between device and host, in place.

Works on storages, not tensors: megatron's DDP keeps params and grads as views
into a few contiguous buffers, and the distributed optimizer's fp32 shards are
views too. Releasing a storage (``resize_(0)``) frees the device memory while
every view object stays valid; swapping in re-grows the storage and copies the
host bytes back, so params, grads and optimizer state come back bitwise
identical and nothing that holds a reference (optimizer, DDP hooks) notices.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch

from mindspeed_rl.resharding.ledger import ByteLedger

TRAIN_PARAM, TRAIN_GRAD, TRAIN_OPTIMIZER = "train_param", "train_grad", "train_optimizer"


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),))


def training_state_tensors(model_chunks, optimizer) -> dict[str, list[torch.Tensor]]:
    """The tensors of each training role (params, grads, optimizer state) on this rank."""
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    optim = []
    if optimizer is not None:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = opt.optimizer
            for group in inner.param_groups:
                optim.extend(group["params"])  # fp32 main params (views of params when fp32)
            for state in inner.state.values():
                optim.extend(v for v in state.values() if torch.is_tensor(v) and v.numel() > 1)
    return {TRAIN_PARAM: params, TRAIN_GRAD: grads, TRAIN_OPTIMIZER: optim}


class StateSwapper:
    """Moves the storages behind groups of tensors to host and back.

    Roles are given in priority order: a storage shared by two roles (the fp32
    main params of the distributed optimizer are views of the model params)
    belongs to the first. Optimizer state created after construction (torch Adam
    creates it lazily at the first step) is picked up by :meth:`refresh`.
    """

    def __init__(self, ledger: ByteLedger, pin_memory: bool = False) -> None:
        self.ledger = ledger
        self.pin_memory = pin_memory
        self._storages: dict[str, list[torch.UntypedStorage]] = {}
        self._host: dict[int, torch.Tensor] = {}  # StorageImpl address -> host bytes while out
        self.bytes_moved = 0

    def refresh(self, tensors_by_role: dict[str, Iterable[torch.Tensor]]) -> None:
        """(Re)collect the storages per role and declare the resident bytes to the ledger."""
        if self._host:
            raise RuntimeError("refresh() while training state is swapped out")
        seen: set[int] = set()
        self._storages = {}
        for role, tensors in tensors_by_role.items():
            storages = []
            for t in tensors:
                s = t.untyped_storage()
                key = s._cdata  # the StorageImpl: the same for every view and wrapper
                if key in seen or s.nbytes() == 0:
                    continue
                seen.add(key)
                storages.append(s)
            self._storages[role] = storages
            self.ledger.set(role, sum(s.nbytes() for s in storages))

    def nbytes(self, role: str) -> int:
        return sum(s.nbytes() for s in self._storages.get(role, ()))

    @torch.no_grad()
    def offload(self, roles: Iterable[str]) -> None:
        """Copy each role's storages to host and release their device memory."""
        for role in roles:
            for s in self._storages.get(role, ()):
                if s._cdata in self._host:
                    continue
                nbytes = s.nbytes()
                host = torch.empty(nbytes, dtype=torch.uint8, device="cpu",
                                   pin_memory=self.pin_memory)
                host.copy_(_as_bytes(s))
                self._host[s._cdata] = host
                s.resize_(0)
                self.ledger.free(role, nbytes)
                self.bytes_moved += nbytes

    @torch.no_grad()
    def onload(self, roles: Iterable[str]) -> None:
        """Re-grow each role's storages on the device and copy the host bytes back."""
        for role in roles:
            for s in self._storages.get(role, ()):
                host = self._host.pop(s._cdata, None)
                if host is None:
                    continue
                s.resize_(host.numel())
                _as_bytes(s).copy_(host, non_blocking=self.pin_memory)
                self.ledger.alloc(role, host.numel())
                self.bytes_moved += host.numel()

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """While swapped out: the host copy of ``tensor`` (same dtype, shape, strides)."""
        host = self._host.get(tensor.untyped_storage()._cdata)
        if host is None:
            return tensor
        return host.view(tensor.dtype).as_strided(
            tensor.shape, tensor.stride(), tensor.storage_offset())


class RoleSwap:
    """Keeps a role's tensors on the host except inside :meth:`resident`.

    ``collect()`` returns the role's tensors by kind (e.g. params, grads, optimizer
    state); it is called again after each residency, since Adam creates its
    moments at the first step.
    """

    def __init__(self, name: str, collect: Callable[[], dict[str, list[torch.Tensor]]], ledger,
                 pin_memory: bool) -> None:
        self.name, self.collect = name, collect
        self.swapper = StateSwapper(ledger, pin_memory=pin_memory)
        self._refresh_and_offload()

    def _refresh_and_offload(self) -> None:
        tensors = {f"{self.name}_{kind}": t for kind, t in self.collect().items()}
        self.swapper.refresh(tensors)
        self.roles = list(tensors)
        self.swapper.offload(self.roles)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        self.swapper.onload(self.roles)
        try:
            yield
        finally:
            self._refresh_and_offload()

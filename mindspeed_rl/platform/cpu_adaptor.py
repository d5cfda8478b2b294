"""Scoped CPU adaptor for megatron-core (gloo, no CUDA).

megatron-core assumes CUDA in many places (``torch.cuda.current_device()``,
``device='cuda'`` factory calls, the CUDA RNG tracker, ``'torch.cuda.FloatTensor'``
type checks, streams). vLLM runs in the same process, so nothing here may change
plain torch. The adaptor therefore works at three depths, all limited to
``megatron.core.*``:

1. **Module-level rebinding.** Inside every ``megatron.core`` module the global
   name ``torch`` is rebound to :class:`_TorchProxy`: real torch, except
   ``torch.cuda`` (a CPU stand-in) and the tensor factories (``cuda``/int
   devices remapped to CPU). An import hook does the same for modules imported
   later. Plain ``import torch`` elsewhere is untouched.
2. **Caller-scoped tensor methods.** ``Tensor.type()`` and ``Tensor.cuda()`` are
   methods, so they cannot be rebound per module; their patched versions check
   the calling frame and change behaviour only for callers in ``megatron.core``.
3. **Named symbol patches** (``_MODULE_PATCHES``): each names the megatron symbol
   it serves and why. They run when that module is imported.

What each layer makes work, and why: ``docs/platform.md`` (The CPU adaptor).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import types
import warnings
from typing import Any, Callable

import torch

_MEGATRON_PREFIX = "megatron.core"
_installed = False


def _from_megatron(frame_depth: int = 2) -> bool:
    """True when the caller ``frame_depth`` frames up lives in a megatron.core module."""
    name = sys._getframe(frame_depth).f_globals.get("__name__", "")
    return name == _MEGATRON_PREFIX or name.startswith(_MEGATRON_PREFIX + ".")


# --------------------------------------------------------------------------------------
# 1. torch.cuda stand-in and the torch proxy
# --------------------------------------------------------------------------------------
def _cpu_device(device: Any) -> Any:
    """Map 'cuda', 'cuda:N', torch.device('cuda') and bare ints to CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def _remap_device(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return wrapper


_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn",
    "randint", "randperm", "empty_like", "zeros_like", "ones_like", "full_like",
    "rand_like", "randn_like", "linspace", "eye", "empty_strided",
)


class _DummyStream:
    """Streams/events: CPU work is synchronous, so every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None

    def record_event(self, *args, **kwargs):
        # The alltoall MoE dispatcher calls .synchronize() on the returned event.
        return _DummyStream()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuCuda(types.ModuleType):
    """What ``torch.cuda`` means inside megatron.core on a CPU-only build."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        cpu = torch
        # megatron.core.* (layers, param_and_grad_buffer, p2p_communication, utils,
        # rotary embeddings, moe router, distrib_optimizer, state_dict_saver): device= args.
        self.current_device = lambda: "cpu"
        self.device_count = lambda: 1
        self.set_device = lambda *a, **k: None
        # tensor_parallel.random: the "CUDA" generator is the CPU generator, and
        # manual_seed must really seed (a no-op would make every tracker state equal).
        self.get_rng_state = lambda device="cuda": cpu.get_rng_state()
        self.set_rng_state = lambda state, device="cuda": cpu.set_rng_state(state)
        self.manual_seed = cpu.manual_seed
        self.manual_seed_all = cpu.manual_seed
        self.random = types.SimpleNamespace(
            get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state,
            manual_seed=cpu.manual_seed, manual_seed_all=cpu.manual_seed,
        )
        self._no_streams()
        self._no_device_memory()
        self.is_available = lambda: False

    def _no_streams(self) -> None:
        """p2p_communication, async checkpoint writer, alltoall MoE dispatcher, timers."""
        self.synchronize = lambda *a, **k: None
        self.empty_cache = lambda: None
        self.Stream = _DummyStream
        self.Event = _DummyStream
        self.ExternalStream = _DummyStream
        self.current_stream = lambda *a, **k: _DummyStream()
        self.default_stream = lambda *a, **k: _DummyStream()
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.set_stream = lambda *a, **k: None
        self.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None,
                                          range_pop=lambda *a, **k: None,
                                          range=lambda *a, **k: contextlib.nullcontext(),
                                          mark=lambda *a, **k: None)

    def _no_device_memory(self) -> None:
        """Memory reporting (megatron's report_memory, MoE trackers): nothing on a device."""
        for counter in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                        "max_memory_reserved"):
            setattr(self, counter, lambda *a, **k: 0)
        self.memory_stats = lambda *a, **k: {}

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchProxy(types.ModuleType):
    """Real torch, except ``cuda`` and the device-taking factories."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.__dict__.update({k: v for k, v in torch.__dict__.items() if not k.startswith("__")})
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _remap_device(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:  # attributes torch adds lazily
        return getattr(torch, name)


_PROXY: _TorchProxy | None = None


def _rebind(module: types.ModuleType) -> None:
    if module.__dict__.get("torch") is torch:
        module.torch = _PROXY
    patch = _MODULE_PATCHES.get(module.__name__)
    if patch is not None and not module.__dict__.get("_mindspeed_rl_cpu_patched"):
        patch(module)
        module._mindspeed_rl_cpu_patched = True


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _rebind(module)

    def __getattr__(self, name):  # get_source, is_package, ... for tools that ask
        return getattr(self._loader, name)


class _MegatronImportHook(importlib.abc.MetaPathFinder):
    """Rebinds ``torch`` in megatron.core modules imported after install()."""

    def find_spec(self, fullname, path, target=None):
        if not (fullname == _MEGATRON_PREFIX or fullname.startswith(_MEGATRON_PREFIX + ".")):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


# --------------------------------------------------------------------------------------
# 2. caller-scoped Tensor.type / Tensor.cuda
# --------------------------------------------------------------------------------------
_orig_tensor_type = torch.Tensor.type
_orig_tensor_cuda = torch.Tensor.cuda


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    # optimizer.clip_grads (grad.type() == 'torch.cuda.FloatTensor'), distrib_optimizer and
    # Float16OptimizerWithFloat16Params (param-type checks): megatron only accepts CUDA types.
    if dtype is None and not kwargs and _from_megatron():
        return _orig_tensor_type(self).replace("torch.", "torch.cuda.", 1)
    return _orig_tensor_type(self, dtype, non_blocking, **kwargs)


def _tensor_cuda(self, *args, **kwargs):
    # distrib_optimizer (fully_reshardable save), optimizer.load_state_dict,
    # tensor_parallel.data, dist_checkpointing.exchange_utils: ".cuda()" means "to the
    # training device", which is the CPU here.
    if _from_megatron():
        return self
    return _orig_tensor_cuda(self, *args, **kwargs)


# --------------------------------------------------------------------------------------
# 3. named symbol patches, applied when the module is imported
# --------------------------------------------------------------------------------------
def _patch_random(mod: types.ModuleType) -> None:
    # _get/_set_cuda_rng_state: the originals go through torch.cuda._lazy_call, which
    # never runs its callback on a CPU build, so set_state would be silently dropped.
    mod._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mod._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )

    # CudaRNGStatesTracker.fork warns when the CPU state changes inside a fork; on CPU the
    # forked generator *is* the CPU generator, so the warning fires on every fork.
    class _DropCpuRngWarning(logging.Filter):
        def filter(self, record):
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mod.__name__).addFilter(_DropCpuRngWarning())


def _patch_torch_norm(mod: types.ModuleType) -> None:
    # WrappedTorchNorm asserts not sequence_parallel (it only knows Apex/TE norms for SP).
    # A torch norm is fine under SP if its params are tagged ``sequence_parallel`` so
    # finalize_model_grads all-reduces their grads over TP; without the tag the grads are
    # silently wrong (measured: grad norm 2.1726 vs 2.1732).
    original_new = mod.WrappedTorchNorm.__new__

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, *args, **kwargs)
        config_no_sp = copy.copy(config)
        object.__setattr__(config_no_sp, "sequence_parallel", False)
        norm = original_new(cls, config_no_sp, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    mod.WrappedTorchNorm.__new__ = staticmethod(__new__)


def _patch_moe_utils(mod: types.ModuleType) -> None:
    # moe_utils references te_general_gemm, which is only defined when Transformer Engine
    # imports (megatron bug: NameError in the router without TE).
    if not hasattr(mod, "te_general_gemm"):
        mod.te_general_gemm = None


def _patch_token_dispatcher(mod: types.ModuleType) -> None:
    # MoEAlltoAllTokenDispatcher passes split sizes through maybe_move_tensor_to_cpu(...,
    # as_numpy=True), which only converts ``.is_cuda`` tensors; on CPU they stayed tensors
    # and all_to_all_single rejected them (TypeError).
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    mod.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_distrib_optimizer(mod: types.ModuleType) -> None:
    # DistributedOptimizer.load_state_dict with the torch-Adam fallback (no Apex/TE, always
    # the case on CPU) restores Adam's per-parameter `step` wrongly, so a resumed run
    # silently uses other bias corrections than the uninterrupted one:
    # - one `step` tensor is assigned to every parameter and torch.optim.Adam increments it
    #   in place once per parameter (measured: step 16 instead of 2 after a resume);
    # - `_set_main_param_and_optimizer_states` then copies the per-parameter `step` of the
    #   loading template (not the checkpoint) into it (measured: step 1 instead of 4).
    # The checkpoint's param_groups carry the true step (megatron writes it there because
    # torch Adam keeps it per parameter): give every parameter its own copy of it.
    original = mod.DistributedOptimizer.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        groups = state_dict.get("optimizer", {}).get("param_groups", [])
        steps = {g["step"] for g in groups if "step" in g}
        if len(steps) == 1:
            step = float(steps.pop())
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(step, dtype=torch.float32)

    mod.DistributedOptimizer.load_state_dict = load_state_dict


def _patch_multi_latent_attention(mod: types.ModuleType) -> None:
    # multi_latent_attention sets HAVE_TE = True when megatron.core.extensions.transformer_engine
    # imports, which it does without Transformer Engine (it hands back stand-ins); MLASelfAttention
    # then fails on isinstance(self.linear_proj, TELinear). Without the real package, say so.
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        mod.HAVE_TE = False


_MODULE_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "megatron.core.transformer.multi_latent_attention": _patch_multi_latent_attention,
    "megatron.core.tensor_parallel.random": _patch_random,
    "megatron.core.transformer.torch_norm": _patch_torch_norm,
    "megatron.core.transformer.moe.moe_utils": _patch_moe_utils,
    "megatron.core.transformer.moe.token_dispatcher": _patch_token_dispatcher,
    "megatron.core.optimizer.distrib_optimizer": _patch_distrib_optimizer,
}


def install() -> None:
    """Install the adaptor (idempotent). Call before building megatron objects."""
    global _installed, _PROXY
    if _installed:
        return
    _PROXY = _TorchProxy()
    sys.meta_path.insert(0, _MegatronImportHook())
    # megatron.core.jit.jit_fuser is torch.compile: on CPU, inductor spends tens of seconds
    # compiling C++ per fused function (bias-GeLU/SwiGLU, L2Norm) and dynamo cannot trace
    # the torch proxy. Eager is what the CPU path needs; modules imported from now on get it.
    import megatron.core.jit as megatron_jit

    megatron_jit.disable_jit_fuser()
    for name, module in list(sys.modules.items()):
        if module is not None and (name == _MEGATRON_PREFIX or name.startswith(_MEGATRON_PREFIX + ".")):
            _rebind(module)
    # Expected on a CPU box and repeated by every rank: say it once in the docs, not per rank.
    for message in (r"(Transformer Engine and )?Apex (is|are) not installed",
                    r"When using async grad allreduce it is recommended"):
        warnings.filterwarnings("ignore", message=message)
    torch.Tensor.type = _tensor_type
    torch.Tensor.cuda = _tensor_cuda
    _installed = True

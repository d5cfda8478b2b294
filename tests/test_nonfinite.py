"""Bad numbers never reach the weights: NaN/Inf updates are skipped on every rank, NaN rewards
and NaN log-probs are errors that say where they came from."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing import run_on_ranks


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf_dir("qwen2", tmp_path_factory.mktemp("nonfinite") / "qwen2")


def _actor(hf_dir, layout_kwargs, bf16, distributed_optimizer, max_skips):
    from mindspeed_rl.models.builder import describe_hf_dir, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel import ParallelLayout
    from mindspeed_rl.parallel.groups import initialize_megatron_parallel
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.config.schema import ActorConfig
    from mindspeed_rl.engine.actor import MegatronActor, build_policy_model

    setup_platform()
    layout = ParallelLayout(world_size=torch.distributed.get_world_size(), **layout_kwargs)
    initialize_megatron_parallel(layout, seed=3)
    arch = describe_hf_dir(hf_dir)
    model = build_policy_model(arch, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                               sequence_parallel=False)
    load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
    actor = MegatronActor(model, ActorConfig(lr=1e-2, weight_decay=0.0),
                          total_steps=10, use_distributed_optimizer=distributed_optimizer,
                          bf16=bf16, max_consecutive_skipped_steps=max_skips)
    return actor, arch


def update_body(hf_dir, layout_kwargs, bf16, distributed_optimizer):
    """A good step moves the weights; NaN advantages (-> NaN loss) leave them bit for bit,
    twice in a row stops the run (max_consecutive_skipped_steps=2)."""
    from mindspeed_rl.fault.nonfinite import NonFiniteError
    from mindspeed_rl.config.schema import RLConfig
    from mindspeed_rl.engine.micro_batches import RowBatch

    actor, arch = _actor(hf_dir, layout_kwargs, bf16, distributed_optimizer, max_skips=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (5,), generator=g) for _ in range(4)]
    responses = [torch.randint(0, 300, (6,), generator=g) for _ in range(4)]

    def update(advantage):
        batch = RowBatch(prompts, responses,
                         {"advantages": [torch.tensor([advantage if i % 2 else 1.0])
                                         for i in range(4)]})
        return actor.update(batch, 2, RLConfig(clip_ratio=0.2, entropy_coeff=0.0), kl_coef=0.0,
                            vocab_size=arch.vocab_size)

    def weights():
        return [p.detach().clone() for p in actor.model.parameters()]

    start = weights()
    good = update(-1.0)
    after_good = weights()
    lr_after_good = actor.lr
    bad = update(float("nan"))
    after_bad = weights()
    stopped = None
    try:
        update(float("nan"))
    except NonFiniteError as e:
        stopped = str(e)
    return {
        "good_moved": any(not torch.equal(a, b) for a, b in zip(start, after_good)),
        "bad_unchanged": all(torch.equal(a, b) for a, b in zip(after_good, after_bad)),
        "good_ok": good["update_ok"], "bad_ok": bad["update_ok"],
        "bad_grad_norm": bad["grad_norm"], "lr_kept": actor.lr == lr_after_good,
        "skipped": actor.step_guard.pop_skipped(), "stopped": stopped,
    }


@pytest.mark.parametrize("layout, bf16, distopt", [
    ({"tensor_model_parallel_size": 2}, False, False),
    ({}, True, True),  # DP=2, bf16 params with fp32 main grads, sharded optimizer
], ids=["fp32_tp2", "bf16_dp2_distopt"])
def test_nan_loss_skips_the_step_and_stops_after_the_limit(hf_dir, layout, bf16, distopt):
    results = run_on_ranks(update_body, 2, str(hf_dir), layout, bf16, distopt, timeout=300)
    for r in results:
        assert r["good_moved"] and r["good_ok"] == 1.0
        assert r["bad_unchanged"] and r["bad_ok"] == 0.0 and math.isnan(r["bad_grad_norm"])
        assert r["lr_kept"]  # the LR schedule does not advance on a skipped step
        assert r["skipped"] == 2  # both NaN steps were skipped
        assert r["stopped"] and "2 optimizer steps in a row" in r["stopped"]
        assert "rl_config.max_consecutive_skipped_steps=2" in r["stopped"]


def gradient_body(hf_dir):
    """An Inf in one rank's gradient buffer (finite loss everywhere): both ranks skip."""
    from mindspeed_rl.fault.nonfinite import nonfinite_reason

    actor, _ = _actor(hf_dir, {}, False, True, max_skips=3)
    buffers = actor.ddp.buffers
    for b in buffers:
        b.grad_data.zero_()
    clean = nonfinite_reason([0.5], actor.ddp)
    if torch.distributed.get_rank() == 1:
        buffers[0].grad_data[3] = float("inf")
    poisoned = nonfinite_reason([0.5], actor.ddp)
    return clean, poisoned


def test_inf_gradient_on_one_rank_skips_on_every_rank(hf_dir):
    assert run_on_ranks(gradient_body, 2, str(hf_dir), timeout=300) == [(None, "gradient")] * 2


def test_nan_reward_names_the_verifier_and_the_row():
    from mindspeed_rl.rewards import NonFiniteRewardError, compute_rewards, register_verifier

    @register_verifier("test_nan_on_seven")
    def nan_on_seven(response: str, answer: str) -> float:
        return float("nan") if answer == "7" else 1.0

    with pytest.raises(NonFiniteRewardError) as e:
        compute_rewards(["a", "b", "c"], ["3", "7", "7"], ["format", "test_nan_on_seven"],
                        [0.1, 1.0], row_labels=["train.jsonl row 4 sample 0",
                                                "train.jsonl row 9 sample 0",
                                                "train.jsonl row 9 sample 1"])
    message = str(e.value)
    assert "'test_nan_on_seven'" in message and "train.jsonl row 9 sample 0" in message
    assert "2 of 3 rows" in message
    total, _ = compute_rewards(["a"], ["3"], ["test_nan_on_seven"], [1.0])
    assert total.tolist() == [1.0]


def test_nan_reward_model_score_names_the_row():
    """The reward phase checks the reward model's scores as it checks the verifiers'."""
    from mindspeed_rl.rewards import NonFiniteRewardError, check_finite_scores

    with pytest.raises(NonFiniteRewardError) as e:
        check_finite_scores(torch.tensor([0.5, float("nan"), float("-inf")]), "the reward model",
                            "check its weights (reward_config.load) and dtype", ["a", "b", "c"],
                            ["3", "7", "7"], ["train.jsonl row 4", "train.jsonl row 9",
                                              "train.jsonl row 9"])
    assert str(e.value) == (
        "the reward model returned nan for train.jsonl row 9 (answer '7', response 'b'); rewards "
        "must be finite numbers: check its weights (reward_config.load) and dtype (2 of 3 rows "
        "are affected)")
    check_finite_scores(torch.tensor([0.5, -3.0]), "the reward model", "", ["a", "b"], ["1", "2"])


def test_nonfinite_rollout_logprobs_are_caught():
    from mindspeed_rl.fault.nonfinite import NonFiniteError
    from mindspeed_rl.rollout.vllm_engine import Completion, RolloutResult, check_finite_logprobs

    ok = RolloutResult([[Completion([5, 6], [-0.1, -2.0])]])
    check_finite_logprobs(ok)
    for bad in (float("nan"), float("-inf")):
        result = RolloutResult([[Completion([5, 6], [-0.1, -2.0])],
                                [Completion([1], [-0.5]), Completion([7, 8, 9], [-1, bad, -1])]])
        with pytest.raises(NonFiniteError, match=r"token 1 \(id 8\) of sample 1 of prompt 1"):
            check_finite_logprobs(result, dp_rank=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_is_the_elementwise_test(dtype):
    """The one-pass check answers as torch.isfinite(t).all() for a NaN, either infinity, both
    infinities (their sum is NaN), anywhere in the tensor, and for finite values whose sum
    overflows (the exact fallback), in every grad dtype."""
    from mindspeed_rl.fault.nonfinite import all_finite

    big = torch.finfo(dtype).max
    cases = [torch.zeros(0, dtype=dtype), torch.randn(1000).to(dtype),
             torch.full((1000,), big, dtype=dtype), torch.tensor([big, -big, big], dtype=dtype)]
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        for where in (0, 517, 1000 - len(bad)):
            t = torch.randn(1000).to(dtype)
            t[where:where + len(bad)] = torch.tensor(bad, dtype=dtype)
            cases.append(t)
        cases.append(torch.cat([torch.full((10,), big, dtype=dtype), torch.tensor(bad, dtype=dtype)]))
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t
    assert not all_finite(cases[-1]) and all_finite(cases[2])  # both kinds are in the cases

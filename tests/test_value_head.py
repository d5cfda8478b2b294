"""Scalar-head GPT models (PPO critic, reward model) in megatron-core.

Tiny random HF models: sequence classifiers (llama tied, qwen2 with a padded vocabulary,
qwen3) and CausalLMs. Checks: reward scores equal transformers' at TP/PP in {1,2}^2; a
critic started from a CausalLM gives the same values at every layout; sequence
parallelism, DDP and the (distributed) megatron optimizer give the same grads and step
as TP=1; trainer checkpoints resume exactly and load at another layout; hf -> mg -> hf
is bitwise; a checkpoint without a score head is refused where one is required.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
WORLD = 4
TOLERANCE = 1e-4      # fp32 parity with transformers
LAYOUT_TOL = 1e-5     # the same weights at two layouts differ only by summation order
ARCHS = ("llama", "qwen2", "qwen3")
OVERRIDES = {"qwen2": {"vocab_size": 300}}   # megatron pads 300 -> 384
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]   # (TP, PP); DP fills the 4 ranks
HEAD_SEED = 7
SEQ, BATCH = 24, 3
# (name, TP, PP, sequence parallel, distributed optimizer)
TRAIN_CASES = [
    ("tp1", 1, 1, False, False),
    ("tp2", 2, 1, False, False),
    ("tp2_sp", 2, 1, True, False),
    ("tp2_sp_distopt", 2, 1, True, True),
    ("pp2_distopt", 1, 2, False, True),
    ("tp2_pp2_sp_distopt", 2, 2, True, True),
]
CHECKPOINT_CASE = "tp2_pp2_sp_distopt"


def padded_tokens(vocab_size: int, pad_token_id: int, seed: int = 0) -> torch.Tensor:
    """[BATCH, SEQ] ids, identical on every rank; rows 1 and 2 are right-padded."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ), generator=g)
    tokens[tokens == pad_token_id] = (pad_token_id + 1) % vocab_size
    tokens[1, SEQ - 8:] = pad_token_id
    tokens[2, SEQ - 3:] = pad_token_id
    return tokens


# ---- workers (module level: they run in spawned ranks) ---------------------------------------

def _convert_all(jobs):
    from mindspeed_rl.checkpoint.convert import convert

    for load_type, save_type, src, dst in jobs:
        convert(load_type, save_type, src, dst)


def _init(tp: int, pp: int, sp: bool = False) -> None:
    import torch.distributed as dist

    from mindspeed_rl.parallel.groups import initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), tp, pp, sequence_parallel=sp), seed=1234)


def _reward_worker(cases):
    """Megatron reward scores vs transformers' AutoModelForSequenceClassification."""
    from mindspeed_rl.checkpoint.weight_source import load_value_weights
    from mindspeed_rl.models.builder import build_transformer_config, describe_hf_dir
    from mindspeed_rl.models.logit_parity import (max_abs_diff_global, megatron_forward,
                                                  transformers_scores)
    from mindspeed_rl.models.value_head import build_value_model, last_token_values
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel

    results = {}
    for arch_name, hf_dir, mg_dir in cases:
        arch = describe_hf_dir(mg_dir)
        pad = arch.hf_config.pad_token_id
        tokens = padded_tokens(arch.vocab_size, pad)
        per_position_ref, pooled_ref = transformers_scores(hf_dir, tokens)
        for (tp, pp), source in [(layout, "mg") for layout in LAYOUTS] + [((2, 2), "hf")]:
            _init(tp, pp)
            try:
                model = build_value_model(arch, build_transformer_config(arch))
                loaded = load_value_weights(model, arch, mg_dir if source == "mg" else hf_dir,
                                            require_score_head=True)
                values = megatron_forward(model, tokens)  # [b, s] on the last stage, None elsewhere
                on_last = values is not None
                results[(arch_name, tp, pp, source)] = {
                    "loaded": loaded,
                    "per_position": max_abs_diff_global(values - per_position_ref if on_last else None),
                    "pooled": max_abs_diff_global(
                        last_token_values(values, tokens, pad) - pooled_ref if on_last else None),
                    "shape": tuple(values.shape) if on_last else None,
                }
            finally:
                destroy_megatron_parallel()
    return results


def _critic_worker(cases):
    """Critics from CausalLM dirs: head init and values at every layout."""
    from transformers import AutoModel

    from mindspeed_rl.checkpoint.weight_source import load_value_weights
    from mindspeed_rl.models.builder import build_transformer_config, describe_hf_dir
    from mindspeed_rl.models.logit_parity import max_abs_diff_global, megatron_forward
    from mindspeed_rl.models.value_head import build_value_model, head_init_std, initial_head_weight
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel

    results = {}
    for arch_name, causal_dir in cases:
        arch = describe_hf_dir(causal_dir)
        tokens = padded_tokens(arch.vocab_size, arch.hf_config.pad_token_id)
        head = initial_head_weight(arch.hf_config.hidden_size, head_init_std(arch), HEAD_SEED)
        with torch.no_grad():
            body = AutoModel.from_pretrained(causal_dir, dtype=torch.float32, attn_implementation="eager")
            reference = (body(input_ids=tokens).last_hidden_state @ head.t()).squeeze(-1)  # [b, s]
        whole = None
        for tp, pp in LAYOUTS:
            _init(tp, pp)
            try:
                model = build_value_model(arch, build_transformer_config(arch), head_seed=HEAD_SEED)
                loaded = load_value_weights(model, arch, causal_dir)
                head_ok = (not model.post_process) or torch.equal(model.value_head.weight.detach(), head)
                values = megatron_forward(model, tokens)
                if (tp, pp) == (1, 1):
                    whole = values
                results[(arch_name, tp, pp)] = {
                    "loaded": loaded,
                    "head_ok": all_ranks(head_ok),
                    "vs_hf_body": max_abs_diff_global(None if values is None else values - reference),
                    "vs_tp1pp1": max_abs_diff_global(None if values is None else values - whole),
                }
            finally:
                destroy_megatron_parallel()
    return results


def all_ranks(flag: bool) -> bool:
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _actor(model, distopt: bool):
    from mindspeed_rl.config.schema import CriticConfig
    from mindspeed_rl.engine.critic import MegatronCritic

    return MegatronCritic(model, CriticConfig(lr=1e-3, weight_decay=0.0, adam_beta2=0.999,
                                              clip_grad=1e6),
                          total_steps=4, use_distributed_optimizer=distopt, bf16=False)


def _micro_batches(arch, seed: int):
    """Two micro-batches of (tokens, target values, mask), identical on every rank."""
    out = []
    for i in range(2):
        g = torch.Generator().manual_seed(seed * 10 + i)
        tokens = padded_tokens(arch.vocab_size, arch.hf_config.pad_token_id, seed=seed * 10 + i)
        target = torch.randn((BATCH, SEQ), generator=g)
        mask = (tokens != arch.hf_config.pad_token_id).float()
        out.append((tokens, target, mask))
    return out


def _train_step(actor, micro) -> tuple[bool, float, torch.Tensor | None]:
    """One optimizer step of a squared-error value loss (token mean over the batch).

    Returns (step ok, grad norm, the head's finalized grad before the step or None)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = actor.model
    actor.ddp.zero_grad_buffer()
    actor.optimizer.zero_grad()
    model.train()

    def forward_step(data_iterator, chunk):
        tokens, target, mask = next(data_iterator)
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        values = chunk(tokens, positions, attention_mask=None)  # [b, s] on the last stage

        def loss_fn(values):
            loss = (0.5 * (values - target) ** 2 * mask).sum()
            return loss, mask.sum().to(torch.int), {"loss": loss.detach()}

        return values, loss_fn

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[actor.ddp],
        num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
    head_grad = model.value_head.weight.main_grad.detach().clone() if model.post_process else None
    ok, grad_norm, _ = actor.optimizer.step()
    actor.scheduler.step(increment=1)
    return bool(ok), float(grad_norm), head_grad


def _train_worker(causal_dir, ckpt_dir, cases):
    """One step per layout from the same critic; checkpoint, resume and reload."""
    import torch.distributed as dist

    from mindspeed_rl.checkpoint.trainer_state import load_trainer_checkpoint, save_trainer_checkpoint
    from mindspeed_rl.checkpoint.weight_source import load_value_weights
    from mindspeed_rl.models.builder import build_transformer_config, describe_hf_dir
    from mindspeed_rl.models.logit_parity import megatron_forward
    from mindspeed_rl.models.value_head import build_value_model
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel

    arch = describe_hf_dir(causal_dir)
    probe = padded_tokens(arch.vocab_size, arch.hf_config.pad_token_id, seed=99)

    def build(sp: bool):
        config = build_transformer_config(arch, sequence_parallel=sp, calculate_per_token_loss=True)
        model = build_value_model(arch, config, head_seed=HEAD_SEED)
        load_value_weights(model, arch, causal_dir)
        return model

    def gathered(t):
        """The last stage's tensor on every rank (None where no rank has one)."""
        items = [None] * dist.get_world_size()
        dist.all_gather_object(items, t)
        return next((x for x in items if x is not None), None)

    results = {}
    for name, tp, pp, sp, distopt in cases:
        _init(tp, pp, sp)
        try:
            actor = _actor(build(sp), distopt)
            before = gathered(megatron_forward(actor.model, probe))
            ok, grad_norm, head_grad = _train_step(actor, _micro_batches(arch, seed=1))
            head_grads = [None] * dist.get_world_size()
            dist.all_gather_object(head_grads, head_grad)
            result = {"ok": all_ranks(ok), "grad_norm": grad_norm, "values_before": before,
                      "head_grads": [g for g in head_grads if g is not None],
                      "values": gathered(megatron_forward(actor.model, probe))}
            if name == CHECKPOINT_CASE:
                save_trainer_checkpoint(ckpt_dir, 1, {"actor": actor}, common={},
                                        hf_files_from=causal_dir, architecture=arch.name)
                resumed = _actor(build(sp), distopt)
                load_trainer_checkpoint(ckpt_dir, {"actor": resumed})
                result["resumed_values"] = gathered(megatron_forward(resumed.model, probe))
                second = _micro_batches(arch, seed=2)
                _, norm_a, _ = _train_step(actor, second)
                _, norm_b, _ = _train_step(resumed, second)
                result["step2"] = (norm_a, norm_b, gathered(megatron_forward(actor.model, probe)),
                                   gathered(megatron_forward(resumed.model, probe)))
            results[name] = result
        finally:
            destroy_megatron_parallel()
    # The trainer checkpoint (saved at TP2 PP2 SP with the distributed optimizer) at TP1 PP1.
    _init(1, 1)
    try:
        model = build_value_model(arch, build_transformer_config(arch), head_seed=HEAD_SEED + 1)
        results["reloaded_head_found"] = load_value_weights(model, arch, ckpt_dir, require_score_head=True)
        results["reloaded_values"] = gathered(megatron_forward(model, probe))
    finally:
        destroy_megatron_parallel()
    results["probe"] = probe
    return results


def _errors_worker(causal_dir, lm_mg_dir, two_label_dir):
    from mindspeed_rl.checkpoint.weight_source import load_value_weights
    from mindspeed_rl.errors import CheckpointError
    from mindspeed_rl.models.builder import build_transformer_config, describe_hf_dir
    from mindspeed_rl.models.value_head import build_value_model
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel

    messages = {}
    _init(1, 1)
    try:
        arch = describe_hf_dir(causal_dir)
        model = build_value_model(arch, build_transformer_config(arch))
        for key, src in (("hf", causal_dir), ("mg", lm_mg_dir), ("two_labels", two_label_dir)):
            try:
                load_value_weights(model, arch, src, require_score_head=True)
                messages[key] = None
            except CheckpointError as exc:
                messages[key] = str(exc)
    finally:
        destroy_megatron_parallel()
    return messages


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("value_head")
    d = {"root": root}
    jobs = []
    for a in ARCHS:
        hf = make_tiny_hf_dir(a, root / "seqcls" / a, seed=1, sequence_classification=True,
                              **OVERRIDES.get(a, {}))
        d[a] = (str(hf), str(root / "mg" / a), str(root / "roundtrip" / a))
        jobs += [("hf", "mg", d[a][0], d[a][1]), ("mg", "hf", d[a][1], d[a][2])]
    # Critics start from CausalLMs: llama with tied embeddings, qwen2 with an lm_head to ignore.
    for a in ("llama", "qwen2"):
        d[f"causal_{a}"] = str(make_tiny_hf_dir(a, root / "causal" / a, seed=2, **OVERRIDES.get(a, {})))
    d["lm_mg"] = str(root / "lm_mg")
    jobs.append(("hf", "mg", d["causal_llama"], d["lm_mg"]))
    d["two_labels"] = str(make_tiny_hf_dir("llama", root / "two_labels", seed=1, sequence_classification=True,
                                           num_labels=2))
    run_on_ranks(_convert_all, 1, jobs, timeout=600)
    return d


@pytest.fixture(scope="module")
def reward(dirs):
    results = run_on_ranks(_reward_worker, WORLD, [(a, dirs[a][0], dirs[a][1]) for a in ARCHS],
                           timeout=900)[0]
    print("\nreward parity:", json.dumps({" ".join(map(str, k)): [f"{v['per_position']:.2e}", f"{v['pooled']:.2e}"]
                                          for k, v in results.items()}, indent=1))
    return results


@pytest.fixture(scope="module")
def critic(dirs):
    results = run_on_ranks(_critic_worker, WORLD, [(a, dirs[f"causal_{a}"]) for a in ("llama", "qwen2")],
                           timeout=900)[0]
    print("\ncritic:", json.dumps({" ".join(map(str, k)): {kk: (f"{vv:.2e}" if isinstance(vv, float) else vv)
                                                            for kk, vv in v.items()} for k, v in results.items()},
                                  indent=1))
    return results


@pytest.fixture(scope="module")
def training(dirs):
    ckpt = dirs["root"] / "critic_ckpt"
    results = run_on_ranks(_train_worker, WORLD, dirs["causal_qwen2"], str(ckpt), TRAIN_CASES, timeout=1200)[0]
    ref = results["tp1"]
    print("\ntraining vs tp1:", json.dumps({n: {
        "grad_norm": results[n]["grad_norm"],
        "max_abs_head_grad_diff": max([float((g - ref["head_grads"][0]).abs().max())
                                       for g in results[n]["head_grads"]] if "distopt" not in n else [float("nan")]),
        "max_abs_value_diff_after_step": float((results[n]["values"] - ref["values"]).abs().max()),
    } for n, *_ in TRAIN_CASES}, indent=1))
    return results, ckpt


# ---- reward model: parity with transformers -----------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_reward_scores_equal_transformers(reward, arch, layout):
    r = reward[(arch, *layout, "mg")]
    assert r["loaded"] is True
    assert r["shape"] is None or r["shape"] == (BATCH, SEQ)
    assert r["per_position"] <= TOLERANCE and r["pooled"] <= TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_reward_model_loads_directly_from_hf_dir(reward, arch):
    r = reward[(arch, 2, 2, "hf")]
    assert r["loaded"] is True and r["per_position"] <= TOLERANCE and r["pooled"] <= TOLERANCE


# ---- critic from a CausalLM: layout-independent head init -------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_critic_from_causal_lm_is_layout_independent(critic, arch, layout):
    r = critic[(arch, *layout)]
    assert r["loaded"] is False          # no score head in a CausalLM: the head is the seeded init
    assert r["head_ok"] is True          # = normal(0, initializer_range) of HEAD_SEED on every layout
    assert r["vs_hf_body"] <= TOLERANCE  # body = transformers' base model; lm_head ignored
    assert r["vs_tp1pp1"] <= LAYOUT_TOL


# ---- training: SP grads, DDP + optimizer, checkpoints ------------------------------------------

def test_every_layout_steps(training):
    results, _ = training
    for name, *_ in TRAIN_CASES:
        assert results[name]["ok"], name
        assert torch.isfinite(torch.tensor(results[name]["grad_norm"])), name


def test_head_grads_equal_across_tp_and_sequence_parallel(training):
    """The head's finalized grad after one backward: TP=2 with and without SP equals TP=1 on
    every rank (without the sequence_parallel tag SP grads are partial sums)."""
    results, _ = training
    reference = results["tp1"]["head_grads"][0]
    assert reference.abs().max() > 0
    for name in ("tp1", "tp2", "tp2_sp"):
        for g in results[name]["head_grads"]:
            assert torch.allclose(g, reference, rtol=1e-5, atol=1e-7), (name, (g - reference).abs().max())


def test_grad_norm_and_step_equal_across_layouts(training):
    results, _ = training
    ref = results["tp1"]
    assert (ref["values"] - ref["values_before"]).abs().max() > 1e-3  # the step changed the values
    for name, *_ in TRAIN_CASES:
        r = results[name]
        assert (r["values_before"] - ref["values_before"]).abs().max() <= LAYOUT_TOL, name
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], (name, r["grad_norm"])
        assert (r["values"] - ref["values"]).abs().max() <= 1e-4, name


def test_trainer_checkpoint_resumes_exactly(training):
    r = training[0][CHECKPOINT_CASE]
    assert torch.equal(r["resumed_values"], r["values"])
    norm_a, norm_b, values_a, values_b = r["step2"]
    assert norm_a == norm_b and torch.equal(values_a, values_b)


def test_checkpoint_saved_sharded_loads_at_tp1_pp1(training):
    results, _ = training
    assert results["reloaded_head_found"] is True
    diff = (results["reloaded_values"] - results[CHECKPOINT_CASE]["values"]).abs().max()
    assert diff <= LAYOUT_TOL


def test_critic_checkpoint_converts_to_hf_sequence_classifier(training, tmp_path):
    """mg -> hf of a critic started from a CausalLM: config rewritten, transformers scores equal."""
    from transformers import AutoModelForSequenceClassification

    results, ckpt = training
    out = tmp_path / "critic_hf"
    run_on_ranks(_convert_all, 1, [("mg", "hf", str(ckpt), str(out))], timeout=600)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    scores = []
    model.score.register_forward_hook(lambda m, a, o: scores.append(o.squeeze(-1)))
    with torch.no_grad():
        model(input_ids=results["probe"])
    assert (scores[0] - results[CHECKPOINT_CASE]["values"]).abs().max() <= TOLERANCE


# ---- conversion ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_seqcls_hf_mg_hf_round_trip_is_bitwise(dirs, arch):
    from safetensors.torch import load_file

    hf, mg, rt = dirs[arch]
    original, back = load_file(f"{hf}/model.safetensors"), load_file(f"{rt}/model.safetensors")
    assert "score.weight" in original and sorted(original) == sorted(back)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert Path(hf, f).read_text() == Path(rt, f).read_text()
    meta = json.loads(Path(mg, "mindspeed_rl_meta.json").read_text())
    assert meta["head"] == "score" and meta["num_labels"] == 1


def test_lm_conversion_meta_has_no_head(dirs):
    meta = json.loads(Path(dirs["lm_mg"], "mindspeed_rl_meta.json").read_text())
    assert "head" not in meta


def test_round_trip_dir_scores_equal_original(dirs):
    from mindspeed_rl.models.logit_parity import transformers_scores

    hf, _, rt = dirs["qwen2"]
    tokens = padded_tokens(300, 0)
    a, b = transformers_scores(hf, tokens), transformers_scores(rt, tokens)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- errors ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def error_messages(dirs):
    return run_on_ranks(_errors_worker, 1, dirs["causal_llama"], dirs["lm_mg"], dirs["two_labels"],
                        timeout=600)[0]


def test_reward_model_without_score_head_from_hf_dir(dirs, error_messages):
    msg = error_messages["hf"]
    assert msg is not None
    assert f"{dirs['causal_llama']}/model.safetensors" in msg
    assert "LlamaForCausalLM" in msg and "no score head" in msg
    assert "ForSequenceClassification" in msg and "require_score_head=False" in msg


def test_reward_model_without_score_head_from_lm_megatron_checkpoint(dirs, error_messages):
    msg = error_messages["mg"]
    assert msg is not None and f"{dirs['lm_mg']}/release" in msg and "no score head" in msg


def test_two_label_classifier_is_refused(error_messages):
    msg = error_messages["two_labels"]
    assert msg is not None and "'score.weight'" in msg and "[2, 128]" in msg and "num_labels=2" in msg


def test_convert_tool_names_file_of_classifier_without_score(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "no_score"
    shutil.copytree(dirs["llama"][0], src)
    tensors = load_file(src / "model.safetensors")
    del tensors["score.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    save = tmp_path / "out"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_ckpt.py"), "--load-model-type", "hf",
         "--save-model-type", "mg", "--load-dir", str(src), "--save-dir", str(save), "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"{src}/model.safetensors" in proc.stderr and "no score head" in proc.stderr
    assert not save.exists()


def test_tiny_sequence_classifier_body_equals_causal_lm(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    seqcls = make_tiny_hf_dir("qwen2", tmp_path / "s", seed=5, sequence_classification=True)
    causal = make_tiny_hf_dir("qwen2", tmp_path / "c", seed=5)
    config = AutoConfig.from_pretrained(seqcls)
    assert config.architectures == ["Qwen2ForSequenceClassification"]
    assert config.num_labels == 1 and config.pad_token_id is not None
    s, c = load_file(seqcls / "model.safetensors"), load_file(causal / "model.safetensors")
    assert set(s) - set(c) == {"score.weight"} and set(c) - set(s) == {"lm_head.weight"}
    assert all(torch.equal(s[k], c[k]) for k in s if k in c)

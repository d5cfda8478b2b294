"""LoRA adapters on megatron-core's parallel linears (mindspeed_rl.models.lora), 2 gloo ranks.

At every layout (DP=2 with the distributed optimizer, TP=2, TP=2 + sequence parallelism,
PP=2) the same tiny SmolLM2-like model (tied embeddings) gets adapters on all four linears:

- step 0 (B = 0): logits equal the base model's bit for bit;
- the optimizer holds the adapters only, the backbone has no grad buffer;
- after two Adam steps only adapter parameters changed, and the adapters' gradients at the
  second step (A's are 0 at the first, since B = 0) and the logits agree across layouts, so
  the A/B split, its collectives and the sequence-parallel grad reduction are exact;
- the shared-backbone reference (adapters off) is the separately loaded base model exactly,
  and the merged shards
  ``W + (alpha/r) B A`` in a plain model give the adapted logits.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
R, ALPHA = 4, 8.0
SEQ, BATCH = 16, 2
# name: (TP, PP, sequence parallel, distributed optimizer)
LAYOUTS = {"dp2": (1, 1, False, False), "dp2_distopt": (1, 1, False, True),
           "tp2": (2, 1, False, False), "tp2_sp": (2, 1, True, False), "pp2": (1, 2, False, False)}


class _Adam:   # the OptimizerKeys a TrainableModel reads
    lr, min_lr, lr_decay_style, lr_warmup_fraction = 1e-2, 0.0, "constant", 0.0
    weight_decay, clip_grad, adam_beta1, adam_beta2 = 0.0, 0.0, 0.9, 0.95


def _lm_step(trainable, model, tokens):
    """One optimizer step of next-token cross entropy; returns the adapters' final grads."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    labels = torch.roll(tokens, -1, dims=1)
    grads = {}

    def forward_step(_it, m):
        out = m(tokens, positions, attention_mask=None, labels=labels)   # [b, s] loss
        return out, lambda o: (o.sum(), torch.tensor(o.numel(), dtype=torch.int),
                               {"loss": o.sum().detach()})

    def run():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]),
                                    model=[trainable.ddp], num_microbatches=1, seq_length=s,
                                    micro_batch_size=b, forward_only=False)
        for name, p in model.named_parameters():
            if p.requires_grad:
                grads[name] = p.main_grad.detach().clone()

    out = trainable.step(run, lambda: [0.0])
    assert out["update_ok"] == 1.0
    return grads


def _full(model, arch, local_name, tensor):
    """The whole-model tensor of an adapter factor (gathered over TP like its backbone)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(model.get_parameter(local_name), "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    base = local_name.rsplit(".lora_", 1)[0] + ".weight"
    from mindspeed_rl.models.builder import global_parameter_names

    global_base = global_parameter_names(model)[base]
    if local_name.endswith("lora_B.weight"):   # rows follow the backbone's row layout
        return arch.weight_map.gather_tp(global_base, shards)
    return torch.cat(shards, dim=1)


def _layout_worker(hf_dir, tp, pp, sp, distopt):
    import torch.distributed as dist

    from mindspeed_rl.engine.actor import build_policy_model
    from mindspeed_rl.engine.optim import TrainableModel
    from mindspeed_rl.models.builder import describe_hf_dir, global_parameter_names, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.models.lora import add_lora_adapters
    from mindspeed_rl.models.logit_parity import megatron_logits, random_tokens
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), tp, pp, 1), seed=5)
    try:
        arch = describe_hf_dir(hf_dir)
        tokens = random_tokens(arch.vocab_size, BATCH, SEQ, seed=3)

        def build():
            m = build_policy_model(arch, params_dtype=torch.float32, sequence_parallel=sp)
            load_hf_weights(m, arch, HFCheckpointReader(hf_dir))
            return m

        model = build()
        base = megatron_logits(model, tokens)
        n = add_lora_adapters(model, ALL, R, ALPHA, seed=11)
        step0 = megatron_logits(model, tokens)
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        trainable = TrainableModel(model, _Adam(), total_steps=2, bf16=False,
                                   use_distributed_optimizer=distopt)
        # Elements the optimizer steps (the distributed optimizer's are shards over DP).
        in_optimizer = torch.tensor(float(sum(p.numel() for g in trainable.optimizer.param_groups
                                              for p in g["params"])))
        if distopt:
            dist.all_reduce(in_optimizer)
        adapter_numel = sum(p.numel() for k, p in model.named_parameters() if ".lora_" in k)
        no_buffer = [k for k, p in model.named_parameters()
                     if ".lora_" not in k and (p.requires_grad or hasattr(p, "main_grad"))]
        _lm_step(trainable, model, tokens)
        grads = _lm_step(trainable, model, tokens)
        names = global_parameter_names(model, adapters=True)
        full_grads = {names[k]: _full(model, arch, k, g) for k, g in grads.items()}
        changed = sorted(k for k, p in model.named_parameters() if not torch.equal(p, before[k]))
        after = megatron_logits(model, tokens)
        # rl_config.share_backbone: the reference is this model with its adapters off.
        from mindspeed_rl.trainer.roles import SharedBackbone

        with SharedBackbone(model).resident():
            disabled = megatron_logits(model, tokens)
        again = megatron_logits(model, tokens)
        # A plain model whose weights are W + (alpha / r) B A, by the formula (per shard).
        merged_model = build()
        with torch.no_grad():
            for k, p in merged_model.named_parameters():
                p.copy_(model.get_parameter(k))
                lin = k.removesuffix(".weight")
                if k.endswith(".weight") and f"{lin}.lora_A.weight" in before:
                    a = model.get_parameter(f"{lin}.lora_A.weight")
                    b = model.get_parameter(f"{lin}.lora_B.weight")
                    p.add_(ALPHA / R * b @ a)
        merged = megatron_logits(merged_model, tokens)
        last = base is not None
        return {
            "adapted": n, "optimizer_is_adapters": int(in_optimizer) == adapter_numel,
            "no_buffer": no_buffer, "changed": changed,
            "step0_equal": torch.equal(step0, base) if last else None,
            "disabled_equal": torch.equal(disabled, base) if last else None,
            "enabled_again": torch.equal(again, after) if last else None,
            "moved": (after - base).abs().max().item() if last else None,
            "after": after, "merged_diff": (merged - after).abs().max().item() if last else None,
            # (the distributed optimizer reduces each rank's shard of the grads only)
            "grads": None if distopt else full_grads,
        }
    finally:
        destroy_megatron_parallel()


def _all_layouts(hf_dir):
    return {name: _layout_worker(hf_dir, *layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf = make_tiny_hf_dir("llama", tmp_path_factory.mktemp("lora") / "llama", seed=2)
    return run_on_ranks(_all_layouts, 2, str(hf), timeout=900)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step0_is_the_base_model_and_only_adapters_train(results, layout):
    for rank, res in enumerate(results):
        r = res[layout]
        assert r["adapted"] == (4 if layout == "pp2" else 8)      # 2 layers (1 per PP stage)
        assert r["optimizer_is_adapters"] and r["no_buffer"] == []
        assert r["changed"] and all(".lora_" in k for k in r["changed"]), r["changed"]
        assert any(k.endswith("lora_A.weight") for k in r["changed"])
        if r["step0_equal"] is not None:
            assert r["step0_equal"] and r["disabled_equal"] and r["enabled_again"]
            assert r["merged_diff"] <= 1e-5
            assert r["moved"] > 1e-3


def test_layouts_agree_on_gradients_and_logits(results):
    ref = results[0]["dp2"]
    for layout in ("dp2_distopt", "tp2", "tp2_sp", "pp2"):
        holders = [res[layout] for res in results]
        after = next(r["after"] for r in holders if r["after"] is not None)
        assert (after - ref["after"]).abs().max().item() <= 1e-4, layout
        if layout == "dp2_distopt":
            continue
        grads = {k: g for r in holders for k, g in r["grads"].items()}
        assert sorted(grads) == sorted(ref["grads"]), layout
        for k, g in grads.items():
            scale = ref["grads"][k].abs().max().item()
            assert scale > 0, k
            assert (g - ref["grads"][k]).abs().max().item() <= 1e-4 * scale, (layout, k)


def _base_checkpoint_worker(hf_dir, mg_dir):
    """actor_config.load = a converted base checkpoint: the backbone loads, adapters stay fresh."""
    from mindspeed_rl.checkpoint.convert import convert, whole_model_parallel_state
    from mindspeed_rl.checkpoint.weight_source import classify, load_weights
    from mindspeed_rl.engine.actor import build_policy_model
    from mindspeed_rl.models.builder import describe_hf_dir, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.models.lora import add_lora_adapters

    convert("hf", "mg", hf_dir, mg_dir)
    with whole_model_parallel_state():
        arch = describe_hf_dir(hf_dir)
        model = build_policy_model(arch, params_dtype=torch.float32, sequence_parallel=False)
        add_lora_adapters(model, ALL, R, ALPHA, seed=11)
        adapters = {k: p.detach().clone() for k, p in model.named_parameters() if ".lora_" in k}
        load_weights(model, arch, classify(mg_dir, "actor_config.load"))
        direct = build_policy_model(arch, params_dtype=torch.float32, sequence_parallel=False)
        load_hf_weights(direct, arch, HFCheckpointReader(hf_dir))
        backbone_ok = all(torch.equal(p, model.get_parameter(k))
                          for k, p in direct.named_parameters())
        adapters_ok = all(torch.equal(p, adapters[k]) for k, p in model.named_parameters()
                          if ".lora_" in k)
        return backbone_ok, adapters_ok


def test_lora_starts_from_a_converted_base_checkpoint(tmp_path):
    hf = make_tiny_hf_dir("qwen2", tmp_path / "qwen2", seed=4)
    assert run_on_ranks(_base_checkpoint_worker, 1, str(hf), str(tmp_path / "mg"),
                        timeout=600) == [(True, True)]

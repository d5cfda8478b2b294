"""End to end on CPU: runs that start from checkpoints and data made elsewhere.

- a Megatron-LM legacy checkpoint (saved at TP=2) and a MindSpeed-RL packed indexed
  dataset (megatron-core's builder): the run trains from both, at PP=2;
- a run started from a converted release checkpoint with a model yaml (the cluster
  configs' setup) and a KL reference model resumes from its save folder and matches the
  uninterrupted run, which is also the legacy run's reference (the same weights from HF).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing import run_on_ranks
from test_grpo_e2e import ROOT, launch, training_rows
from torchrun_jobs import stopped_at

pytestmark = pytest.mark.slow

COMPARED = ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
            "actor/entropy", "actor/grad_norm")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("starts")
    train, _ = make_arithmetic_problems(32, 0, seed=0, max_operand=20, ops="+")
    write_jsonl(train, root / "train.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "qwen2"),
            "data": root / "train.jsonl"}


def _metrics_of_iteration(rows, it):
    return {k: training_rows(rows)[it][k] for k in COMPARED}


# Both tests run at PP=2 (the legacy checkpoint was saved at TP=2) from the weights of
# OTHER, a model other than megatron_training.model's safetensors.
LAYOUT = ("actor_config.tensor_model_parallel_size=1",
          "actor_config.pipeline_model_parallel_size=2",
          "generate_config.infer_tensor_parallel_size=1")


@pytest.fixture(scope="module")
def other(assets):
    return make_tiny_hf_dir("qwen2", assets["root"] / "qwen2_other", seed=1)


@pytest.fixture(scope="module")
def converted_run(assets, other):
    """OTHER converted to a megatron release checkpoint (tools/convert_ckpt.py), started with
    a model yaml (the cluster configs' setup) and actor_config.load = the converted folder,
    KL reference on, 3 iterations saving every one: the uninterrupted run of the resume test
    and the HF-weights reference of the legacy test (the same weights, JSONL data, same
    layout)."""
    root = assets["root"]
    converted = root / "converted"
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt.py"), "--load-model-type",
                    "hf", "--save-model-type", "mg", "--load-dir", str(other),
                    "--save-dir", str(converted), "--no-progress"], check=True,
                   capture_output=True, timeout=300)
    hf = json.loads((other / "config.json").read_text())
    fields = ("model_type", "architectures", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
              "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
    model_yaml = root / "tiny_qwen2.yaml"
    model_yaml.write_text(yaml.safe_dump({k: hf[k] for k in fields}
                                         | {"tokenizer_name_or_path": str(assets["model"])}))
    full_save = root / "save_full"
    proc, full = launch(assets, "conv_full", f"megatron_training.model={model_yaml}",
                        f"actor_config.load={converted}", *LAYOUT,
                        "megatron_training.train_iters=3", "megatron_training.save_interval=1",
                        f"actor_config.save={full_save}")
    return {"converted": converted, "model_yaml": model_yaml, "save": full_save,
            "out": proc.stdout + proc.stderr, "rows": full}


def test_trains_from_a_legacy_checkpoint_and_an_indexed_dataset(assets, other, converted_run):
    from legacy_megatron_ckpt import save_legacy_checkpoint
    from transformers import AutoTokenizer

    from mindspeed_rl.data import load_prompt_dataset
    from mindspeed_rl.data.indexed import write_indexed_prompts

    root = assets["root"]
    # The checkpoint holds other weights than megatron_training.model's safetensors.
    legacy = root / "megatron_lm_tp2"
    run_on_ranks(save_legacy_checkpoint, 2, str(other), str(legacy), 2, 1, 3)
    tok = AutoTokenizer.from_pretrained(str(assets["model"]))
    items = load_prompt_dataset(str(assets["data"]), tok, 48, shuffle=False)
    prefix = root / "indexed" / "train"
    write_indexed_prompts(str(prefix), [(it.prompt_ids, tok(it.answer, add_special_tokens=False)
                                         ["input_ids"]) for it in items])

    proc, rows = launch(assets, "from_legacy", f"actor_config.load={legacy}",
                        f"megatron_training.data_path={prefix}", *LAYOUT,
                        "megatron_training.train_iters=2")
    out = proc.stdout + proc.stderr
    assert f"actor weights: {legacy} (Megatron-LM legacy checkpoint (mp_rank_XX files) " \
           "iteration 3; actor_config.load)" in out
    assert sorted(training_rows(rows)) == [1, 2]
    # The run from the other model's weights (converted from its HF folder) and the JSONL
    # data: identical metrics, so the weights came from the checkpoint (resharded TP=2 ->
    # PP=2) and the prompts and answers from the indexed dataset.
    reference = converted_run["rows"]
    for it in (1, 2):
        got, want = _metrics_of_iteration(rows, it), _metrics_of_iteration(reference, it)
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (it, key)


def test_resume_from_a_converted_start_with_a_reference_model(assets, converted_run):
    """Model yaml + actor_config.load = converted release checkpoint, KL reference on:
    resuming from the save folder restores the reference from the recorded start."""
    root = assets["root"]
    converted, model_yaml = converted_run["converted"], converted_run["model_yaml"]
    full = converted_run["rows"]
    assert f"actor weights: {converted} (megatron-core distributed checkpoint release" in \
        converted_run["out"]
    part_save = root / "save_part"
    stopped_at(converted_run["save"], 2, part_save)
    proc, resumed = launch(assets, "conv_part", f"megatron_training.model={model_yaml}",
                           f"actor_config.load={part_save}", f"actor_config.save={part_save}",
                           *LAYOUT, "megatron_training.train_iters=3")
    out = proc.stdout + proc.stderr
    assert f"actor weights: resumed from {part_save}" in out
    assert f"reference weights: {converted} (megatron-core distributed checkpoint release; " \
           "recorded start of the resumed run, first chosen by actor_config.load)" in out
    got, want = _metrics_of_iteration(resumed, 3), _metrics_of_iteration(full, 3)
    for key in COMPARED:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    assert want["actor/kl_loss"] > 0

"""docs/architecture.md's worked examples, run from the page: a new model family (Mistral)
and where a config key goes (``rl_config.async_engine``). The rollout-mode example runs on
the real engine in ``tests/test_rollout_parts.py``; the phase and estimator examples have
their own tests (``test_add_a_phase.py``, ``test_add_an_estimator.py``)."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
from test_config import job  # noqa: F401 (the fixture; tests/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def doc_code(heading: str) -> str:
    """The first python block under ``heading`` in docs/architecture.md."""
    text = DOC.read_text()
    return re.findall(r"```python\n(.*?)```", text[text.index(heading):], re.S)[0]


def mistral_module() -> types.ModuleType:
    """The page's model module, run as ``mindspeed_rl.models.mistral`` would be imported."""
    module = types.ModuleType("mindspeed_rl.models.mistral")
    exec(doc_code("### A model family: Mistral"), module.__dict__)  # noqa: S102 - the doc's example
    return module


def _mistral_dir(path: Path, **overrides) -> Path:
    from mindspeed_rl.models.tiny import make_tiny_hf_dir

    # Llama's tiny sizes with Mistral's model type (head_dim 32, the window unset)
    return make_tiny_hf_dir("llama", path, **{"model_type": "mistral", "head_dim": 32,
                                              "tie_word_embeddings": False,
                                              "sliding_window": None, **overrides})


def _mistral_parity(hf_dir: str) -> float:
    from mindspeed_rl.models import registry
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir, load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.models.logit_parity import (max_abs_diff_global, megatron_logits,
                                                  random_tokens, transformers_logits)
    from mindspeed_rl.parallel.groups import (destroy_megatron_parallel,
                                              initialize_megatron_parallel)
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    module = mistral_module()
    registry.ARCHITECTURES[module.NAME] = module  # the page's registry line
    setup_platform()
    initialize_megatron_parallel(ParallelLayout(2, 2, 1), seed=1)
    try:
        arch = describe_hf_dir(hf_dir)
        assert arch.name == "mistral"
        model = build_gpt_model(arch, build_transformer_config(arch))
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
        tokens = random_tokens(arch.vocab_size, 2, 24, seed=0)
        logits = megatron_logits(model, tokens)
        diff = None if logits is None else \
            logits[..., :arch.vocab_size] - transformers_logits(hf_dir, tokens)
        return max_abs_diff_global(diff)
    finally:
        destroy_megatron_parallel()


@pytest.mark.slow
def test_the_model_family_example_matches_transformers_at_tp2(tmp_path):
    from mindspeed_rl.testing import run_on_ranks

    hf_dir = _mistral_dir(tmp_path / "mistral")
    diffs = run_on_ranks(_mistral_parity, 2, str(hf_dir), timeout=300)
    assert diffs[0] == diffs[1] and diffs[0] < 1e-5, diffs


def test_the_model_family_example_refuses_a_short_window(tmp_path):
    from transformers import AutoConfig

    from mindspeed_rl.models.architecture import UnsupportedConfigError

    module = mistral_module()
    config = AutoConfig.from_pretrained(_mistral_dir(tmp_path / "m", sliding_window=64))
    with pytest.raises(UnsupportedConfigError, match="sliding_window=64"):
        module.describe(config)
    unknown = AutoConfig.from_pretrained(_mistral_dir(tmp_path / "u"))
    from mindspeed_rl.models.registry import UnsupportedArchitectureError, describe_model

    with pytest.raises(UnsupportedArchitectureError, match="model_type='mistral'"):
        describe_model(unknown)  # not shipped: the page adds it


def test_the_config_key_example_is_where_the_page_says(job, capsys):
    """rl_config.async_engine: the schema's doc is its generated docs/config.md row,
    MindSpeed-RL's table lists it, config/features.py alone reads it, and the dry run's
    rollout line follows it."""
    import dataclasses

    from mindspeed_rl.config import load_config, main
    from mindspeed_rl.config.mindspeed_keys import ROWS
    from mindspeed_rl.config.reference import key_reference
    from mindspeed_rl.config.schema import RLConfig

    doc = next(f for f in dataclasses.fields(RLConfig) if f.name == "async_engine")
    assert doc.metadata["doc"].startswith("step-wise generation")
    row = next(line for line in key_reference().splitlines() if "| `async_engine` |" in line)
    assert row in (ROOT / "docs" / "config.md").read_text()
    assert any(r.name == "async_engine" for r in ROWS)
    from test_structure import PACKAGE, switch_reads

    readers = [p for p in PACKAGE.rglob("*.py")
               if [r for r in switch_reads(p.read_text(), p.name) if r.endswith(".async_engine")]]
    assert [p.relative_to(PACKAGE).as_posix() for p in readers] == ["config/features.py"]
    path = job()
    for value, scheduler in (("false", "a per-pass budget"), ("true", "step-wise")):
        overrides = ["rl_config.partial_rollout_max_split=2", f"rl_config.async_engine={value}"]
        assert scheduler in load_config(path, overrides, check_data=False).features.rollout \
            .describe()
        assert main(["--config", str(path), "--dry-run", "--world-size", "4", *overrides]) == 0
        assert f"x {scheduler}" in capsys.readouterr().out

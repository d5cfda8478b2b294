"""Tiny random HF model directories (config, tokenizer, safetensors) for tests, benchmarks and smoke runs.

No downloads: the tokenizer is a byte-level BPE trained here on a few sentences, so it
encodes any text; a ChatML chat template is stored in tokenizer_config.json. Sizes keep
head_dim = 32 (vLLM's minimum) and hidden 128, so later rollout tests can reuse them.
Weights are random and deliberately not at their init values (norm scales around 1,
non-zero biases) so a swapped or missing tensor shows up in logit parity.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The answer is 42. What is 6 times 7? Let me think step by step.",
    "Question: what is 12 + 30? Answer: 42",
    "user assistant system <think> </think> \\boxed{42}",
    "the quick brown fox jumps over the lazy dog 0123456789",
] * 8

_COMMON = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, vocab_size=384,
)
CONFIGS = {
    # SmolLM2-like: tied embeddings.
    "llama": dict(model_type="llama", rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # DeepSeek-V3 (not in ARCHS: its own tests): MLA with YaRN, first layer dense, 8 routed
    # experts in 2 groups (top-2 from 1 group), 1 shared expert. vLLM's CPU MLA kernel needs the
    # latent size 576 (kv_lora_rank 512 + qk_rope_head_dim 64); vLLM creates the router's
    # e_score_correction_bias only for topk_method noaux_tc.
    "deepseek_v3": dict(
        model_type="deepseek_v3", num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=False,
        q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=64, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        topk_method="noaux_tc", scoring_func="sigmoid",
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=0.8)),
}


def build_tokenizer(vocab_size: int = 300):
    """A byte-level BPE (``vocab_size`` tokens incl. specials) wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=_COMMON["max_position_embeddings"],
    )


def tiny_config(arch: str, **overrides):
    """The transformers config of a tiny ``arch`` model."""
    from transformers import AutoConfig

    kwargs = {**_COMMON, **CONFIGS[arch], **overrides}
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


@torch.no_grad()
def make_tiny_hf_dir(arch: str, path, *, seed: int = 0, sequence_classification: bool = False,
                     **overrides) -> Path:
    """Write a tiny random ``arch`` model with a tokenizer to ``path``; return the path.

    ``sequence_classification=True`` writes ``*ForSequenceClassification`` with
    ``num_labels=1`` (a reward model: body under ``model.*``, head ``score.weight``)
    instead of ``*ForCausalLM``; with the same seed its body equals the CausalLM's.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path = Path(path)
    if sequence_classification:
        overrides = {"num_labels": 1, **overrides}
    config = tiny_config(arch, **overrides)
    tokenizer = build_tokenizer()
    assert len(tokenizer) <= config.vocab_size
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config.bos_token_id = None
    torch.manual_seed(seed)
    auto_class = AutoModelForSequenceClassification if sequence_classification else AutoModelForCausalLM
    model = auto_class.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(0.08 * noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: moves routes
            b.copy_(0.2 * torch.randn(b.shape, generator=g))
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


if __name__ == "__main__":
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny_models")  # python -m mindspeed_rl.models.tiny DIR
    for a in ARCHS:
        print(make_tiny_hf_dir(a, out / a))

"""The model-FLOPs model of useful work (as in MFU), shared by the trainer's ``perf/*``
metrics and ``benchmarks/bench_grpo.py``.

Notation: L layers, h hidden size, V vocabulary (unpadded), A = num_heads x head_dim
(the attention width; multi-latent attention: num_heads x the mean of the query/key and
value head sizes), N = non-embedding matmul parameters *active per token*
(attention q/k/v/o incl. biases and qk-norm, gated MLP 3*h*I; for MoE the router,
top-k routed experts and a shared expert). Padding, recomputation, masked-out
attention halves, optimizer, sampling and softmax are not counted.

* body forward of one token: 2 N;
* causal attention of one query that sees c keys (itself included): 4 L A c, so a
  row of S tokens costs 4 L A S(S+1)/2;
* LM head: 2 h V per projected position; training and log-prob forwards project
  only the R response positions of a row;
* one training / log-prob forward of a row of P + R = S tokens:
  2 N S + 4 L A S(S+1)/2 + 2 h V R; a training step costs 3 x that (backward = 2 x
  forward).
"""

from __future__ import annotations


def active_body_parameters(spec) -> int:
    """Non-embedding matmul parameters one token passes through (MoE: top-k experts; the
    spec's ``active_body_parameters``, which knows dense first layers and shared experts)."""
    return spec.active_body_parameters()


def forward_flops(spec, *, tokens: float, causal_pairs: float, projected: float) -> float:
    """Model FLOPs of forwards over rows with these sums: ``tokens`` = sum of S_i,
    ``causal_pairs`` = sum of S_i (S_i + 1) / 2, ``projected`` = positions put through
    the output layer (the response tokens)."""
    width = spec.attention_width
    return (2 * active_body_parameters(spec) * tokens
            + 4 * spec.num_hidden_layers * width * causal_pairs
            + 2 * spec.hidden_size * spec.vocab_size * projected)


def row_forward_flops(spec, prompt_len: float, response_len: float) -> float:
    """One forward of one row of ``prompt_len`` + ``response_len`` tokens."""
    s = prompt_len + response_len
    return forward_flops(spec, tokens=s, causal_pairs=s * (s + 1) / 2, projected=response_len)


def matmul_gflops(size: int = 1024, seconds: float = 2.0, dtype=None, device=None) -> float:
    """Measured GFLOPS of this process on a square matmul (the peak that MFU divides by)."""
    import time

    import torch

    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
        if count % 8 == 0:
            sync()
    sync()
    return 2 * size ** 3 * count / (time.perf_counter() - start) / 1e9

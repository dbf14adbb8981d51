"""Prints one SHA-256 per op over fixed inputs; run in subprocesses by test_determinism.py.

Usage: python ops_fingerprint.py BACKEND
"""

import hashlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bik


def digest(t):
    return hashlib.sha256(t.detach().cpu().float().numpy().tobytes()).hexdigest()[:16]


def main(backend):
    bik.set_backend(backend)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    # Each call is big enough for the cpu backend to start its OpenMP team (csrc/cpu/common.h).
    x, w, rows = randn(70, 200), randn(130, 200), randn(400, 200)
    logits, tokens = randn(30, 3000), torch.arange(30, device=device) * 100
    q, k, v = randn(2, 4, 50, 32), randn(2, 2, 50, 32), randn(2, 2, 50, 32)
    # Weights packed once (bik.pack_weights): a decode-shaped call whose weight is large
    # enough to start the team (max(M, 8) x N x K fmas), in fp32 and in the bf16 pair order.
    decode_x, layer = randn(3, 512), torch.nn.Linear(512, 1024, bias=False, device=device)
    layer.requires_grad_(False).weight.copy_(randn(1024, 512))
    bik.pack_weights(layer)
    results = {
        "linear": bik.linear(x, w),
        "linear_bf16": bik.linear(x.bfloat16(), w.bfloat16()),  # the cpu backend's pair order
        "rms_norm": bik.rms_norm(rows, w[0]),
        "log_softmax": bik.log_softmax(logits),
        "token_logprobs": bik.token_logprobs(logits, tokens, 0.9),
        "attention": bik.attention(q, k, v, split_size=32),
        "linear_packed": bik.linear(decode_x, layer.weight),
    }
    layer.to(torch.bfloat16)
    results["linear_packed_bf16"] = bik.linear(decode_x.bfloat16(), layer.weight)
    for name, out in results.items():
        print(name, digest(out))


if __name__ == "__main__":
    main(sys.argv[1])

#!/usr/bin/env python3
"""Lesson 10 reference values: PyTorch's scaled_dot_product_attention, causal, and its gradients.

The inputs come from an explicit formula (no shared file, no random-number generator), which
tests/lesson10/attention_test.cpp evaluates the same way:

    q[b, h, t, d] = sin(0.37 (1 + 131 b + 17 h + 3 t + d))
    k[b, h, t, d] = cos(0.29 (1 + 131 b + 17 h + 3 t + d))
    v[b, h, t, d] = sin(0.11 (1 + 131 b + 17 h + 3 t + d) + 0.5)
    w[b, h, t, d] = cos(0.23 (1 + 131 b + 17 h + 3 t + d))       (loss = sum(out * w))

in float64 (the reference is exact to fp32's rounding of the C++ side). Writes, next to this
script, the output and the gradients of q, k and v, flattened in (B, H, T, D) order:

    ~/.cache/dtc-course/venv/bin/python tests/reference/lesson10_sdpa.py

writes tests/reference/lesson10_sdpa.json. Commit both.
"""
import json
import pathlib

import torch
import torch.nn.functional as F

OUT = pathlib.Path(__file__).with_suffix(".json")
B, H, T, D = 1, 2, 24, 4  # 24 tokens: cp 2, 3, 4, and zig-zag 2 cp chunks for each


def field(fn, scale, shift=0.0):
    b = torch.arange(B, dtype=torch.float64).view(B, 1, 1, 1)
    h = torch.arange(H, dtype=torch.float64).view(1, H, 1, 1)
    t = torch.arange(T, dtype=torch.float64).view(1, 1, T, 1)
    d = torch.arange(D, dtype=torch.float64).view(1, 1, 1, D)
    return fn(scale * (1 + 131 * b + 17 * h + 3 * t + d) + shift)


def main():
    q = field(torch.sin, 0.37).requires_grad_()
    k = field(torch.cos, 0.29).requires_grad_()
    v = field(torch.sin, 0.11, 0.5).requires_grad_()
    w = field(torch.cos, 0.23)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (out * w).sum().backward()
    flat = lambda x: [float(e) for e in x.detach().reshape(-1)]
    doc = {"generated_by": "tests/reference/lesson10_sdpa.py", "torch_version": torch.__version__,
           "shape": [B, H, T, D], "out": flat(out), "dq": flat(q.grad), "dk": flat(k.grad),
           "dv": flat(v.grad)}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

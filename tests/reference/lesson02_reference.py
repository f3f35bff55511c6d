#!/usr/bin/env python3
"""Lesson 02 reference values, computed by PyTorch itself.

Builds the course's GPT (common/include/dtc/model.h) in PyTorch, initialises it with the same
explicit formula (no shared file, no shared random-number generator: splitmix64 of seed, name
and element index), samples the same batches from data/coriolanus.txt (splitmix64 of seed, step
and row), trains it with torch.optim.AdamW, and writes the loss trajectory next to this script:

    ~/.cache/dtc-course/venv/bin/python tests/reference/lesson02_reference.py

writes tests/reference/lesson02_reference.json, which tests/lesson02/*.cpp read. Commit both.
"""
import json
import math
import pathlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = pathlib.Path(__file__).with_suffix(".json")
MASK = (1 << 64) - 1

# ------------------------------------------------------------------------------------------
# The hashes (dtc/model.h: splitmix64, fnv1a64)
# ------------------------------------------------------------------------------------------


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def splitmix64_np(x: np.ndarray) -> np.ndarray:
    """splitmix64 over a uint64 array (numpy's uint64 arithmetic wraps modulo 2^64)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def fnv1a64(text: str) -> int:
    h = 0xCBF29CE484222325
    for c in text.encode():
        h = ((h ^ c) * 0x100000001B3) & MASK
    return h


# ------------------------------------------------------------------------------------------
# The model (dtc/model.h), parameter for parameter and op for op
# ------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.c_attn = nn.Linear(h, 3 * h)
        self.c_proj = nn.Linear(h, h)
        self.heads = heads

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.c_attn(x)
        C = qkv.shape[-1] // 3  # h, or h / tp on a tensor-parallel rank (prepare_tp_heads)
        D = C // self.heads
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, self.heads, D).transpose(1, 2)
        k = k.view(B, T, self.heads, D).transpose(1, 2)
        v = v.view(B, T, self.heads, D).transpose(1, 2)
        att = q.matmul(k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = att.masked_fill(future, float("-inf")).softmax(-1)
        y = att.matmul(v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.c_fc = nn.Linear(h, 4 * h)
        self.c_proj = nn.Linear(4 * h, h)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(h, eps=1e-5)
        self.attn = Attention(h, heads)
        self.ln_2 = nn.LayerNorm(h, eps=1e-5)
        self.mlp = Mlp(h)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def prepare_tp_heads(blocks, hidden: int, heads: int, tp: int) -> None:
    """Megatron's head split, for PyTorch's ColwiseParallel: reorders each block's c_attn rows
    so that contiguous slice r of tp is [q_r; k_r; v_r] (ColwiseParallel's Shard(0) then gives
    rank r its own heads), and sets the block's attention to heads / tp local heads."""
    per = hidden // tp
    order = torch.cat([torch.arange(p * hidden + r * per, p * hidden + (r + 1) * per)
                       for r in range(tp) for p in range(3)])
    with torch.no_grad():
        for block in blocks:
            block.attn.c_attn.weight.copy_(block.attn.c_attn.weight[order])
            block.attn.c_attn.bias.copy_(block.attn.c_attn.bias[order])
            block.attn.heads = heads // tp


class Gpt(nn.Module):
    def __init__(self, vocab, ctx, hidden, layers, heads, tied):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(ctx, hidden)
        self.h = nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden, eps=1e-5)
        self.tied = tied
        if not tied:
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(T))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return torch.matmul(x, self.wte.weight.t()) if self.tied else self.lm_head(x)


class GptStage(nn.Module):
    """One pipeline stage of an untied Gpt: blocks [first, last), with the embeddings (embed) and
    the head (head), the same modules as the model's (the pipeline benchmarks)."""

    def __init__(self, model: Gpt, first: int, last: int, embed: bool, head: bool):
        super().__init__()
        self.embed, self.head = embed, head
        if embed:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.h[i] for i in range(first, last))
        if head:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        if self.embed:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for b in self.blocks:
            x = b(x)
        if self.head:
            x = self.lm_head(self.ln_f(x))
        return x


def init_std(name: str, layers: int) -> float:
    if name.endswith(".bias"):
        return 0.0
    if "ln_" in name:
        return -1.0  # LayerNorm weight: ones
    if name.endswith("c_proj.weight"):
        return 0.02 / math.sqrt(2.0 * layers)
    return 0.02


def init_weights(model: Gpt, seed: int, layers: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = init_std(name, layers)
            if std == 0.0:
                p.zero_()
                continue
            if std < 0.0:
                p.fill_(1.0)
                continue
            key = splitmix64(seed ^ fnv1a64(name))
            idx = np.arange(p.numel(), dtype=np.uint64)
            with np.errstate(over="ignore"):
                bits = splitmix64_np(np.uint64(key) + idx) >> np.uint64(40)
            u = bits.astype(np.float64) * (1.0 / 16777216.0)
            w = ((2.0 * u - 1.0) * std * math.sqrt(3.0)).astype(np.float32)
            p.copy_(torch.from_numpy(w).view(p.shape))


# ------------------------------------------------------------------------------------------
# The data (dtc/data.h)
# ------------------------------------------------------------------------------------------


def offset(seed: int, step: int, row: int, seq: int, size: int) -> int:
    h = splitmix64(seed)
    h = splitmix64(h ^ step)
    h = splitmix64(h ^ row)
    return h % (size - seq)


def batch(corpus: bytes, seed: int, step: int, rows: int, seq: int):
    offs = [offset(seed, step, r, seq, len(corpus)) for r in range(rows)]
    x = torch.tensor([list(corpus[o:o + seq]) for o in offs], dtype=torch.long)
    y = torch.tensor([list(corpus[o + 1:o + seq + 1]) for o in offs], dtype=torch.long)
    return offs, x, y


# ------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------

CASES = [
    # The tests' tiny model: 2 layers, width 64, sequences of 32, 4 sequences per step.
    dict(name="tiny_tied", vocab=256, ctx=32, hidden=64, layers=2, heads=4, tied=True, seed=1,
         batch=4, steps=8, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    dict(name="tiny_untied", vocab=256, ctx=32, hidden=64, layers=2, heads=4, tied=False, seed=7,
         batch=4, steps=4, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
]


def run_case(case: dict, corpus: bytes) -> dict:
    model = Gpt(case["vocab"], case["ctx"], case["hidden"], case["layers"], case["heads"],
                case["tied"])
    init_weights(model, case["seed"], case["layers"])
    init = {name: {"sum": float(p.detach().double().sum()),
                   "first": [float(v) for v in p.detach().flatten()[:4]]}
            for name, p in model.named_parameters()}
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=case["lr"], betas=case["betas"],
                            eps=case["eps"], weight_decay=case["weight_decay"], foreach=False)
    seq, rows = case["ctx"], case["batch"]
    losses, first = [], None
    for step in range(case["steps"]):
        offs, x, y = batch(corpus, case["seed"], step, rows, seq)
        if first is None:
            first = {"offsets": offs, "inputs_row0": x[0].tolist(), "targets_row0": y[0].tolist()}
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}
    return {"config": {k: v for k, v in case.items() if k != "name"}, "params": params,
            "init": init, "first_batch": first, "losses": losses, "final_sums": final}


def main() -> None:
    torch.use_deterministic_algorithms(True)
    corpus = (ROOT / "data" / "coriolanus.txt").read_bytes()
    out = {
        "generated_by": "tests/reference/lesson02_reference.py",
        "torch_version": torch.__version__,
        "corpus": {"path": "data/coriolanus.txt", "bytes": len(corpus)},
        "cases": {case["name"]: run_case(case, corpus) for case in CASES},
    }
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    for name, case in out["cases"].items():
        print(name, case["params"], "params; losses", [round(v, 5) for v in case["losses"]])


if __name__ == "__main__":
    main()

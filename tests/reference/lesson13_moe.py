#!/usr/bin/env python3
"""Lesson 13 reference values: the single-device mixture-of-experts GPT, computed by PyTorch.

The course's GPT (lesson02_reference.py: same explicit initialisation, same batches) with every
block's `mlp` replaced by an MoE layer (lessons/13_moe/moe.h), registered under the same name,
so that its parameters are, in this order,

    h.{i}.mlp.router.weight               (E, h)       nn.Linear(h, E, bias=False)
    h.{i}.mlp.experts.c_fc.weight         (E, 4h, h)   the E routed experts, stacked
    h.{i}.mlp.experts.c_fc.bias           (E, 4h)
    h.{i}.mlp.experts.c_proj.weight       (E, h, 4h)
    h.{i}.mlp.experts.c_proj.bias         (E, h)
    h.{i}.mlp.shared.c_fc.{weight,bias}   (S 4h, h), (S 4h)     only with S > 0 shared experts
    h.{i}.mlp.shared.c_proj.{weight,bias} (h, S 4h), (h)

and a buffer h.{i}.mlp.expert_bias (E,), zeros at the start. lesson02_reference.init_weights
initialises them by name, unchanged (the router at std 0.02, the stacked c_proj weights at
0.02 / sqrt(2 L), the element index the flat index into the stacked tensor).

The layer, on x (B, T, h) flattened to (N, h):

    logits = x W_r^T (fp32)                     s = softmax(logits) or sigmoid(logits)
    chosen = topk(s + expert_bias, k).indices   w = s.gather(chosen) (/ its sum, route_norm)
    capacity c > 0: cap = ceil(c N k / E); copy (t, j), taken row-major, is kept when fewer than
                    cap earlier copies chose the same expert; c = 0: every copy is kept
    y[t]   = sum over kept j of w[t, j] expert_{chosen[t, j]}(x[t])  (+ shared(x[t]), S > 0)
    expert_e(x) = c_proj_e(gelu(c_fc_e(x))), exact (erf) GELU

A step's loss is ce + sum over layers of (aux + z): aux = aux_coef E sum_i f_i P_i (balance
"aux" only) with f_i = counts_i / (N k), a constant, and P_i the mean over tokens of expert i's
share (softmax: s; sigmoid: s / s.sum(-1)); z = z_coef mean(logsumexp(logits)^2) (z_coef > 0).
Then backward, AdamW (lesson 02's settings) and, for balance "bias" only, each layer's
expert_bias += bias_rate sign(mean(counts) - counts), with this step's forward's counts.

Writes, next to this script, per case the losses, cross-entropies, per-layer expert counts
(before any drop) and kept copies, the first step's gradients (sum, sum of squares, absolute
maximum; the first 8 elements of the router's and the experts'), the final param_digest fields
(numel, sum, sum of squares) and the final expert biases; and under "layer" one MoE layer alone
on an explicit input (x = sin(0.37 (1 + 3 t + d)), loss = sum(out * cos(0.23 (1 + 3 t + d)))):
its output, chosen experts and gradients, all flattened row-major:

    ~/.cache/dtc-course/venv/bin/python tests/reference/lesson13_moe.py

writes tests/reference/lesson13_moe.json, which tests/lesson13/ reads. Commit both.

Choices where the brief left room (the C++ side must match them):

- Settings a case does not use are recorded in its config all the same: aux_coef and bias_rate
  at moe_given.h's defaults (1e-2, 1e-3) where the balance ignores them, so that a C++ test
  building its MoeConfig from "config" also checks that the balance mode switches them off;
  z_coef, capacity_factor and shared are 0 where a case does not name them.
- cap = ceil(capacity_factor * N * k / E) evaluated in double, left to right; N = B T of the
  global batch (the single device holds it all).
- The experts run only on their kept copies (an expert with none is skipped); a dropped copy
  contributes nothing and gets no gradient. Each token's k weighted outputs are summed in choice
  order j = 0, 1, ...; the shared experts' output is added after them.
- "losses" and "ce" are the float32 values PyTorch computed (loss.item()). counts and kept are
  integers. f_i is the float32 counts_i / (N k).
- The bias step is done in float32 on the buffer: counts as float32, their mean, torch.sign,
  times bias_rate (rounded to float32), added in place; after AdamW.
- grads0 is read after the first step's backward, before AdamW; a parameter with no gradient
  would be recorded as zeros (none occurs in these cases).
- The "layer" check's "chosen" is flattened row-major (token t, then choice j), like "out"; x and
  wgt are the float64 formulas cast to float32; its loss is computed in float32.
"""
import json
import math
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lesson02_reference as ref  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = pathlib.Path(__file__).with_suffix(".json")
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.999), 1e-8, 0.01  # lesson02_reference's

# ------------------------------------------------------------------------------------------
# The MoE layer (lessons/13_moe/moe.h)
# ------------------------------------------------------------------------------------------


class StackedLinear(nn.Module):
    """n linear maps of one shape stacked: weight (n, out, in), bias (n, out)."""

    def __init__(self, n, inp, out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out, inp))
        self.bias = nn.Parameter(torch.empty(n, out))


class Experts(nn.Module):
    def __init__(self, n, h):
        super().__init__()
        self.c_fc = StackedLinear(n, h, 4 * h)
        self.c_proj = StackedLinear(n, 4 * h, h)

    def expert(self, e, x):
        hid = F.gelu(F.linear(x, self.c_fc.weight[e], self.c_fc.bias[e]))
        return F.linear(hid, self.c_proj.weight[e], self.c_proj.bias[e])


class Ffn(nn.Module):
    """A dense FFN h -> width -> h with exact GELU: the shared experts."""

    def __init__(self, h, width):
        super().__init__()
        self.c_fc = nn.Linear(h, width)
        self.c_proj = nn.Linear(width, h)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class MoeLayer(nn.Module):
    def __init__(self, h, moe):
        super().__init__()
        E = moe["experts"]
        self.moe = moe
        self.router = nn.Linear(h, E, bias=False)
        self.experts = Experts(E, h)
        if moe["shared"] > 0:
            self.shared = Ffn(h, moe["shared"] * 4 * h)  # S experts side by side: one FFN
        self.register_buffer("expert_bias", torch.zeros(E))
        self.stats = None
        self.last_chosen = None

    def forward(self, x_in):
        m = self.moe
        E, k = m["experts"], m["top_k"]
        B, T, h = x_in.shape
        x = x_in.reshape(B * T, h)
        N = x.shape[0]
        logits = x.float() @ self.router.weight.float().t()
        s = logits.softmax(-1) if m["score"] == "softmax" else logits.sigmoid()
        chosen = torch.topk(s + self.expert_bias, k, dim=-1).indices  # (N, k), sorted
        w = s.gather(-1, chosen)
        if m["route_norm"]:
            w = w / w.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)  # the N k copies, row-major: token t, then its j-th choice
        if m["capacity_factor"] > 0:
            cap = math.ceil(m["capacity_factor"] * N * k / E)
            before = F.one_hot(flat, E).cumsum(0).gather(1, flat.view(-1, 1)).view(-1) - 1
            keep = before < cap
        else:
            keep = torch.ones_like(flat, dtype=torch.bool)
        counts = torch.bincount(flat, minlength=E)
        kept = torch.bincount(flat[keep], minlength=E)
        # The experts on their kept copies, grouped by expert, put back in copy order.
        order, pieces = [], []
        for e in range(E):
            idx = torch.nonzero(keep & (flat == e)).view(-1)
            if idx.numel() == 0:
                continue
            order.append(idx)
            pieces.append(self.experts.expert(e, x[idx // k]))
        outs = torch.zeros(N * k, h, dtype=x.dtype)
        if order:
            outs = outs.index_copy(0, torch.cat(order), torch.cat(pieces))
        y = (outs.view(N, k, h) * w.unsqueeze(-1).to(x.dtype)).sum(1)
        if m["shared"] > 0:
            y = y + self.shared(x)
        shares = s if m["score"] == "softmax" else s / s.sum(-1, keepdim=True)
        self.stats = {"logits": logits, "shares": shares, "counts": counts, "kept": kept}
        self.last_chosen = chosen
        return y.view(B, T, h)


def layer_losses(stats, moe, N):
    """aux + z of one layer's stats (the ce is added by the caller)."""
    E, k = moe["experts"], moe["top_k"]
    loss = torch.zeros((), dtype=torch.float32)
    if moe["balance"] == "aux":
        f = stats["counts"].float() / float(N * k)  # no gradient
        P = stats["shares"].mean(0)
        loss = loss + moe["aux_coef"] * E * (f * P).sum()
    if moe["z_coef"] > 0:
        loss = loss + moe["z_coef"] * (torch.logsumexp(stats["logits"], -1) ** 2).mean()
    return loss


def make_model(case):
    model = ref.Gpt(case["vocab"], case["ctx"], case["hidden"], case["layers"], case["heads"],
                    case["tied"])
    for block in model.h:
        block.mlp = MoeLayer(case["hidden"], case)  # same name, same place in the order
    ref.init_weights(model, case["seed"], case["layers"])
    return model


# ------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------

BASE = dict(vocab=256, ctx=16, hidden=32, layers=2, heads=2, tied=True, seed=1, batch=8, steps=5)
DEFAULTS = dict(route_norm=False, capacity_factor=0.0, aux_coef=1e-2, z_coef=0.0, bias_rate=1e-3,
                shared=0)
CASES = [
    dict(name="softmax_aux", experts=4, top_k=2, score="softmax", route_norm=False,
         capacity_factor=0.0, balance="aux", aux_coef=1e-2, z_coef=0.0, shared=0),
    dict(name="sigmoid_bias", experts=4, top_k=2, score="sigmoid", route_norm=True,
         capacity_factor=0.0, balance="bias", bias_rate=1e-2, z_coef=1e-3, shared=1),
    dict(name="capacity", experts=4, top_k=1, score="softmax", route_norm=False,
         capacity_factor=1.0, balance="aux", aux_coef=1e-2, shared=0),
    dict(name="no_balance_e8", experts=8, top_k=2, score="softmax", route_norm=True,
         capacity_factor=0.0, balance="none", shared=0),
]
CONFIG_KEYS = ["vocab", "ctx", "hidden", "layers", "heads", "tied", "seed", "batch", "steps",
               "experts", "top_k", "score", "route_norm", "capacity_factor", "balance",
               "aux_coef", "z_coef", "bias_rate", "shared"]


def grad_stats(model, first_of):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        d = g.detach().double()
        entry = {"sum": float(d.sum()), "sumsq": float(d.square().sum()),
                 "absmax": float(d.abs().max())}
        if first_of(name):
            entry["first"] = [float(v) for v in g.detach().reshape(-1)[:8]]
        out[name] = entry
    return out


def run_case(case, corpus):
    model = make_model(case)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, foreach=False)
    layers = [block.mlp for block in model.h]
    seq, rows = case["ctx"], case["batch"]
    N = rows * seq
    losses, ces, counts, kept, grads0 = [], [], [], [], None
    for step in range(case["steps"]):
        _, x, y = ref.batch(corpus, case["seed"], step, rows, seq)
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss = ce
        for layer in layers:
            loss = loss + layer_losses(layer.stats, case, N)
        loss.backward()
        if grads0 is None:
            grads0 = grad_stats(model, lambda n: ".experts." in n or n.endswith("router.weight"))
        opt.step()
        step_counts = [layer.stats["counts"].clone() for layer in layers]
        if case["balance"] == "bias":
            with torch.no_grad():
                for layer, c in zip(layers, step_counts):
                    c = c.float()
                    layer.expert_bias += case["bias_rate"] * torch.sign(c.mean() - c)
        losses.append(loss.item())
        ces.append(ce.item())
        counts.append([c.tolist() for c in step_counts])
        kept.append([layer.stats["kept"].tolist() for layer in layers])
    final = {}
    for name, p in model.named_parameters():
        d = p.detach().double()
        final[name] = {"numel": p.numel(), "sum": float(d.sum()), "sumsq": float(d.square().sum())}
    return {"config": {key: case[key] for key in CONFIG_KEYS}, "params": params,
            "losses": losses, "ce": ces, "counts": counts, "kept": kept, "grads0": grads0,
            "final": final, "expert_bias": [layer.expert_bias.tolist() for layer in layers]}


# ------------------------------------------------------------------------------------------
# One layer alone, on an explicit input
# ------------------------------------------------------------------------------------------

LAYER = dict(hidden=8, experts=4, top_k=2, score="softmax", route_norm=False,
             capacity_factor=0.0, balance="none", aux_coef=0.0, z_coef=0.0, bias_rate=0.0,
             shared=0, seed=3, tokens=12)


def field(fn, scale, T, D):
    t = torch.arange(T, dtype=torch.float64).view(1, T, 1)
    d = torch.arange(D, dtype=torch.float64).view(1, 1, D)
    return fn(scale * (1 + 3 * t + d)).float()


def run_layer():
    c = LAYER
    layer = MoeLayer(c["hidden"], c)
    holder = nn.Module()  # names h.0.mlp.*, as in a 1-layer GPT
    holder.h = nn.ModuleList([nn.Module()])
    holder.h[0].mlp = layer
    ref.init_weights(holder, c["seed"], 1)
    x = field(torch.sin, 0.37, c["tokens"], c["hidden"]).requires_grad_()
    wgt = field(torch.cos, 0.23, c["tokens"], c["hidden"])
    out = layer(x)
    (out * wgt).sum().backward()
    flat = lambda t: [float(v) for v in t.detach().reshape(-1)]
    return {"config": {k: v for k, v in c.items() if k not in ("balance", "aux_coef", "z_coef",
                                                                "bias_rate")},
            "shape": [1, c["tokens"], c["hidden"]],
            "names": [n for n, _ in holder.named_parameters()],
            "out": flat(out), "chosen": layer.last_chosen.reshape(-1).tolist(),
            "grad_x": flat(x.grad),
            "grads": {n: flat(p.grad) for n, p in holder.named_parameters()}}


# ------------------------------------------------------------------------------------------


def sanity(cases):
    # Switch's loss at perfect balance: f_i = P_i = 1 / E gives aux_coef.
    for E, k in ((4, 2), (8, 2), (4, 1)):
        N = 4 * E
        stats = {"counts": torch.full((E,), N * k // E), "shares": torch.full((N, E), 1.0 / E),
                 "logits": torch.zeros(N, E)}
        moe = dict(experts=E, top_k=k, balance="aux", aux_coef=1e-2, z_coef=0.0)
        aux = layer_losses(stats, moe, N).item()
        assert abs(aux - 1e-2) < 1e-8, (E, k, aux)
    for name, case in cases.items():
        cfg = case["config"]
        Nk = cfg["batch"] * cfg["ctx"] * cfg["top_k"]
        for step_counts, step_kept in zip(case["counts"], case["kept"]):
            for c, kp in zip(step_counts, step_kept):
                assert sum(c) == Nk, (name, c)
                assert all(0 <= a <= b for a, b in zip(kp, c)), (name, c, kp)
                if cfg["capacity_factor"] == 0:
                    assert kp == c, (name, c, kp)
        if cfg["balance"] != "bias":
            assert all(v == 0 for b in case["expert_bias"] for v in b), name


def main():
    torch.use_deterministic_algorithms(True)
    corpus = (ROOT / "data" / "coriolanus.txt").read_bytes()
    cases = {}
    for case in CASES:
        full = {**BASE, **DEFAULTS, **case}
        cases[case["name"]] = run_case(full, corpus)
    sanity(cases)
    out = {"generated_by": "tests/reference/lesson13_moe.py", "torch_version": torch.__version__,
           "cases": cases, "layer": run_layer()}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    for name, case in cases.items():
        dropped = sum(c - kp for sc, sk in zip(case["counts"], case["kept"])
                      for cl, kl in zip(sc, sk) for c, kp in zip(cl, kl))
        print(name, case["params"], "params; losses", [round(v, 5) for v in case["losses"]],
              "; copies dropped", dropped)
    print("layer: chosen", out["layer"]["chosen"])


if __name__ == "__main__":
    main()

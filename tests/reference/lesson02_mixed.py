#!/usr/bin/env python3
"""Lesson 02, parts 4 and 5 reference values: mixed precision and loss scaling, computed by PyTorch.

Three things, each by PyTorch's own code:

1. torch.amp.GradScaler on a fixed sequence of gradients, some with an inf or a NaN: whether each
   step was skipped, the unscaled gradients, the scale and the growth tracker after each update.
2. The course's GPT (lesson02_reference.py: same weights, same batches) trained in bf16 and fp16
   with fp32 master weights, the scheme lesson 02 teaches: the model cast to 16 bits, AdamW over
   fp32 copies, the loss scaled by GradScaler (fp16; GradScaler unscales the fp32 master
   gradients), each parameter the rounded master weight after the step.
3. The same model trained the way PyTorch's own recipe does it, torch.autocast on fp32 weights
   (+ GradScaler for fp16), and in plain fp32: the yardsticks of the tolerance policy.

For every run: the losses, the scales, which steps were taken, and the fp32 weights AdamW stepped
(per tensor sum and sum of squares, and a sample: every SAMPLE-th element of all parameters laid
end to end in named_parameters() order).

    ~/.cache/dtc-course/venv/bin/python tests/reference/lesson02_mixed.py [--out FILE]

writes tests/reference/lesson02_mixed.json (or FILE), which tests/lesson02/mixed_test.cpp reads.
The 16-bit runs' weights depend on the CPU's kernels (PyTorch's bf16 and fp16 matmuls differ
with and without AVX-512, for one), so the primary build computes this file again on the machine
that runs the tests (lessons/02_baseline/lesson.cmake: BUILD/reference/lesson02_mixed.json), with
the PyTorch whose LibTorch the lesson links (the light path: Debian's python3-torch, the same
build as its libtorch-dev). PyTorch 1.13 has no CPU GradScaler and no CPU fp16 LayerNorm; there
`--base FILE` (the committed file) gives the parts it cannot compute, the scaler sequences and the
fp16 runs, and "computed_here" lists the runs this PyTorch made. The committed file itself serves
where there is no PyTorch of the linked LibTorch's version (a bundle build on a GPU node, say).
"""
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lesson02_reference as ref  # noqa: E402

OUT = pathlib.Path(__file__).with_suffix(".json")
SAMPLE = 97

CASE = dict(vocab=256, ctx=32, hidden=64, layers=2, heads=4, tied=True, seed=1, batch=4, steps=6,
            lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

# GradScaler's sequence: gradient values (exact in fp32), with an inf or NaN where marked.
SCALER = dict(init_scale=3.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
# "huge": a finite scaled value (3e38) that unscaling by a scale below 1 takes past fp32's
# range: GradScaler checks the values as they come in, before it multiplies, and steps.
SCALER_STEPS = ["ok", "ok", "ok", "ok", "inf", "ok", "nan", "inf", "ok", "ok", "ok", "ok", "ok",
                "ok", "ok", "neginf", "ok", "inf", "inf", "inf", "huge", "ok"]
SCALER_GRAD = [0.1, -3.3, 0.7, 7.25, -0.0625, 1e-3]
# Other factors, and growth that would overflow fp32's range (2^127 * 4): the scale stays.
SCALER_FACTORS = dict(init_scale=2.0**125, growth_factor=4.0, backoff_factor=0.25,
                      growth_interval=1)
SCALER_FACTORS_STEPS = ["ok", "ok", "inf", "ok", "ok", "nan", "ok"]
SCALER_FACTORS_GRAD = [1e-30, -2.5e-31, 3e-32]


def scaler_sequence(options: dict, kinds: list, grad: list) -> dict:
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", **options)
    scaler.scale(torch.ones(()))  # GradScaler makes its scale tensor on the first scale()
    steps = []
    for kind in kinds:
        scale = scaler.get_scale()
        g = torch.tensor(grad, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)
        if kind != "ok":
            g[1] = {"inf": float("inf"), "nan": float("nan"), "neginf": float("-inf"),
                    "huge": 3e38}[kind]
        p.grad = g.clone()
        before = p.detach().clone()
        scaler.unscale_(opt)
        # JSON has no inf: a non-finite unscaled value is written as null
        unscaled = [float(v) if torch.isfinite(v) else None for v in p.grad]
        scaler.step(opt)
        stepped = not torch.equal(before, p.detach())
        scaler.update()
        steps.append({"kind": kind, "scale_before": scale, "stepped": stepped,
                      "unscaled": unscaled if kind in ("ok", "huge") else None,
                      "scale_after": scaler.get_scale(),
                      "growth_tracker_after": int(scaler._growth_tracker.item())})
        opt.zero_grad(set_to_none=True)
    return {"options": options, "grad": grad, "steps": steps}


def summary(weights, names) -> dict:
    flat = torch.cat([w.detach().flatten().double() for w in weights])
    return {"sums": {n: float(w.detach().double().sum()) for n, w in zip(names, weights)},
            "sumsq": {n: float(w.detach().double().square().sum()) for n, w in zip(names, weights)},
            "sample": [float(v) for v in flat[::SAMPLE]]}


def build():
    c = CASE
    model = ref.Gpt(c["vocab"], c["ctx"], c["hidden"], c["layers"], c["heads"], c["tied"])
    ref.init_weights(model, c["seed"], c["layers"])
    return model


def adamw(params):
    c = CASE
    return torch.optim.AdamW(params, lr=c["lr"], betas=c["betas"], eps=c["eps"],
                             weight_decay=c["weight_decay"], foreach=False)


def run(mode: str, corpus: bytes, init_scale: float = 65536.0) -> dict:
    """mode: fp32 | bf16 | fp16 (master weights) | autocast-bf16 | autocast-fp16."""
    c = CASE
    model = build()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    scaler = None
    if mode in ("bf16", "fp16"):
        master = [p.detach().clone().requires_grad_(True) for p in params]
        model.to(torch.bfloat16 if mode == "bf16" else torch.float16)
        opt = adamw(master)
        weights = master
    else:
        opt = adamw(params)
        weights = params
    if mode in ("fp16", "autocast-fp16"):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    losses, scales, stepped = [], [], []
    for step in range(c["steps"]):
        _, x, y = ref.batch(corpus, c["seed"], step, c["batch"], c["ctx"])
        model.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale() if scaler else 1.0)
        if mode.startswith("autocast"):
            dtype = torch.bfloat16 if mode == "autocast-bf16" else torch.float16
            with torch.autocast("cpu", dtype=dtype):
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        else:
            logits = model(x).float()
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        (scaler.scale(loss) if scaler else loss).backward()
        if mode in ("bf16", "fp16"):
            for p, m in zip(params, master):
                m.grad = p.grad.float()
        before = [w.detach().clone() for w in weights]
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        stepped.append(any(not torch.equal(b, w.detach()) for b, w in zip(before, weights)))
        if mode in ("bf16", "fp16"):
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
        losses.append(loss.item())
    out = {"losses": losses, "scales": scales, "stepped": stepped, "weights": summary(weights, names)}
    if mode in ("bf16", "fp16"):
        out["model"] = summary(params, names)
    return out


def option(name: str):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def main() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # as the tests run (tests/support/test_main.cpp): the same kernels
    corpus = (ref.ROOT / "data" / "coriolanus.txt").read_bytes()
    init = build()
    # PyTorch 1.13 (Debian's): no torch.amp.GradScaler, no fp16 LayerNorm on the CPU
    fp16 = hasattr(torch.amp, "GradScaler")
    base = json.loads(pathlib.Path(option("--base")).read_text()) if option("--base") else None
    if not fp16 and base is None:
        sys.exit(f"lesson02_mixed.py: PyTorch {torch.__version__} cannot run the fp16 cases on "
                 "the CPU; pass --base tests/reference/lesson02_mixed.json for those parts")
    modes = ["fp32", "bf16", "autocast-bf16"] + (["fp16", "autocast-fp16"] if fp16 else [])
    runs = {m: run(m, corpus) for m in modes}
    if fp16:
        # A scale too large for fp16 (2^21): the first steps overflow, are skipped, and halve it.
        runs["fp16-scale-2^21"] = run("fp16", corpus, init_scale=2.0**21)
    computed = list(runs)
    out = {
        "generated_by": "tests/reference/lesson02_mixed.py",
        "torch_version": torch.__version__,
        "sample_every": SAMPLE,
        "config": {k: v for k, v in CASE.items()},
        "init": summary(list(init.parameters()), [n for n, _ in init.named_parameters()]),
        "runs": runs,
    }
    if fp16:
        out["scaler"] = scaler_sequence(SCALER, SCALER_STEPS, SCALER_GRAD)
        out["scaler_factors"] = scaler_sequence(SCALER_FACTORS, SCALER_FACTORS_STEPS,
                                                SCALER_FACTORS_GRAD)
    else:
        if base["init"] != out["init"]:
            sys.exit("lesson02_mixed.py: the --base file starts from other weights; regenerate it")
        for key in ("scaler", "scaler_factors"):
            out[key] = base[key]
        for name, r in base["runs"].items():
            runs.setdefault(name, r)
        out["base"] = {"file": option("--base"), "torch_version": base["torch_version"]}
    out["computed_here"] = computed
    target = OUT
    if option("--out"):
        target = pathlib.Path(option("--out"))
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(target)  # never half a file, for a build that is interrupted
    for name, r in runs.items():
        print(f"{name:14} losses {[round(v, 5) for v in r['losses']]} stepped {r['stepped']}")


if __name__ == "__main__":
    main()

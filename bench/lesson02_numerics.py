#!/usr/bin/env python3
"""Lesson 02, parts 4 and 5: the step time of every recompute mode and precision, against the ledger.

Runs the lesson02 program (one thread) for each --recompute mode and --precision and prints the
median step time, its ratio to recompute none in the same precision, and lesson 01's FLOP
prediction for that ratio (recompute_flops_factor: 4/3 for full, 1 + s / (3 (6h + s)) for
selective, Korthikanti et al. 2022 sec. 5); then the memory each run measured against the
ledger (states to the byte, activations as measured / predicted).

    python3 bench/lesson02_numerics.py --binary build/bin/lesson02_solution --steps 30
    # smoke size (ctest): --steps 3 --layers 1 --hidden 32 --seq 16

On the CPU, time is not FLOPs: bf16 matmuls are fast where the CPU has bf16 dot products
(avx512_bf16) and fp16 ones slow where it has no fp16 arithmetic, so the precision rows compare
memory, and the recompute ratios within one precision.
"""
import argparse
import json
import os
import subprocess
import sys


def run(binary: str, extra: list, steps: int, model: list):
    """The run's --json line, or the program's reason where it refuses the mode (exit 2)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DTC_DEVICE="cpu")
    out = subprocess.run([binary, "--steps", str(steps), "--json", *model, *extra], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode == 2 and "--precision" in out.stderr:
        return out.stderr.strip().splitlines()[0]  # e.g. LibTorch 1.13: no CPU fp16
    if out.returncode != 0:
        sys.exit(f"{binary} {' '.join(extra)} failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="build/bin/lesson02_solution")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", default="4")
    ap.add_argument("--hidden", default="128")
    ap.add_argument("--seq", default="64")
    a = ap.parse_args()
    model = ["--layers", a.layers, "--hidden", a.hidden, "--seq", a.seq]
    s, h = float(a.seq), float(a.hidden)
    predicted = {"none": 1.0, "selective": 1.0 + s / (3.0 * (6.0 * h + s)), "full": 4.0 / 3.0}
    print(f"lesson02 numerics: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, "
          f"{a.steps} steps, one thread; median step time after 2 warm-up steps\n")
    print(f"  {'precision':<10}{'recompute':<11}{'step ms':>9}{'vs none':>9}{'ledger':>8}"
          f"{'states B/param':>16}{'act. measured/ledger':>22}")
    ok = True
    # (label, flags): each precision, and bf16 with fp32 gradients (18 bytes a parameter:
    # Megatron-LM's bf16 default)
    precisions = [("fp32", ["--precision", "fp32"]), ("bf16", ["--precision", "bf16"]),
                  ("bf16+g32", ["--precision", "bf16", "--grad-dtype", "fp32"]),
                  ("fp16", ["--precision", "fp16"])]
    for precision, flags in precisions:
        base = None
        for recompute in ("none", "selective", "full"):
            j = run(a.binary, [*flags, "--recompute", recompute], a.steps, model)
            if isinstance(j, str):
                print(f"  {precision:<10}{recompute:<11}skipped: {j}")
                continue
            step = j["median_step_s"]
            base = step if recompute == "none" else base
            m, p = j["memory"]["measured"], j["memory"]["predicted"]
            states = sum(m[k] for k in ("params", "grads", "master", "optimizer")) / j["params"]
            exact = all(m[k] == p[k] for k in ("params", "grads", "master", "optimizer"))
            ok = ok and exact
            print(f"  {precision:<10}{recompute:<11}{step * 1e3:>9.1f}{step / base:>9.2f}"
                  f"{predicted[recompute]:>8.2f}{states:>14.1f}{'' if exact else ' !':<2}"
                  f"{m['activations'] / p['activations']:>22.2f}")
    print("\n  states: the allocator's parameters + gradients + master + AdamW, per parameter "
          "(! where it\n  differs from the ledger's bytes); bf16+g32: bf16 with --grad-dtype fp32; "
          "ledger: lesson 01's\n  recompute FLOP factor.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

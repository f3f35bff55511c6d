#!/usr/bin/env python3
"""Lesson 07 end-to-end test: the reference program on real processes, through torchrun.

    e2e.py --program build/bin/lesson07_solution --torchrun PATH [--torchrun-flags "..."]

1. Memory, 2 ranks, all four stages and stage 3 recomputing in one run (--stage all
   --recompute, the course's default GPT): each rank's measured parameter, gradient and
   optimizer bytes agree with the ledger's ZeRO formulas (ZeRO paper Fig. 1 in fp32 + AdamW
   terms) to within the padding, the peaks rank DDP > 1 > 2 > 3 > 3 recomputing, and every run
   trains DDP's parameters.
   Bytes sent per step equal the ring count on the padded buffers, and the paper's 2 Psi / 3 Psi
   to within the padding (and stage 3's outer unit, gathered once).
   The same in bf16 (--precision bf16, unless --no-bf16), with the master weights too: the
   paper's own 2 + 2 + 12 bytes per parameter per stage, and half the bytes on the wire.
2. Losses, 2 ranks, stages 0-3 in one run (--stage all --prefetch: stage 3 prefetching) on
   lesson 02's reference case "tiny_tied": PyTorch's losses
   (tests/reference/lesson02_reference.json), rel 1e-4.
3. Checkpoints: 2 ranks save a sharded checkpoint at stage 1 after 4 steps; 3 ranks load it at
   stage 3 and train to step 8, consolidating: the losses of steps 4..7 equal PyTorch's.
Each torchrun takes its own free port (c10d rendezvous), so it never collides with another run.
Registered in lessons/07_zero/lesson.cmake (ctest -L lesson07 -R e2e), with --no-bf16 on LibTorch 1.13.
"""
import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "support"))
from e2e_common import digest_ratios, free_port, torchrun_argv  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def run(args, nproc, program_args):
    cmd = [*torchrun_argv(args.torchrun), f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", *shlex.split(args.torchrun_flags),
           "--no_python", args.program, *program_args]
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-4000:])
        raise SystemExit(f"FAIL: exit {p.returncode}")
    lines = [l for l in p.stdout.splitlines() if l.strip().startswith("{")]
    # Debian's torchrun with --tee prefixes lines with "[rank]:"; take the JSON part.
    for line in reversed(p.stdout.splitlines()):
        if "{" in line and line.rstrip().endswith("}"):
            return json.loads(line[line.index("{"):])
    raise SystemExit(f"FAIL: no JSON line in\n{p.stdout[-2000:]}{lines}")


failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def close(got, want, rel):
    return abs(got - want) <= rel * abs(want) + 1e-6


def memory_and_bytes(args, precision):
    extra = ["--recompute"] if precision == "fp32" else []
    j = run(args, 2, ["--stage", "all", *extra, "--steps", "2", "--json",
                      "--precision", precision])
    stages = j["stages"]
    want = [(0, False), (1, False), (2, False), (3, False)] + ([(3, True)] if extra else [])
    check([(s["stage"], s["recompute"]) for s in stages] == want,
          f"{precision}: {len(want)} runs: stages 0-3" + (", then stage 3 recomputing" if extra else ""))
    check(j["precision"] == precision and all(s["precision"] == precision for s in stages),
          f"{precision}: --json says its precision")
    w = j["world"]
    e = 4 if precision == "fp32" else 2  # bytes per element of the parameters and gradients
    keys = ("params", "grads", "optimizer") + (("master",) if precision != "fp32" else ())
    for s in stages:
        m, p, pp = s["memory"]["measured"], s["memory"]["predicted"], s["memory"]["predicted_padded"]
        for k in keys:
            slack = pp[k] - p[k]  # what the padding adds, in bytes
            check(abs(m[k] - p[k]) <= slack + 1e-9,
                  f"{precision} stage {s['stage']} {k}: measured {m[k]} vs ledger {p[k]:.0f} "
                  f"(padding {slack:.0f})")
        if precision != "fp32":
            # The paper's 2 + 2 + 12 bytes per parameter (K = 12: master 4, moments 8), summed.
            total = sum(p[k] for k in keys)
            psi = s["psi"]
            paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / w, 2: 2 * psi + 14 * psi / w,
                     3: 16 * psi / w}[s["stage"]]
            check(abs(total - paper) <= 1e-6 * paper,
                  f"bf16 stage {s['stage']}: the ledger's {total:.0f} bytes are the paper's "
                  f"{paper:.0f}")
        psi, padded, outer = s["psi"], s["padded"], s["outer_padded"]
        units = 3 * padded - outer if s["stage"] == 3 else 2 * padded
        ring = (w - 1) * (units // w) * e
        check(s["comm"]["bytes_per_step"] == ring,
              f"{precision} stage {s['stage']} bytes/step {s['comm']['bytes_per_step']} == ring "
              f"count {ring}")
        theory = s["comm"]["theory_bytes_per_step"]
        allowed = 3 * e * (padded - psi) + (e * (w - 1) / w * outer if s["stage"] == 3 else 0)
        check(abs(s["comm"]["bytes_per_step"] - theory) <= allowed,
              f"{precision} stage {s['stage']} bytes/step vs ZeRO paper {theory:.0f} "
              f"(within {allowed:.0f})")
    peaks = [s["memory"]["measured"]["peak"] for s in stages]
    check(all(a > b for a, b in zip(peaks, peaks[1:])),
          f"{precision}: peak ranking DDP > 1 > 2 > 3" + (" > 3 recomputing" if extra else "") +
          f": {peaks}")
    rel = 1e-4 if precision == "fp32" else 1e-3  # bf16: the reductions round differently
    for s in stages[1:]:
        name = f"{precision} stage {s['stage']}{' recomputing' if s['recompute'] else ''}"
        check(all(close(a, b, rel) for a, b in zip(s["losses"], stages[0]["losses"])),
              f"{name} losses equal DDP's")
        # The parameters too (dtc/digest.h): each one's sum of squares within rel, its sum
        # within rel of sqrt(numel x sumsq), after the same 2 steps (bf16: the master weights).
        ratios = digest_ratios(s.get("param_digest"), stages[0].get("param_digest"), rel, 1e-6)
        check(bool(ratios) and all(r <= 1 for _, r, _, _ in ratios),
              f"{name} parameters (param_digest, {len(ratios or [])} tensors) equal DDP's")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--program", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--torchrun-flags", default="")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="also run every stage in bf16 (LibTorch 2.x: 1.13's gloo has no bf16)")
    args = ap.parse_args()

    # 1. memory and bytes, all stages, in fp32 and in bf16 (the paper's 2 + 2 + 12 layout)
    precisions = ["fp32", "bf16"] if args.bf16 else ["fp32"]
    for precision in precisions:
        memory_and_bytes(args, precision)

    # 2. PyTorch's losses
    ref = json.loads((ROOT / "tests/reference/lesson02_reference.json").read_text())
    case = ref["cases"]["tiny_tied"]
    c = case["config"]
    model = ["--layers", str(c["layers"]), "--hidden", str(c["hidden"]), "--heads",
             str(c["heads"]), "--seq", str(c["ctx"]), "--global-batch", str(c["batch"]),
             "--seed", str(c["seed"]), "--lr", str(c["lr"])]
    # One launch: --stage all runs stages 0-3 one after the other, each from the same
    # initialisation; --prefetch changes stage 3 only (the gather of the next block).
    j = run(args, 2, ["--stage", "all", "--prefetch", "--steps", str(len(case["losses"])),
                      "--json", *model])
    by_stage = {s["stage"]: s for s in j["stages"]}
    check(sorted(by_stage) == [0, 1, 2, 3], f"stages 0-3 ran: {sorted(by_stage)}")
    for stage in (0, 1, 2, 3):
        losses = by_stage.get(stage, {}).get("losses", [])
        check(len(losses) == len(case["losses"]) and
              all(close(a, b, 1e-4) for a, b in zip(losses, case["losses"])),
              f"stage {stage}{' --prefetch' if stage == 3 else ''} losses == PyTorch's: "
              f"{losses[-1] if losses else float('nan'):.6f} vs {case['losses'][-1]:.6f}")

    # 3. sharded checkpoint: 2 ranks save, 3 ranks load (global batch 6 splits both ways); the
    # losses are compared with a 2-rank run straight through (PyTorch's case has batch 4).
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(tmp, "ck")
        model6 = model[:-6] + ["--global-batch", "6", "--seed", "1", "--lr", str(c["lr"])]
        straight = run(args, 2, ["--stage", "0", "--steps", "8", "--json", *model6])["losses"]
        run(args, 2, ["--stage", "1", "--steps", "4", "--json", "--save-sharded", ck, *model6])
        check(sorted(os.listdir(ck)) == ["COMPLETE", "shard-0-of-2.pt", "shard-1-of-2.pt"],
              "two shard files and the COMPLETE marker, no .tmp left")
        cons = os.path.join(tmp, "full.pt")
        j = run(args, 3, ["--stage", "3", "--steps", "8", "--json", "--load-sharded", ck,
                          "--consolidate", cons, *model6])
        check(all(close(a, b, 1e-4) for a, b in zip(j["losses"], straight[4:])),
              f"resumed on 3 ranks: losses of steps 4..7 == uninterrupted {straight[4:]}")
        check(os.path.getsize(cons) > 4 * case["params"], "consolidated file written")

    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()

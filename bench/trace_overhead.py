#!/usr/bin/env python3
"""What --trace costs: the same runs with and without it, median step times side by side.

    bench/trace_overhead.py [--build build] [--steps 30] [--repeats 3] [--smoke]
                            [--torchrun PATH]

Runs each program below under the venv's torchrun (OMP_NUM_THREADS=1), alternately without and
with --trace DIR, --repeats times each, and prints the median over runs of each run's median
step time (after 2 warm-up steps: the programs' own --json "step_time_s", "median_step_s", or
the median of "step_s"), and the ratio on/off:
  lesson06 --sync bucketed, 2 ranks (per step: ~30 spans, ~15 comm spans)
  lesson09 --schedule 1f1b, 4 stages, m 8 (~70 spans, ~50 comm spans)
  lesson02, 1 process (~20 spans)
Off, each span costs one read of a thread-local pointer (dtc::active_tracer()) and no
communicator is wrapped: that cost is below what these timings can resolve, so "off" here is
the course's normal run. Exit 1 when a run fails or its losses differ with --trace (the
trace must not change training: the same losses bit for bit).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
VENV = pathlib.Path(os.environ.get("DTC_CACHE", pathlib.Path.home() / ".cache" / "dtc-course"))
TORCHRUN = VENV / "venv" / "bin" / "torchrun"
MODEL = ["--layers", "4", "--hidden", "128", "--heads", "4", "--seq", "64"]


def run(build, program, ranks, args, trace, torchrun=TORCHRUN):
    cmd = [str(build / "bin" / program), *args, "--json"]
    if ranks > 1:
        cmd = [str(torchrun), "--standalone", f"--nproc_per_node={ranks}", "--no_python", *cmd]
    with tempfile.TemporaryDirectory(prefix="dtc-overhead-") as tmp:
        if trace:
            cmd += ["--trace", tmp]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        if p.returncode != 0:
            sys.stderr.write(p.stderr[-3000:])
            raise SystemExit(f"FAIL: {' '.join(cmd)} exited {p.returncode}")
        events = 0
        if trace:
            events = len(json.loads((pathlib.Path(tmp) / "trace.json").read_text())["traceEvents"])
    j = json.loads([ln for ln in p.stdout.splitlines() if ln.strip()][-1])
    step = j.get("step_time_s") or j.get("median_step_s")
    if step is None:  # lesson 09: every step's time (the first warms up)
        step = statistics.median(j["step_s"][2:] or j["step_s"])
    return step, j["losses"], events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="4 steps, 1 repeat (ctest)")
    ap.add_argument("--torchrun", default=str(TORCHRUN), help="the torchrun to start ranks with")
    a = ap.parse_args()
    build = pathlib.Path(a.build).resolve()
    steps = ["--steps", str(4 if a.smoke else a.steps)]
    repeats = 1 if a.smoke else a.repeats
    cases = [
        ("lesson06 bucketed, 2 ranks", "lesson06_solution", 2, [*MODEL, *steps]),
        ("lesson09 1f1b, 4 stages, m 8", "lesson09_solution", 4,
         [*MODEL, *steps, "--schedule", "1f1b", "--micro-batches", "8", "--global-batch", "16",
          "--no-sweep"]),
        ("lesson02, 1 process", "lesson02_solution", 1, [*MODEL, *steps]),
    ]
    failed = False
    print(f"{'run':32} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'events':>7}")
    for name, program, ranks, args in cases:
        off, on, events = [], [], 0
        losses = {}
        for _ in range(repeats):
            s, l_off, _ = run(build, program, ranks, args, False, a.torchrun)
            off.append(s)
            s, l_on, events = run(build, program, ranks, args, True, a.torchrun)
            on.append(s)
            losses = {"off": l_off, "on": l_on}
        same = losses["off"] == losses["on"]
        failed |= not same
        m_off, m_on = statistics.median(off), statistics.median(on)
        print(f"{name:32} {m_off * 1e3:8.2f} {m_on * 1e3:8.2f} {m_on / m_off:7.3f} {events:7d}"
              + ("" if same else "   <- the losses changed with --trace"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Goodput against the checkpoint interval: lesson 12's program with a failure every M steps on
average, for several intervals, against Young's optimum; a chart from the programs' own JSON.

    /usr/bin/python3 bench/lesson12_goodput.py --binary build/bin/lesson12_solution \\
        [--nproc 2 --mix 2x1x1x1 --steps 400 --fail-every 50 --intervals 1 2 4 8 16 24]
        [--svg lessons/12_fault_tolerance/goodput.svg]

(/usr/bin/python3: Debian's, which has matplotlib; the runs use the course venv's torchrun.)

1. The baseline: the same run with no save and no failure. Its `checkpoint.train_s` (the
   training loop alone) is the useful work U.
2. For each interval T (steps, at most M/2): torchrun --max_restarts=100 with --checkpoint-every
   T --fail-every M: each attempt is killed after M/2 + u of its steps (u in [0, M), drawn from
   the seed and the attempt), torchrun restarts the job, which resumes from its newest checkpoint.
   Goodput = U / the whole job's wall time (restarts, saves and work redone included).
3. Young (1974): with d the time one save stalls training (the runs' `stall_s` per save) and a
   failure every M steps, the interval that loses least is T* = sqrt(2 d M). The first-order
   model drawn beside the measurements: wall = U + (S / T) d + F (R + T / 2 steps), F = S / (M -
   T / 2) failures in S steps (an attempt lives M steps on average and keeps what it saved), R
   a restart's cost, fitted: the median over the runs of what their walls leave for it.
Every run's JSON is checked: at least one restart, and the losses and parameter digest of the
baseline, bit for bit (a resume is exact on one mesh). Exit 1 when one differs.
"""
import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_support import free_port, last_json  # noqa: E402

VENV = pathlib.Path.home() / ".cache" / "dtc-course" / "venv" / "bin"


def run(a, extra):
    cmd = [str(a.torchrun), f"--nproc_per_node={a.nproc}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--max_restarts=100", "--no_python",
           a.binary, "--mix", a.mix, "--steps", str(a.steps), "--json", *extra]
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.monotonic() - start
    if p.returncode != 0:
        sys.exit(f"lesson12_goodput.py: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return wall, last_json(p.stdout)


def model_of(r):
    """The first-order model's goodput at an interval of t steps, from a result's measurements."""
    def model(t_steps):
        failures_n = r["steps"] / (r["fail_every"] - t_steps / 2)
        wall = (r["useful_s"] + r["steps"] / t_steps * r["save_s"] +
                failures_n * (r["restart_s"] + t_steps / 2 * r["step_s"]))
        return r["useful_s"] / wall
    return model


def plot(r, svg):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "lesson12"  # the same bytes for the same figure
    model = model_of(r)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = [row["interval"] for row in r["rows"]]
    ax.plot(xs, [row["goodput"] for row in r["rows"]], "o-", color="#4c72b0", label="measured")
    grid = [xs[0] * (xs[-1] / xs[0]) ** (i / 60) for i in range(61)]
    ax.plot(grid, [model(x) for x in grid], "--", color="#8c8c8c",
            label="first-order model (R fitted)")
    ax.axvline(r["t_star_steps"], color="#c44e52", linestyle=":",
               label=f"Young's T* = sqrt(2 d M) = {r['t_star_steps']:.1f} steps")
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("checkpoint interval T (steps)")
    ax.set_ylabel("goodput (useful work / wall time)")
    ax.set_title(f"{r['nproc']} ranks, {r['steps']} steps, a failure every {r['fail_every']} "
                 f"steps on average, d = {r['save_s'] * 1e3:.0f} ms, R = {r['restart_s']:.1f} s",
                 fontsize=9)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="lower center")
    fig.tight_layout()
    fig.savefig(svg, metadata={"Date": None})
    print(f"  chart: {svg}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="build/bin/lesson12_solution")
    ap.add_argument("--torchrun", default=str(VENV / "torchrun"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--mix", default="2x1x1x1")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--fail-every", type=int, default=50)
    ap.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--svg", default="")
    ap.add_argument("--json-out", default="")
    ap.add_argument("--replot", help="draw --svg from this --json-out of an earlier run, and stop")
    a = ap.parse_args()
    if a.replot:
        plot(json.loads(pathlib.Path(a.replot).read_text()), a.svg)
        return 0
    failures = []
    base_walls, base_train = [], []
    base = None
    for _ in range(a.repeat):
        wall, j = run(a, [])
        base_walls.append(wall)
        base_train.append(j["checkpoint"]["train_s"])
        base = base or j
    useful = statistics.median(base_train)
    launch = statistics.median(w - t for w, t in zip(base_walls, base_train))
    step_s = useful / a.steps
    fail_s = a.fail_every * step_s
    rows, fits = [], []
    for interval in a.intervals:
        if interval > a.fail_every // 2:
            sys.exit(f"lesson12_goodput.py: --intervals {interval} above M/2 = "
                     f"{a.fail_every // 2}: an attempt could die before its first save")
        walls, stalls, restarts = [], [], []
        for _ in range(a.repeat):
            with tempfile.TemporaryDirectory(prefix="dtc-l12-goodput-") as d:
                wall, j = run(a, ["--checkpoint-dir", d, "--checkpoint-every", str(interval),
                                  "--fail-every", str(a.fail_every), "--fail-rank",
                                  str(a.nproc - 1)])
            walls.append(wall)
            restarts.append(j["restarts"])
            saves = a.steps // interval  # over the attempts; the JSON lists the last one's
            stall = j["checkpoint"]["stall_s"] / max(1, len(j["checkpoints"]))
            stalls.append(stall)
            if j["restarts"] > 0:  # what the wall leaves for the restarts, each
                fits.append((wall - useful - saves * stall -
                             j["restarts"] * interval / 2 * step_s) / j["restarts"])
            ok = (j["restarts"] >= 1 and j["losses"] == base["losses"] and
                  j["param_digest"] == base["param_digest"])
            if not ok:
                failures.append(f"interval {interval}: restarts {j['restarts']}, losses and "
                                f"digest {'equal' if j['losses'] == base['losses'] else 'differ'}")
        rows.append({"interval": interval, "wall_s": statistics.median(walls),
                     "goodput": useful / statistics.median(walls),
                     "restarts": statistics.median(restarts),
                     "stall_per_save_s": statistics.median(stalls)})
    save_s = statistics.median(r["stall_per_save_s"] for r in rows)
    restart_s = statistics.median(fits)
    t_star = math.sqrt(2 * save_s * fail_s)

    result = {"nproc": a.nproc, "mix": a.mix, "steps": a.steps, "fail_every": a.fail_every,
              "useful_s": useful, "launch_s": launch, "restart_s": restart_s, "step_s": step_s,
              "save_s": save_s, "t_star_steps": t_star / step_s, "rows": rows}
    model = model_of(result)
    print(f"lesson 12 goodput: {a.nproc} ranks, --mix {a.mix}, {a.steps} steps of "
          f"{step_s * 1e3:.1f} ms (useful work U = {useful:.2f} s), a failure every "
          f"{a.fail_every} steps on average (M = {fail_s:.2f} s), a save d = "
          f"{save_s * 1e3:.1f} ms, a restart R = {restart_s:.2f} s (fitted; a first launch "
          f"{launch:.2f} s); {a.repeat} runs each, medians")
    print(f"  Young's T* = sqrt(2 d M) = {t_star:.3f} s = {t_star / step_s:.1f} steps")
    print("  interval (steps)   restarts   wall (s)   goodput   first-order model")
    for r in rows:
        print(f"  {r['interval']:>16}   {r['restarts']:>8}   {r['wall_s']:8.2f}   "
              f"{r['goodput']:7.3f}   {model(r['interval']):7.3f}")
    best = max(rows, key=lambda r: r["goodput"])
    print(f"  the best measured interval: {best['interval']} steps (goodput {best['goodput']:.3f})")
    if a.json_out:
        pathlib.Path(a.json_out).write_text(json.dumps(result, indent=1) + "\n")
    if a.svg:
        plot(result, a.svg)
    for f in failures:
        print("FAIL " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The pipeline's bubble in one common window, taken apart: what the schedule leaves idle, what
the executor's waits add, and what the messages cost.

    scripts/pipeline_bubble.py TRACE_DIR [--step N] [--unit] [--expect-closed-form] [--json]
    scripts/pipeline_bubble.py --run [--build build] [--nproc 2] [--micro 4 8 16]
                               [--virtual 2] [--steps 4] [--repeat 1] [--layers 8 --hidden 256 --heads 4
                               --seq 128 --global-batch 32]

Reads the trace.json that `lesson11 --trace DIR` writes on gloo (one clock for every rank; a mesh
of pipeline stages only, rank = stage) and, for one step of a pipeline of p stages with v model
chunks each (v = 1: plain 1F1B), prints each
stage's idle time / the window (the first pass's start on any stage to the last pass's end on
any stage) three ways:

  measured   the trace as it ran;
  waits      a replay of the same passes, each lasting what it measured, where every message is
             free but each pass still waits for what the executor waited for before it (the
             receives and the sends of its exchange, as NCCL pairs them: a message completes
             when both sides have posted it);
  schedule   a replay where a pass waits only for its data (a forward for the virtual stage
             before, a backward for the one after), messages free: the schedule's own bubble
             with this machine's pass times.

and the closed form (p - 1) / (v m + p - 1) for equal passes (F = 1, B = 2 per chunk), which is
idle / compute = (p - 1) / (v m) (Narayanan et al. 2021, section 2.2.2). measured - waits is
what the messages cost; waits - schedule what the executor's exchanges cost.

--unit replays the trace with F = 1 and B = 2 for every pass: then `schedule` is the closed
form exactly when each rank ran its passes in the schedule's order, and `waits` too when the
executor's exchanges wait for nothing the schedule does not; --expect-closed-form exits 1
otherwise. --run runs lesson11's reference program under torchrun
(OMP_NUM_THREADS=1) for 1F1B and the interleaved schedule at each m, and prints the table.
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import trace_svg  # noqa: E402

VENV = pathlib.Path(os.environ.get("DTC_CACHE") or pathlib.Path.home() / ".cache/dtc-course")
TORCHRUN = VENV / "venv" / "bin" / "torchrun"
PASS = re.compile(r"^(\d*)([FB])(\d+)$")  # <chunk>F<micro>; one chunk: F<micro>
EPS = 1.0  # us: a wait that ends this close before a pass begins is that pass's


def passes_and_messages(trace, step):
    """Per rank: the step's passes (chunk, kind, micro, b, e) in time order, and its pipeline
    messages (kind, peer, tag, b, e)."""
    spans = trace_svg.spans_of(trace)
    marks = {s["rank"]: s for s in spans if s["cat"] == "step" and s["name"] == f"step {step}"}
    if not marks:
        raise SystemExit(f"pipeline_bubble.py: the trace has no 'step {step}' span")
    ops, msgs = {}, {}
    for r, mark in marks.items():
        inside = [s for s in spans if s["rank"] == r and mark["b"] <= s["b"] < mark["e"]]
        ops[r] = [(int(m.group(1) or 0), m.group(2), int(m.group(3)), s["b"], s["e"])
                  for s in inside if s["cat"] == "compute" for m in [PASS.match(s["name"])] if m]
        msgs[r] = [(s["name"], s["args"].get("peer_rank", s["args"].get("peer")),
                    s["args"].get("tag"), s["b"], s["e"]) for s in inside
                   if s["cat"] == "comm" and s["name"] in ("send", "recv")
                   and s["args"].get("group", "pp") == "pp"]
    if len(ops) > 1 and not any(msgs.values()):
        raise SystemExit("pipeline_bubble.py: the trace has passes on several ranks but no "
                         "send/recv spans of a 'pp' group: a trace of lesson 11 on gloo is what "
                         "this reads (NCCL's traces record a group span instead)")
    return ops, msgs


def replay(ops, deps, unit=False):
    """Each pass lasts what it measured (or F = 1, B = 2): trace_svg.pipeline_replay."""
    try:
        return trace_svg.pipeline_replay(
            ops, deps, lambda r, k: ((1.0 if ops[r][k][1] == "F" else 2.0) if unit
                                     else ops[r][k][4] - ops[r][k][3]))
    except ValueError as e:
        raise SystemExit(f"pipeline_bubble.py: {e}")


def executor_deps(ops, msgs):
    """Each pass waits for the messages whose wait ended just before it began: for a receive,
    the pass the sender ran before posting it; for a send, the pass the receiver ran before
    posting its receive (the k-th send from a to b with tag t meets the k-th such receive)."""
    def before(r, t):  # the index of rank r's last pass ending by time t, or None
        ks = [k for k, o in enumerate(ops[r]) if o[4] <= t + EPS]
        return ks[-1] if ks else None

    def nth(r, kind, peer, tag):
        out = {}
        for m in msgs[r]:
            if m[0] == kind:
                out.setdefault((m[1], m[2]), []).append(m)
        return out.get((peer, tag), [])

    deps = {}
    for r in ops:
        count = {}
        for m in msgs[r]:
            kind, peer, tag, b, e = m
            key = (kind, peer, tag)
            count[key] = count.get(key, 0) + 1
            waiter = next((k for k, o in enumerate(ops[r]) if o[3] >= e - EPS), None)
            if waiter is None or peer not in ops:
                continue
            other = nth(peer, "recv" if kind == "send" else "send", r, tag)
            if len(other) < count[key]:
                continue  # posted in another step
            j = before(peer, other[count[key] - 1][3])
            if j is not None:
                deps.setdefault((r, waiter), []).append((peer, j))
    return deps


def bubbles(times, compute):
    lo = min(t[0][0] for t in times.values() if t)
    hi = max(t[-1][1] for t in times.values() if t)
    return [1 - compute[r] / (hi - lo) for r in sorted(times)], hi - lo


def analyse(trace_dir, step=None, unit=False):
    trace = json.loads((pathlib.Path(trace_dir) / "trace.json").read_text())
    steps = sorted({int(s["name"].split()[1]) for s in trace_svg.spans_of(trace)
                    if s["cat"] == "step"})
    results = []
    for n in ([step] if step else steps[1:] or steps):
        ops, msgs = passes_and_messages(trace, n)
        p = len(ops)
        v = 1 + max(o[0] for lst in ops.values() for o in lst)
        m = 1 + max(o[2] for lst in ops.values() for o in lst)
        measured = {r: [(o[3], o[4]) for o in lst] for r, lst in ops.items()}
        if unit:
            compute = {r: sum(1.0 if o[1] == "F" else 2.0 for o in lst) for r, lst in ops.items()}
        else:
            compute = {r: sum(o[4] - o[3] for o in lst) for r, lst in ops.items()}
        row = {"step": n, "p": p, "v": v, "m": m,
               "closed_form": (p - 1) / (v * m + p - 1), "idle_per_compute": (p - 1) / (v * m)}
        for name, times in (("measured", None if unit else measured),
                            ("waits", replay(ops, executor_deps(ops, msgs), unit)),
                            ("schedule", replay(ops, trace_svg.pipeline_data_deps(ops, p), unit))):
            if times is None:
                continue
            per, window = bubbles(times, compute)
            row[name] = per
            row[name + "_window_ms"] = window / 1e3
        if not unit:
            per, _ = bubbles(replay(ops, executor_deps(ops, msgs), True),
                             {r: sum(1.0 if o[1] == "F" else 2.0 for o in lst)
                              for r, lst in ops.items()})
            row["unit_waits"] = per
        row["receives"] = sum(1 for r in msgs for x in msgs[r] if x[0] == "recv")
        row["receive_wait_ms"] = sum(x[4] - x[3] for r in msgs for x in msgs[r]
                                     if x[0] == "recv") / 1e3
        results.append(row)
    if not step:  # the step with the shortest measured (or replayed) window
        key = "measured_window_ms" if not unit else "schedule_window_ms"
        results = [min(results, key=lambda x: x[key])]
    return results[0]


def fmt_row(name, row):
    def mean(per):
        return sum(per) / len(per)
    cols = [f"{name:12} {row['m']:3d} {row['v']:2d}"]
    if "measured" in row:
        cols.append(f"{mean(row['measured']):6.3f} ({' '.join(f'{x:.2f}' for x in row['measured'])})")
    else:
        cols.append(f"{'-':>6}")
    for k in ("waits", "schedule", "unit_waits"):
        cols.append(f"{mean(row[k]):6.3f}" if k in row else f"{'-':>6}")
    cols.append(f"{row['closed_form']:6.3f}")
    return "  ".join(cols)


HEADER = ("idle / window, the mean over stages; measured: each stage too; waits: the executor's "
          "waits,\nmessages free; schedule: data only, messages free; the same with F = 1, B = 2; "
          "(p-1)/(vm+p-1);\nwith --repeat, the run of the median measured mean, and the range\n"
          "schedule       m  v  measured (per stage)   waits  schedule  waits(F=1,B=2)  closed")


def run(args):
    build = pathlib.Path(args.build).resolve()
    rows = []
    for m in args.micro:
        for v in (1, args.virtual):
            # the mix's MICRO is a micro-batch's sequences: m = global batch / MICRO
            mix = f"1x1x{args.nproc}x1:0:none:{args.global_batch // m}:{v}"
            runs = []
            for _ in range(args.repeat):
                with tempfile.TemporaryDirectory(prefix="dtc-bubble-") as tmp:
                    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={args.nproc}",
                           "--no_python", str(build / "bin" / "lesson11_solution"), "--mix", mix,
                           "--steps", str(args.steps), "--trace", tmp, "--layers",
                           str(args.layers), "--hidden", str(args.hidden), "--heads",
                           str(args.heads), "--seq", str(args.seq), "--global-batch",
                           str(args.global_batch)]
                    env = dict(os.environ, OMP_NUM_THREADS="1")
                    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
                    if p.returncode != 0:
                        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n"
                                         f"{p.stderr[-2000:]}")
                    runs.append(analyse(tmp))
            means = sorted(sum(r["measured"]) / len(r["measured"]) for r in runs)
            # the run whose measured mean is the median; the range over every run
            row = min(runs, key=lambda r: abs(sum(r["measured"]) / len(r["measured"])
                                              - means[len(means) // 2]))
            row["mix"] = mix
            row["measured_range"] = [means[0], means[-1]]
            rows.append(row)
            rng = f"  [{means[0]:.3f}-{means[-1]:.3f}]" if len(runs) > 1 else ""
            print(fmt_row("1f1b" if v == 1 else "interleaved", row) + rng, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace_dir", nargs="?")
    ap.add_argument("--step", type=int)
    ap.add_argument("--unit", action="store_true", help="replay with F = 1, B = 2")
    ap.add_argument("--expect-closed-form", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--build", default="build")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each; the median's row")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=32)
    a = ap.parse_args()
    if a.run:
        print(HEADER)
        rows = run(a)
        if a.json:
            print(json.dumps(rows))
        return 0
    if not a.trace_dir:
        ap.error("give a trace directory (lesson11 --trace DIR), or --run")
    row = analyse(a.trace_dir, a.step, a.unit)
    print(HEADER)
    print(fmt_row("1f1b" if row["v"] == 1 else "interleaved", row))
    if a.json:
        print(json.dumps(row))
    if a.expect_closed_form:
        off = {k: row[k] for k in ("waits", "schedule")
               if any(abs(x - row["closed_form"]) > 1e-9 for x in row[k])}
        if off:
            print(f"pipeline_bubble.py: with F = 1, B = 2 and free messages the stages idle "
                  f"{off} of the window, not (p-1)/(vm+p-1) = {row['closed_form']:.6f}: "
                  "'schedule' off means the passes' order, 'waits' the executor's exchanges",
                  file=sys.stderr)
            return 1
        print(f"every stage idles (p-1)/(vm+p-1) = {row['closed_form']:.6f} of the window "
              "(F = 1, B = 2), with the executor's waits and without")
    return 0


if __name__ == "__main__":
    sys.exit(main())

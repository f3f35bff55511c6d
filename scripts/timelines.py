#!/usr/bin/env python3
"""Draws the timelines that the lessons' READMEs and decks show, from real runs.

    scripts/timelines.py [--build build] [--only NAME ...] [--list] [--check]

Each figure runs a reference program under the venv's torchrun with --trace (OMP_NUM_THREADS=1),
checks on the trace the claim its README makes (a lighter form of the lessons' timeline tests,
tests/lessonNN/timeline_test.cpp), and only then writes lessons/NN_topic/timelines/NAME.svg
(scripts/trace_svg.py). A figure whose claim does not hold is not written: the script says
which, and exits 1. --check runs and checks every figure and writes none. The timestamps are this machine's, measured now; the README says where it
ran (2 cores: on 4 ranks the processes share them).
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


def spans(trace, rank, cat=None, prefix=""):
    return [s for s in trace_svg.spans_of(trace)
            if s["rank"] == rank and (cat is None or (s["cat"] == "comm") == (cat == "comm"))
            and s["name"].startswith(prefix)]


def in_step(trace, rank, step):
    mark = [s for s in spans(trace, rank, "compute", f"step {step}") if s["name"] == f"step {step}"]
    lo, hi = mark[0]["b"], mark[0]["e"]
    return [s for s in trace_svg.spans_of(trace) if s["rank"] == rank and lo <= s["b"] < hi]


def one(items, name):
    found = [s for s in items if s["name"] == name]
    if len(found) != 1:
        raise AssertionError(f"{len(found)} spans '{name}'")
    return found[0]


def grads(items):
    return [s for s in items if s["cat"] == "comm" and s["name"] == "allreduce"
            and s["args"].get("bytes", 0) > 4]


def ddp_bucketed(trace, ranks):
    for r in range(ranks):
        step = in_step(trace, r, 1)
        backward = one(step, "backward")
        g = grads(step)
        assert g and g[0]["b"] < backward["e"], f"rank {r}: the first bucket waits for backward"
        waited = g[0]["args"].get("wait_us")
        assert waited is not None, f"rank {r}: the first bucket's Work was never wait()ed"
        blocks = [s for s in step if s["name"].startswith("bwd block")]
        assert any(g[0]["b"] < b["b"] < waited for b in blocks), \
            f"rank {r}: the first bucket was waited for before a later block's backward began"
    return ("the first bucket's allreduce starts before backward ends and runs beside a later "
            "block's backward, on every rank")


def ddp_naive(trace, ranks):
    for r in range(ranks):
        step = in_step(trace, r, 1)
        backward = one(step, "backward")
        assert all(s["b"] >= backward["e"] for s in grads(step)), f"rank {r}: an early allreduce"
    return "every allreduce starts after backward ends"


def zero3(prefetch):
    def check(trace, ranks):
        for r in range(ranks):
            step = in_step(trace, r, 1)
            blocks = [s for s in step if s["name"].startswith("fwd block")]
            gathers = [s for s in step if s["cat"] == "comm" and s["name"] == "allgather"
                       and s["b"] < blocks[-1]["e"]][-len(blocks):]  # one per block, in order
            for i in range(len(blocks) - 1):
                early = gathers[i + 1]["b"] < blocks[i]["e"]
                assert early == prefetch, f"rank {r}: block {i + 1}'s gather, prefetch {prefetch}"
                if prefetch:
                    waited = gathers[i + 1]["args"].get("wait_us", -1)
                    assert waited >= blocks[i]["e"], \
                        f"rank {r}: block {i + 1}'s gather was waited for during block {i}"
        return ("each block's all-gather starts while the block before computes" if prefetch
                else "each block's all-gather starts after the block before ends")
    return check


def tp(trace, ranks):
    for r in range(ranks):
        step = in_step(trace, r, 1)
        ars = [s for s in step if s["cat"] == "comm" and s["name"] == "allreduce"]
        for block in (s for s in step if s["name"].startswith("fwd block")):
            inside = [a for a in ars if block["b"] <= a["b"] and a["e"] <= block["e"]]
            assert len(inside) == 2, \
                f"rank {r}: {block['name']} holds {len(inside)} allreduces, not 2 (g, g)"
    return "each block's forward holds its two allreduces (g after attention, g after the MLP)"


def pipeline(schedule, m):
    def check(trace, ranks):
        for s in range(ranks):
            step = in_step(trace, s, 1)
            held = most = 0
            changes = sorted((x["e"], 1 if x["name"][0] == "F" else -1) for x in step
                             if re.match(r"^[FB]\d+$", x["name"]))
            for _, d in changes:
                held += d
                most = max(most, held)
            want = ranks - s if schedule == "1f1b" else m
            assert most == want, f"stage {s} held {most} micro-batches, expected {want}"
        return ("stage s holds at most p - s micro-batches" if schedule == "1f1b"
                else "every stage holds all m micro-batches")
    return check


def split_or_chunked(schedule, m, chunks=1):
    """Interleaved and ZB-H1 (L09TimelineOrder's claims, lighter): each stage's passes <c>F<i>,
    B<i>, I<i>, W<i> from the given forward's watch; at most the micro-batch pieces the schedule
    holds (interleaved: its warm-up + 1 pieces of 1/v; ZB-H1: min(m, p) graphs, each kept from
    its F to its W), and for ZB-H1 every I before its W."""
    def check(trace, ranks):
        for s in range(ranks):
            step = in_step(trace, s, 1)
            passes = [x for x in step if x["cat"] != "comm"
                      and re.match(r"^\d*[FBIW]\d+$", x["name"])]
            held = most = 0
            for _, d in sorted((x["e"], 1 if re.sub(r"^\d+", "", x["name"])[0] == "F" else
                                -1 if re.sub(r"^\d+", "", x["name"])[0] in "BW" else 0)
                               for x in passes):
                held += d
                most = max(most, held)
            if schedule == "interleaved":
                want = min(2 * (ranks - s - 1) + (chunks - 1) * ranks + 1, chunks * m)
            else:
                want = min(m, ranks)
                ends = {x["name"]: x for x in passes}
                for i in range(m):
                    if f"I{i}" in ends:
                        assert ends[f"I{i}"]["e"] <= ends[f"W{i}"]["b"], f"stage {s}: W{i} before I{i}"
                    elif s > 0:
                        raise AssertionError(f"stage {s}: no I{i}")
            assert most <= want, f"stage {s} held {most} pieces, the schedule holds {want}"
        return (f"every rank holds at most its warm-up + 1 pieces of 1/{chunks}"
                if schedule == "interleaved" else "every stage holds at most min(m, p) graphs; "
                "each I before its W")
    return check


def ring(trace, ranks):
    # L10Timeline.RingReceivesTheNextBlockWhileComputingThisOne's predicate: in every layer's
    # forward, every attention block but the last runs while a receive posted before it is not
    # waited for until after it (the last has no next block to receive)
    for r in range(ranks):
        step = in_step(trace, r, 1)
        recv = [s for s in step if s["cat"] == "comm" and s["name"] == "recv"]
        layers = [s for s in step if s["cat"] != "comm" and s["name"].startswith("fwd block")]
        assert layers, f"rank {r}: no layer's forward in step 1"
        for layer in layers:
            attn = [s for s in step if s["name"] == "attn" and layer["b"] <= s["b"] < layer["e"]]
            beside = sum(1 for a in attn if any(
                x["b"] < a["b"] and x["args"].get("wait_us", -1) >= a["e"] for x in recv))
            assert attn and beside == len(attn) - 1, (
                f"rank {r}, {layer['name']}: {beside} of {len(attn)} attention blocks ran beside "
                f"a receive (every one but the last should)")
    return ("in every layer's forward, every attention block but the last runs while the next "
            "K/V hop is posted and not yet waited for")


MODEL = ["--layers", "4", "--hidden", "128", "--heads", "4", "--seq", "64"]
FIGURES = {
    # name: (lesson dir, program, ranks, args, title, check, textbook[, zoom])
    "ddp_naive": ("06_ddp", "lesson06_solution", 2, ["--sync", "naive", "--steps", "3"],
                  "Lesson 06, --sync naive: every allreduce after backward (step 1, 2 ranks)",
                  ddp_naive, False),
    "ddp_bucketed": ("06_ddp", "lesson06_solution", 2, ["--sync", "bucketed", "--steps", "3"],
                     "Lesson 06, --sync bucketed: the buckets' allreduces during backward "
                     "(step 1, 2 ranks)", ddp_bucketed, False),
    "zero3": ("07_zero", "lesson07_solution", 2, ["--stage", "3", "--steps", "3"],
              "Lesson 07, stage 3: gather a block, compute it, gather the next (step 1, 2 ranks)",
              zero3(False), False),
    "zero3_prefetch": ("07_zero", "lesson07_solution", 2,
                       ["--stage", "3", "--prefetch", "--steps", "3"],
                       "Lesson 07, stage 3 --prefetch: the next gather beside this block "
                       "(step 1, 2 ranks)", zero3(True), False),
    "tp": ("08_tensor_parallel", "lesson08_solution", 2,
           ["--tp", "2", "--layers", "2", "--hidden", "256", "--seq", "128", "--steps", "3"],
           "Lesson 08, tensor parallelism, tp 2: allreduces inside each block (step 1)",
           tp, False),
    "gpipe": ("09_pipeline_parallel", "lesson09_solution", 4,
              ["--schedule", "gpipe", "--micro-batches", "8", "--global-batch", "16",
               "--no-sweep", "--steps", "3"],
              "Lesson 09, GPipe, 4 stages, m = 8 (step 1)", pipeline("gpipe", 8), True),
    "1f1b": ("09_pipeline_parallel", "lesson09_solution", 4,
             ["--schedule", "1f1b", "--micro-batches", "8", "--global-batch", "16",
              "--no-sweep", "--steps", "3"],
             "Lesson 09, 1F1B, 4 stages, m = 8 (step 1)", pipeline("1f1b", 8), True),
    "interleaved": ("09_pipeline_parallel", "lesson09_solution", 4,
                    ["--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "8",
                     "--global-batch", "16", "--no-sweep", "--steps", "3"],
                    "Lesson 09, interleaved 1F1B, 4 ranks x 2 chunks, m = 8 (step 1)",
                    split_or_chunked("interleaved", 8, 2), False),
    "zb_h1": ("09_pipeline_parallel", "lesson09_solution", 4,
              ["--schedule", "zb-h1", "--micro-batches", "8", "--global-batch", "16",
               "--no-sweep", "--steps", "3"],
              "Lesson 09, ZB-H1, 4 stages, m = 8 (step 1)", split_or_chunked("zb-h1", 8), False),
    "nd_1f1b": ("11_nd_parallel", "lesson11_solution", 2,
                ["--mix", "1x1x2x1:0:none:4:1", "--layers", "8", "--hidden", "256", "--heads",
                 "4", "--seq", "128", "--global-batch", "32", "--steps", "3"],
                "Lesson 11, 1F1B, 2 stages, m = 8 (step 1)", pipeline("1f1b", 8), True),
    "nd_interleaved": ("11_nd_parallel", "lesson11_solution", 2,
                       ["--mix", "1x1x2x1:0:none:4:2", "--layers", "8", "--hidden", "256",
                        "--heads", "4", "--seq", "128", "--global-batch", "32", "--steps", "3"],
                       "Lesson 11, interleaved 1F1B, 2 ranks x 2 chunks, m = 8 (step 1)",
                       split_or_chunked("interleaved", 8, 2), False),
    "ring": ("10_context_parallel", "lesson10_solution", 4,
             ["--cp", "4", "--zigzag", "--seq", "256", "--steps", "3"],
             "Lesson 10, ring attention, zig-zag, cp 4, seq 256: around block 1's forward, from "
             "the first rank's start to the last rank's end (step 1)",
             ring, False, "fwd block 1"),
    "ring_step": ("10_context_parallel", "lesson10_solution", 4,
                  ["--cp", "4", "--zigzag", "--seq", "256", "--steps", "3"],
                  "Lesson 10, ring attention, zig-zag, cp 4, seq 256 (step 1)", ring, False),
}


def draw(name, build: pathlib.Path, write=True):
    lesson, program, ranks, args, title, check, textbook, *zoom = FIGURES[name]
    with tempfile.TemporaryDirectory(prefix="dtc-timeline-") as tmp:
        cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", "--no_python",
               str(build / "bin" / program), *args, "--trace", tmp, "--json"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
        trace = json.loads((pathlib.Path(tmp) / "trace.json").read_text())
    claim = check(trace, ranks)
    # what the README quotes: rank 0's step 1, its spans one level under the step, in ms
    step = in_step(trace, 0, 1)
    top = [x for x in step if x["cat"] != "comm" and not x["name"].startswith("step")]
    outer = [x for x in top if not any(o is not x and o["b"] <= x["b"] and x["e"] <= o["e"]
                                       for o in top)]
    whole = [x for x in step if x["name"] == "step 1"][0]
    parts = ", ".join(f'{x["name"]} {(x["e"] - x["b"]) / 1e3:.1f}' for x in outer[:12])
    claim += f"; rank 0, step 1: {(whole['e'] - whole['b']) / 1e3:.1f} ms: {parts}"
    out = ROOT / "lessons" / lesson / "timelines" / f"{name}.svg"
    if not write:
        return out, claim + " (checked, not written)"
    out.parent.mkdir(exist_ok=True)
    out.write_text(trace_svg.render(trace, step=1, title=title, with_textbook=textbook,
                                    zoom=zoom[0] if zoom else None))
    return out, claim


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--check", action="store_true", help="run and check, write no figure")
    a = ap.parse_args()
    if a.list:
        for name, f in FIGURES.items():
            print(f"{name:16} lessons/{f[0]}/timelines/{name}.svg")
        return 0
    failed = 0
    for name in a.only or FIGURES:
        if name not in FIGURES:
            print(f"timelines.py: no figure {name!r} (--list shows them)", file=sys.stderr)
            return 2
        try:
            out, claim = draw(name, pathlib.Path(a.build).resolve(), write=not a.check)
            print(f"{name}: {out.relative_to(ROOT)} ({claim})")
        except AssertionError as e:
            print(f"{name}: NOT WRITTEN: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Draws a course trace (a program's --trace DIR/trace.json) as an SVG timeline.

    scripts/trace_svg.py TRACE.json OUT.svg [--step N] [--title TEXT] [--textbook]

One lane per rank for compute (nested spans stacked: step, forward/backward, blocks) and one
per comm lane (operations in flight at once get a lane each), on one time axis in ms. Compute
is blue (forward) and green (backward), the optimizer purple; communication is orange and red.
A comm bar under a compute bar means the operation was posted before the compute began and not
waited for until after it: the schedule of an overlap, not proof that the bytes moved meanwhile.
A comm bar drawn faint is one whose completion the backend does not report (gloo's sends and
receives, end=wait in its args): it ends where the rank waited for it, not where the bytes
arrived, so its length is an upper bound on the transfer. Solid bars end at the backend's own
completion (a gloo collective's future, NCCL's end event seen by the tracer's watcher).

  --step N      only step N (from the earliest start of any rank's "step N" to the latest end)
  --textbook    below the measured lanes, the same per-rank order of pipeline micro-batches
                (spans F<i>, B<i>) on the papers' idealised clock: a forward takes one unit, a
                backward two, messages nothing; each op starts when its stage is free and its
                input has arrived (F<i> after stage s-1's F<i>, B<i> after stage s+1's B<i>)
  --zoom NAME   with --step: only from the start to the end of each rank's first span NAME in
                that step (e.g. "fwd block 1")
  --ranks 0,1   only these ranks
  --selftest    check the idealised clock against closed forms, and draw a made-up trace
  --lanes N     at most N comm lanes per rank (default 3; more operations in flight at once
                share the last lane)

The module is also used by scripts/charts.py (the decks) and scripts/timelines.py (READMEs).
Plain SVG, no dependencies beyond Python 3.
"""
import argparse
import html
import json
import pathlib
import re
import sys

WIDTH = 1000
LEFT = 90
RIGHT = 20
ROW = 18
GAP = 8

COMPUTE = [(r"^(\d*F\d|fwd|forward)", "#4c72b0"), (r"^(\d*B\d|bwd|backward)", "#55a868"),
           (r"^\d*I\d", "#8cc79a"), (r"^\d*W\d", "#2f6b3f"),
           (r"^(optimizer)", "#8172b2"), (r"^(step)", "#e5e5e5"), (r"^(sync|wait)", "#b0b0b0"),
           (r"^(R\d|recompute)", "#64b5cd")]
COMM = [("allreduce", "#dd8452"), ("allgather", "#c44e52"), ("reduce_scatter", "#937860"),
        ("send", "#da8bc3"), ("recv", "#a05d56"), ("alltoall", "#8c613c"),
        ("broadcast", "#ccb974"), ("barrier", "#bbbbbb")]


def colour(span):
    if span["cat"] == "comm":
        return dict(COMM).get(span["name"], "#999999")
    for pattern, c in COMPUTE:
        if re.match(pattern, span["name"]):
            return c
    return "#a0a0a0"


def spans_of(trace):
    """The complete spans of a trace: dicts with name, cat, rank, tid, b, e (us), args."""
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        b = float(e["ts"])
        out.append({"name": e["name"], "cat": e.get("cat", ""), "rank": e["pid"],
                    "tid": e.get("tid", 0), "b": b, "e": b + float(e.get("dur", 0)),
                    "args": e.get("args", {})})
    out.sort(key=lambda s: (s["b"], -s["e"]))
    return out


def depths(spans):
    """Nesting depth of each compute span of one rank (a span inside another is one deeper)."""
    stack, out = [], []
    for s in spans:
        while stack and not (stack[-1]["b"] <= s["b"] and s["e"] <= stack[-1]["e"] + 1e-3):
            stack.pop()
        out.append(len(stack))
        stack.append(s)
    return out


def pipeline_replay(passes, deps, duration):
    """Replays pipeline passes on an idealised clock: passes[r] is rank r's list of passes in
    its order; pass k starts when rank r's pass k - 1 and every pass (q, j) in deps[(r, k)] have
    ended, and lasts duration(r, k). Returns per rank the (begin, end) of each pass.
    @raises ValueError when the passes wait for each other in a circle."""
    end, times = {}, {r: [] for r in passes}
    left = sum(len(v) for v in passes.values())
    while left:
        moved = False
        for r in passes:
            k = len(times[r])
            if k >= len(passes[r]):
                continue
            need = [end.get(d) for d in deps.get((r, k), ())]
            if any(x is None for x in need):
                continue
            start = max([end[(r, k - 1)] if k else 0.0] + need)
            end[(r, k)] = start + duration(r, k)
            times[r].append((start, end[(r, k)]))
            left -= 1
            moved = True
        if not moved:
            raise ValueError("the passes wait for each other in a circle on the idealised clock")
    return times


def pipeline_data_deps(passes, p):
    """What each pass waits for by its data alone: passes[r][k] starts (chunk, kind, micro); a
    forward waits for the same micro-batch's forward on the virtual stage before, a backward for
    its backward on the virtual stage after, the last virtual stage's backward for its own
    forward (virtual stage = chunk p + r)."""
    where = {(o[1], o[2], o[0] * p + r): (r, k) for r, lst in passes.items()
             for k, o in enumerate(lst)}
    deps = {}
    for r, lst in passes.items():
        for k, (chunk, kind, micro, *_) in enumerate(lst):
            vs = chunk * p + r
            d = where.get((kind, micro, vs - 1 if kind == "F" else vs + 1))
            if kind == "B" and d is None:
                d = where.get(("F", micro, vs))
            if d is not None:
                deps[(r, k)] = [d]
    return deps


def textbook(order_by_rank):
    """Idealised times of each rank's F<i>/B<i> sequence: F = 1 unit, B = 2, no transfer time."""
    ranks = sorted(order_by_rank)
    passes = {s: [(0, kind, i) for kind, i in order_by_rank[r]] for s, r in enumerate(ranks)}
    times = pipeline_replay(passes, pipeline_data_deps(passes, len(ranks)),
                            lambda s, k: 1.0 if passes[s][k][1] == "F" else 2.0)
    return {s: [(f"{kind}{i}", b, e) for (_, kind, i), (b, e) in zip(passes[s], times[s])]
            for s in passes}


def render(trace, step=None, title="", with_textbook=False, ranks=None, max_lanes=3, zoom=None):
    spans = spans_of(trace)
    if ranks is not None:
        spans = [s for s in spans if s["rank"] in ranks]
    if step is not None:
        marks = [s for s in spans if s["cat"] == "step" and s["name"] == f"step {step}"]
        if not marks:
            raise ValueError(f"the trace has no 'step {step}' span")
        lo, hi = min(s["b"] for s in marks), max(s["e"] for s in marks)
        if zoom:
            # every rank's first span named `zoom` inside the step
            first = {}
            for s in spans:
                if s["name"] == zoom and lo <= s["b"] < hi and s["rank"] not in first:
                    first[s["rank"]] = s
            if not first:
                raise ValueError(f"step {step} has no span '{zoom}'")
            lo = min(s["b"] for s in first.values())
            hi = max(s["e"] for s in first.values())
        spans = [s for s in spans if s["e"] > lo and s["b"] < hi]
    else:
        lo = min(s["b"] for s in spans)
        hi = max(s["e"] for s in spans)
    hi = max(hi, lo + 1)
    scale = (WIDTH - LEFT - RIGHT) / (hi - lo)

    def x(t):
        return LEFT + (min(max(t, lo), hi) - lo) * scale

    rows = []  # (label, y, [(x0, x1, colour, text, tooltip)])
    y = 40 if title else 16
    for rank in sorted({s["rank"] for s in spans}):
        mine = [s for s in spans if s["rank"] == rank]
        compute = [s for s in mine if s["cat"] != "comm"]
        comm = [s for s in mine if s["cat"] == "comm"]
        d = depths(compute)
        levels = max(d) + 1 if d else 1
        for level in range(levels):
            bars = [(s, colour(s)) for s, k in zip(compute, d) if k == level]
            rows.append((f"rank {rank}" if level == 0 else "", y, bars, level == 0))
            y += ROW
        # Operations in flight at once get a lane each; past max_lanes, they share the last.
        lanes = sorted({s["tid"] for s in comm})
        shown = lanes[:max_lanes]
        for k, lane in enumerate(shown):
            last = k == len(shown) - 1
            bars = [(s, colour(s)) for s in comm
                    if s["tid"] == lane or (last and s["tid"] in lanes[max_lanes:])]
            rows.append(("  comm" if k == 0 else "", y, bars, False))
            y += ROW
        y += GAP
    book_rows = []
    if with_textbook:
        order = {}
        bounds = {s["rank"]: (s["b"], s["e"]) for s in spans
                  if step is not None and s["cat"] == "step" and s["name"] == f"step {step}"}
        for s in spans:
            m = re.match(r"^([FB])(\d+)$", s["name"])
            b, e = bounds.get(s["rank"], (float("-inf"), float("inf")))
            if m and s["cat"] != "comm" and b <= s["b"] and s["e"] <= e:  # this rank's step only
                order.setdefault(s["rank"], []).append((m.group(1), int(m.group(2))))
        if order:
            ideal = textbook(order)
            units = max(e for ops in ideal.values() for _, _, e in ops)
            uscale = (WIDTH - LEFT - RIGHT) / units
            y += 52
            book_title_y = y
            y += 6
            for s, ops in sorted(ideal.items()):
                book_rows.append((f"stage {s}", y, ops, uscale))
                y += ROW
    height = y + 46
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="Helvetica, Arial, sans-serif" '
           f'font-size="10">', f'<rect width="{WIDTH}" height="{height}" fill="white"/>']
    if title:
        out.append(f'<text x="{LEFT}" y="20" font-size="13">{html.escape(title)}</text>')
    for label, ry, bars, first in rows:
        if label:
            out.append(f'<text x="6" y="{ry + 12}">{html.escape(label)}</text>')
        for s, c in bars:
            x0, x1 = x(s["b"]), x(s["e"])
            w = max(x1 - x0, 0.6)
            tip = f'{s["name"]}: {s["e"] - s["b"]:.0f} us'
            if s["args"]:
                tip += " " + ", ".join(f"{k}={v}" for k, v in s["args"].items())
            # No completion of its own (gloo's sends and receives): the bar ends at the wait.
            faint = s["cat"] == "comm" and s["args"].get("end") == "wait"
            out.append(f'<rect x="{x0:.1f}" y="{ry + 1}" width="{w:.1f}" height="{ROW - 3}" '
                       f'fill="{c}" fill-opacity="{0.3 if faint else 1}" stroke="white" '
                       f'stroke-width="0.5"><title>{html.escape(tip)}</title></rect>')
            name = s["name"]
            if w > 6.2 * len(name) + 4:
                out.append(f'<text x="{x0 + 3:.1f}" y="{ry + 12}" fill="#222">'
                           f'{html.escape(name)}</text>')
    # the time axis
    axis_y = (rows[-1][1] + ROW + 4) if rows else 20
    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{WIDTH - RIGHT}" y2="{axis_y}" '
               f'stroke="#444"/>')
    span_ms = (hi - lo) / 1e3
    tick = next(t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
                            1e4, 1e5) if span_ms / t <= 10)
    t = 0.0
    while t <= span_ms + 1e-9:
        tx = LEFT + t * 1e3 * scale
        out.append(f'<line x1="{tx:.1f}" y1="{axis_y}" x2="{tx:.1f}" y2="{axis_y + 4}" '
                   f'stroke="#444"/><text x="{tx:.1f}" y="{axis_y + 14}" '
                   f'text-anchor="middle">{t:g} ms</text>')
        t += tick
    # the legend: the colours this picture uses
    used, seen = [], set()
    for _, _, bars, _ in rows:
        for sp, c in bars:
            key = (sp["name"] if sp["cat"] == "comm"
                   else re.sub(r"[ \d].*$", "", re.sub(r"^\d+(?=[A-Z])", "", sp["name"])))
            if c not in seen and not sp["name"].startswith("step"):
                seen.add(c)
                used.append((key, c))
    lx = LEFT
    for key, c in used:
        out.append(f'<rect x="{lx}" y="{axis_y + 22}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{lx + 13}" y="{axis_y + 31}">{html.escape(key)}</text>')
        lx += 13 + 6.2 * len(key) + 14
    if book_rows:
        out.append(f'<text x="{LEFT}" y="{book_title_y}" font-size="11">the same order on the '
                   f'papers\' clock (forward 1 unit, backward 2, messages free)</text>')
        for label, ry, ops, uscale in book_rows:
            out.append(f'<text x="6" y="{ry + 12}">{html.escape(label)}</text>')
            for name, b, e in ops:
                x0 = LEFT + b * uscale
                w = (e - b) * uscale
                c = "#4c72b0" if name[0] == "F" else "#55a868"
                out.append(f'<rect x="{x0:.1f}" y="{ry + 1}" width="{w:.1f}" '
                           f'height="{ROW - 3}" fill="{c}" stroke="white"/>')
                if w > 6.2 * len(name) + 2:
                    out.append(f'<text x="{x0 + 2:.1f}" y="{ry + 12}" fill="#fff">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def one_f_one_b(p, m, s):
    """Stage s's 1F1B order (PipeDream-Flush, Narayanan et al. 2021, Figure 4)."""
    warm = min(p - s - 1, m)
    ops = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    return ops + [("B", i) for i in range(b, m)]


def selftest():
    """The idealised clock against closed forms, and a drawing of a made-up trace."""
    import xml.etree.ElementTree as ET
    for p, m in ((4, 8), (2, 4), (4, 4), (3, 1)):
        for name, order in (("gpipe", lambda s: [("F", i) for i in range(m)] +
                             [("B", i) for i in range(m)]),
                            ("1f1b", lambda s: one_f_one_b(p, m, s))):
            ideal = textbook({s: order(s) for s in range(p)})
            makespan = max(e for ops in ideal.values() for _, _, e in ops)
            # a step lasts (m + p - 1) slots of F + B = 3 units; each stage idles (p - 1) of them
            assert makespan == 3 * (m + p - 1), (name, p, m, makespan)
            for s, ops in ideal.items():
                busy = sum(e - b for _, b, e in ops)
                assert busy == 3 * m, (name, p, m, s, busy)
            # 1F1B: stage 0's first backward starts once stage p-1 has done F0 and B0 came back
            if name == "1f1b":
                b0 = next(b for n, b, _ in ideal[0] if n == "B0")
                assert b0 == (p - 1) + 1 + 2 * (p - 1), (p, m, b0)
    trace = {"traceEvents": [
        {"name": "step 1", "cat": "step", "ph": "X", "ts": 0, "dur": 100, "pid": 0, "tid": 0},
        {"name": "backward", "cat": "compute", "ph": "X", "ts": 10, "dur": 80, "pid": 0, "tid": 0},
        {"name": "bwd block 1", "cat": "compute", "ph": "X", "ts": 10, "dur": 40, "pid": 0,
         "tid": 0},
        {"name": "allreduce", "cat": "comm", "ph": "X", "ts": 30, "dur": 50, "pid": 0, "tid": 1,
         "args": {"bytes": 1024, "end": "done"}},
        {"name": "send", "cat": "comm", "ph": "X", "ts": 40, "dur": 10, "pid": 0, "tid": 3,
         "args": {"end": "wait"}},
        {"name": "recv", "cat": "comm", "ph": "X", "ts": 45, "dur": 20, "pid": 0, "tid": 3,
         "args": {"end": "wait"}}]}
    assert [d for d in depths([x for x in spans_of(trace) if x["cat"] != "comm"])] == [0, 1, 2]
    root = ET.fromstring(render(trace, step=1, title="selftest"))
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    assert len(rects) >= 1 + 6, len(rects)  # the background, one bar per span, the legend
    faint = [r for r in rects if r.get("fill-opacity") == "0.3"]
    assert len(faint) == 2, "the send and the receive that ended at their wait are drawn faint"
    print("trace_svg.py: selftest ok (the idealised clock: 3 (m + p - 1) units for GPipe and 1F1B, "
          "3m busy per stage; a drawing)")
    return 0


def main():
    if sys.argv[1:] == ["--selftest"]:
        return selftest()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=pathlib.Path)
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--step", type=int)
    ap.add_argument("--title", default="")
    ap.add_argument("--textbook", action="store_true")
    ap.add_argument("--ranks")
    ap.add_argument("--lanes", type=int, default=3)
    ap.add_argument("--zoom")
    a = ap.parse_args()
    try:
        trace = json.loads(a.trace.read_text())
    except (OSError, ValueError) as e:
        print(f"trace_svg.py: cannot read {a.trace}: {e}\nHINT: pass the trace.json that a "
              "program's --trace DIR wrote", file=sys.stderr)
        return 2
    ranks = [int(r) for r in a.ranks.split(",")] if a.ranks else None
    try:
        svg = render(trace, a.step, a.title, a.textbook, ranks, max(1, a.lanes), a.zoom)
    except ValueError as e:
        print(f"trace_svg.py: {e}", file=sys.stderr)
        return 2
    a.out.write_text(svg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

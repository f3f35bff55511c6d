#!/usr/bin/env python3
"""Draws the slides' charts from the course programs' own JSON output (never by hand).

    scripts/charts.py BUILD_DIR OUT_DIR        # e.g. build build/slides/charts

Each chart runs a reference program (BUILD_DIR/bin/lessonNN_solution ... --json) and plots what
it printed, as SVG, with matplotlib. A chart whose program is not built is skipped with a note;
a deck that shows it then fails the slide check (its image does not load).

Programs run with OMP_NUM_THREADS=1, as the READMEs' quoted runs do: a run is reproducible bit
for bit for a fixed thread count only, and on a busy 2-core machine lesson 02's 200 steps took
10 CPU seconds with one thread against 74 with two (OpenMP's threads spin while they wait).
A program's output is computed once and reused: it is cached under $DTC_CACHE/charts/, keyed by
the program's bytes, its arguments and that thread count, so that `make test` on a busy machine
does not retrain lesson 02 every time (DTC_CHARTS_FRESH=1 ignores the cache). Time limits only
guard against a hang: they are generous (CHART_TIMEOUT_S, default 900 s per program).
"""
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GB = 1e9
PARTS = [("params", "parameters", "#4c72b0"), ("grads", "gradients", "#55a868"),
         ("optimizer", "optimizer states", "#c44e52"), ("activations", "activations", "#8172b2")]


TIMEOUT_S = int(os.environ.get("CHART_TIMEOUT_S", "900"))
CACHE = pathlib.Path(os.environ.get("DTC_CACHE") or
                     pathlib.Path(os.environ.get("XDG_CACHE_HOME") or
                                  pathlib.Path.home() / ".cache") / "dtc-course") / "charts"
THREADS = {"OMP_NUM_THREADS": "1"}


def cached_stdout(cmd, program: pathlib.Path) -> str:
    """stdout of cmd (which runs `program`), from the cache when this program and these
    arguments already ran; otherwise run it (check=True) and store what it printed."""
    key = hashlib.sha256(program.read_bytes())
    key.update("\0".join(str(c) for c in cmd[cmd.index(str(program)) + 1:]).encode())
    key.update("".join(f"\0{k}={v}" for k, v in THREADS.items()).encode())
    entry = CACHE / f"{program.name}-{key.hexdigest()[:24]}.out"
    if entry.exists() and not os.environ.get("DTC_CHARTS_FRESH"):
        return entry.read_text()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                       env=dict(os.environ, **THREADS))
    if r.returncode != 0:
        raise SystemExit(f"charts: {' '.join(map(str, cmd))} exited {r.returncode}:\n"
                         f"{r.stderr[-2000:]}")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(r.stdout)
    tmp.replace(entry)
    return r.stdout


def run_json(program: pathlib.Path, *args):
    out = cached_stdout([str(program), *args, "--json"], program)
    return json.loads(out.strip().splitlines()[-1])


def stacked(ax, labels, ledgers, capacity_gb, legend="upper left"):
    bottom = [0.0] * len(labels)
    for key, name, color in PARTS:
        values = [l["per_device_bytes"][key] / GB for l in ledgers]
        ax.bar(labels, values, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        ax.text(x, total, f"{total:,.0f} GB", ha="center", va="bottom", fontsize=9)
    ax.axhline(capacity_gb, color="black", linestyle="--", linewidth=1)
    ax.text(len(labels) - 0.5, capacity_gb, f" one {capacity_gb:g} GB GPU", va="bottom",
            ha="right", fontsize=9)
    ax.set_ylabel("GB per device")
    ax.legend(fontsize=8, loc=legend)
    return max(bottom)


def lesson01_family(build: pathlib.Path, out: pathlib.Path):
    rows = run_json(build / "bin" / "lesson01_solution")["comparison"]
    fig, ax = plt.subplots(figsize=(7, 4))
    top = stacked(ax, [r["model"]["name"] for r in rows], rows, rows[0]["gpu_memory_bytes"] / GB)
    ax.set_ylim(0, top * 1.1)
    ax.set_title("Training memory on one device: BF16 + AdamW, seq 2048, batch 1")
    fig.tight_layout()
    fig.savefig(out / "l01_family.svg")
    plt.close(fig)


def lesson01_zero(build: pathlib.Path, out: pathlib.Path):
    ledgers = [run_json(build / "bin" / "lesson01_solution", "--model", "llama-7b", "--dp", "64",
                        "--zero", str(stage)) for stage in range(4)]
    fig, ax = plt.subplots(figsize=(7, 4))
    top = stacked(ax, ["DDP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3"], ledgers,
                  ledgers[0]["gpu_memory_bytes"] / GB, legend="upper right")
    ax.set_ylim(0, top * 1.12)
    ax.set_title("llama-7b over 64 data-parallel GPUs: what each ZeRO stage shards")
    fig.tight_layout()
    fig.savefig(out / "l01_zero.svg")
    plt.close(fig)


def lesson02_loss(build: pathlib.Path, out: pathlib.Path):
    data = run_json(build / "bin" / "lesson02_solution", "--steps", "200", "--seed", "1")
    losses = data["losses"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, color="#4c72b0")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats per byte)")
    ax.set_title("The baseline: one process, default model, seed 1")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "l02_loss.svg")
    plt.close(fig)


def torchrun(build: pathlib.Path):
    """The torchrun CMake found for this build (DTC_TORCHRUN), with its flags."""
    cache = (build / "CMakeCache.txt").read_text()
    path = re.search(r"^DTC_TORCHRUN:FILEPATH=(.*)$", cache, re.M).group(1)
    flags = [] if "venv" in path or "site-packages" in path else ["--redirects", "2", "--tee", "2"]
    return [path, "--standalone", *flags]


def lesson03_busbw(build: pathlib.Path, out: pathlib.Path):
    bench = build / "bin" / "bench_collectives"
    stdout = cached_stdout(torchrun(build) + ["--nproc_per_node=2", "--no_python", str(bench),
                                             "--json", "--max-bytes", "16M", "--warmup", "2",
                                             "--iters", "5"], bench)
    data = json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1])
    sizes = [row["size"] for row in data["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, name, color in (("ring", "ring allreduce (yours)", "#c44e52"),
                             ("gloo", "gloo allreduce", "#4c72b0")):
        ax.plot(sizes, [row[key]["busbw"] for row in data["rows"]], marker="o", label=name,
                color=color)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"Allreduce on {data['world']} CPU ranks (gloo, loopback): busbw = algbw x 2(n-1)/n")
    ax.legend(fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "l03_busbw.svg")
    plt.close(fig)


CHARTS = [("lesson01_solution", lesson01_family), ("lesson01_solution", lesson01_zero),
          ("lesson02_solution", lesson02_loss), ("bench_collectives", lesson03_busbw)]


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    build, out = pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for program, chart in CHARTS:
        if not (build / "bin" / program).exists():
            print(f"charts: skipped {chart.__name__}: {build}/bin/{program} is not built")
            continue
        chart(build, out)
        print(f"charts: {chart.__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What lesson 12's checkpoints cost the training: no save, a synchronous save and an
asynchronous one, on the same mesh and model, in one run.

    ~/.cache/dtc-course/venv/bin/python bench/lesson12_checkpoint.py \\
        --binary build/bin/lesson12_solution             # 4 ranks, 2x1x2x1, the default model
    ... --nproc 2 --mix 2x1x1x1:1 --every 2 --repeat 5   # ZeRO-1, a save every 2 steps

Each configuration runs --repeat times, interleaved (none, sync, async, none, ...), under the
venv's torchrun, one thread per rank (OMP_NUM_THREADS=1), --steps steps with a checkpoint every
--every steps into a fresh directory. Reported from the program's own --json (rank 0):
`checkpoint.train_s`, the wall time of the training loop, saves and the wait for the last
asynchronous save included; `checkpoint.stall_s`, what the saves kept training waiting. The
ratios are each configuration's median train_s over no save's; the async save's state is then
compared with the synchronous save's, file by file, byte for byte (the same steps of the same
run: they must be equal).
"""
import argparse
import filecmp
import json
import os
import shutil
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_support import free_port, last_json  # noqa: E402

VENV = pathlib.Path.home() / ".cache" / "dtc-course" / "venv" / "bin"


def run(a, extra, directory=None):
    cmd = [str(a.torchrun), f"--nproc_per_node={a.nproc}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--no_python", a.binary,
           "--mix", a.mix, "--steps", str(a.steps), "--json", *extra]
    if directory:
        cmd += ["--checkpoint-dir", directory, "--checkpoint-every", str(a.every)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        sys.exit(f"lesson12_checkpoint.py: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return last_json(p.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="build/bin/lesson12_solution")
    ap.add_argument("--torchrun", default=str(VENV / "torchrun"))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--mix", default="2x1x2x1")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    train_s = {"none": [], "sync": [], "async": []}
    stall_s = {"sync": [], "async": []}
    dirs, made = {}, []
    for i in range(a.repeat):
        for kind in ("none", "sync", "async"):
            if kind == "none":
                j = run(a, [])
            else:
                d = tempfile.mkdtemp(prefix=f"dtc-l12-bench-{kind}-")
                made.append(d)
                j = run(a, ["--async-save"] if kind == "async" else [], d)
                stall_s[kind].append(j["checkpoint"]["stall_s"])
                dirs.setdefault(kind, d)
            train_s[kind].append(j["checkpoint"]["train_s"])
    base = statistics.median(train_s["none"])
    print(f"lesson 12, {a.nproc} ranks, --mix {a.mix}, {a.steps} steps, a save every {a.every} "
          f"({a.steps // a.every} saves), {a.repeat} runs each, median (min-max):")
    for kind in ("none", "sync", "async"):
        t = train_s[kind]
        line = (f"  {kind:<5} train {statistics.median(t):7.3f} s ({min(t):.3f}-{max(t):.3f})"
                f"  x{statistics.median(t) / base:.3f} of no save")
        if kind in stall_s:
            line += f", training waited {statistics.median(stall_s[kind]):.3f} s for the saves"
        print(line)
    sync_dir, async_dir = pathlib.Path(dirs["sync"]), pathlib.Path(dirs["async"])
    files = sorted(p.relative_to(sync_dir) for p in sync_dir.rglob("*") if p.is_file())
    same = files == sorted(p.relative_to(async_dir) for p in async_dir.rglob("*") if p.is_file())
    same = same and all(filecmp.cmp(sync_dir / f, async_dir / f, shallow=False) for f in files)
    print(f"  the async save's {len(files)} files equal the sync save's byte for byte: {same}")
    for d in made:
        shutil.rmtree(d, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Lesson 05 end to end: the Flight Recorder on a real hang, read by the program's fr-analyze.

    fr_e2e.py --torchrun PATH [--torchrun-flags "..."] --program PROG

1. `PROG fault --case skip-collective --no-check --fr-dump DIR` on 2 processes under torchrun: it
   must fail (exit != 0) and leave rank0.json and rank1.json (each rank's dump, taken while its
   collective is in flight);
2. `PROG fr-analyze DIR/rank0.json DIR/rank1.json --json` (the learner's analyze_flight_recorder):
   exit 1 (a hang found), seq 1, mismatch true, rank 0 in gloo:all_reduce(Float[4]) and rank 1 in
   gloo:broadcast(Float[2]), as the fault lab made them.
Exits 0 when every check passed, 1 otherwise, 77 (skipped) where LibTorch has no Flight Recorder
for gloo (the dumps are empty: LibTorch 1.13).
"""
import argparse
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "support"))
from e2e_common import free_port  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--torchrun-flags", default="")
    ap.add_argument("--program", required=True)
    a = ap.parse_args()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(
            [a.torchrun, *shlex.split(a.torchrun_flags), "--nproc_per_node=2", "--rdzv_backend=c10d",
             f"--rdzv_endpoint=localhost:{free_port()}", "--no_python", a.program, "fault", "--case",
             "skip-collective", "--no-check", "--timeout-ms", "3000", "--fr-dump", tmp],
            capture_output=True, text=True, timeout=120)
        print(f"{'ok  ' if run.returncode != 0 else 'FAIL'} the faulty run failed (exit {run.returncode})")
        if run.returncode == 0:
            failures.append("run")
        files = [pathlib.Path(tmp) / f"rank{r}.json" for r in (0, 1)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            print(f"FAIL no dump {' '.join(missing)}:\n{run.stderr[-3000:]}")
            return 1
        if not any(f.read_text().strip() for f in files):
            print("skipped: the dumps are empty: this LibTorch has no Flight Recorder for gloo (1.13)")
            return 77
        res = subprocess.run([a.program, "fr-analyze", *map(str, files), "--json"],
                             capture_output=True, text=True, timeout=60)
    print(res.stdout + res.stderr)
    checks = [("exit code 1 (a hang found)", res.returncode == 1)]
    try:
        v = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        v = None
    checks.append(("a JSON line", v is not None))
    if v is not None:
        checks += [
            ("seq == 1", v.get("seq") == 1),
            ("mismatch", v.get("mismatch") is True),
            ("rank 0 in gloo:all_reduce(Float[4])", v.get("calls", {}).get("0") == "gloo:all_reduce(Float[4])"),
            ("rank 1 in gloo:broadcast(Float[2])", v.get("calls", {}).get("1") == "gloo:broadcast(Float[2])"),
            ("no rank missing", v.get("missing") == []),
        ]
    for what, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Lesson 12 end to end: a rank killed, torchrun's restart, the resume; and a resume on another
world size. Judged on exit codes and numbers, against the same program run without a failure.

    e2e_restart.py --torchrun PATH [--torchrun-flags "..."] [--rdzv-port0] --program PROG
                   --nproc N --mix MIX --steps T --fail-at-step K --fail-rank R --every E [--hang]
                   [--elastic-nproc N2 --elastic-mix MIX2 --elastic-step S] -- ARGS...

1. the straight run: torchrun N PROG ARGS --mix MIX --steps T --json, no checkpoint;
2. the failing run: torchrun --max_restarts=1 (the spelling 1.13 knows too) ... --checkpoint-dir D
   --checkpoint-every E
   --fail-at-step K --fail-rank R: rank R kills its own process as step K starts, torchrun
   restarts the job, and the second attempt resumes from the newest committed checkpoint (with
   --hang: rank R stops communicating instead, --hang-at-step K --timeout-s 5, and the others'
   collectives time out, so that they exit and torchrun restarts the job; the test waits that
   timeout out: the restarted ranks connect under the same timeout, and on a loaded 2-core
   machine they took 1.5 s of it to start, so a shorter one would make the run flaky). Exit 0,
   "restarts" 1, "resumed_from_step" K - K mod E, and "losses" and "param_digest" equal to the
   straight run's, exactly (the same mesh: the same float operations in the same order);
3. with --elastic-nproc: the checkpoint of step S that the failing run's N ranks saved on MIX
   (S a multiple of E before K: its first attempt wrote it before the kill), copied alone into
   a directory of its own; N2 ranks (--mix MIX2) resume from it and finish: "resumed_from_step"
   S, "world" N2, the first S
   losses equal, the parameters' digest within rtol 1e-3 of the straight run's (another mesh sums
   in another order: fp32 rounding, not exact).
Every run has a timeout: a hang is a failure that names the run. Exit 0 when every check passed.
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "support"))
from e2e_common import digest_ratios, torchrun_cmd  # noqa: E402

TIMEOUT_S = 150


def last_json(text):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--torchrun-flags", default="")
    ap.add_argument("--rdzv-port0", action="store_true")
    ap.add_argument("--program", required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--fail-at-step", type=int, required=True)
    ap.add_argument("--fail-rank", type=int, default=0)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--elastic-nproc", type=int, default=0)
    ap.add_argument("--mix", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--elastic-mix", default="")
    ap.add_argument("--elastic-step", type=int, default=0)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    model = a.args[1:] if a.args[:1] == ["--"] else a.args
    args = [*model, "--mix", a.mix, "--steps", str(a.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failures = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    def run(name, nproc, prog_args, extra_flags=""):
        cmd = torchrun_cmd(a.torchrun, " ".join([a.torchrun_flags, extra_flags]), a.rdzv_port0,
                           nproc, a.program, [*prog_args, "--json"])
        print("$", " ".join(cmd), flush=True)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            check(False, f"{name}: ended within {TIMEOUT_S} s (a hang)")
            return None
        check(p.returncode == 0, f"{name}: exit code {p.returncode} (expected 0)")
        j = last_json(p.stdout)
        check(j is not None, f"{name}: rank 0 printed a JSON line")
        if p.returncode != 0 or j is None:
            print((p.stdout + p.stderr)[-3000:])
        return j

    straight = run("the straight run", a.nproc, args)
    with tempfile.TemporaryDirectory(prefix="dtc-l12-") as d:
        failing = run("the failing run", a.nproc,
                      [*args, "--checkpoint-dir", d, "--checkpoint-every", str(a.every),
                       *(["--hang-at-step", str(a.fail_at_step), "--timeout-s", "5"] if a.hang
                         else ["--fail-at-step", str(a.fail_at_step)]),
                       "--fail-rank", str(a.fail_rank)],
                      "--max_restarts=1")
        if straight and failing:
            want_from = a.fail_at_step - a.fail_at_step % a.every
            check(failing.get("restarts") == 1, f"restarts {failing.get('restarts')} (1)")
            check(failing.get("resumed_from_step") == want_from,
                  f"resumed_from_step {failing.get('resumed_from_step')} ({want_from})")
            check(failing.get("losses") == straight.get("losses"),
                  "every loss equals the straight run's, bit for bit")
            check(failing.get("param_digest") == straight.get("param_digest"),
                  "the parameter digest equals the straight run's, bit for bit")
            committed = sorted(p.parent.name for p in pathlib.Path(d).glob("step_*/metadata.json"))
            check(committed == [f"step_{k:08d}" for k in range(a.every, a.steps + 1, a.every)],
                  f"the committed checkpoints: {committed}")
        if a.elastic_nproc:
            # The checkpoint of step S that N ranks saved on MIX: the failing run's first attempt
            # wrote it before the kill; alone in a directory of its own, the newest there.
            with tempfile.TemporaryDirectory(prefix="dtc-l12-elastic-") as e:
                saved = pathlib.Path(d, f"step_{a.elastic_step:08d}")
                first = (a.elastic_step % a.every == 0 and a.elastic_step < a.fail_at_step
                         and (saved / "metadata.json").is_file())
                check(first, f"{a.nproc} ranks saved step {a.elastic_step}: the failing run's "
                             f"{saved.name}, committed before the kill")
                if first:
                    shutil.copytree(saved, pathlib.Path(e, saved.name))
                second = first and run(f"{a.elastic_nproc} ranks from step {a.elastic_step}",
                                       a.elastic_nproc, [*model, "--mix", a.elastic_mix, "--steps",
                                                         str(a.steps), "--checkpoint-dir", e])
                if straight and first and second:
                    s = a.elastic_step
                    check(second.get("resumed_from_step") == s,
                          f"resumed_from_step {second.get('resumed_from_step')} ({s})")
                    check(second.get("world") == a.elastic_nproc,
                          f"world {second.get('world')} ({a.elastic_nproc})")
                    check(second.get("losses", [])[:s] == straight["losses"][:s],
                          f"the first {s} losses are the straight run's (read from the "
                          "checkpoint)")
                    rest = list(zip(second.get("losses", [])[s:], straight["losses"][s:]))
                    check(len(rest) == len(straight["losses"]) - s and
                          all(abs(g - w) <= 1e-3 * abs(w) + 1e-5 for g, w in rest),
                          f"the later losses within rtol 1e-3 of the straight run's: {rest}")
                    ratios = digest_ratios(second.get("param_digest"),
                                           straight.get("param_digest"), 1e-3, 1e-5)
                    check(ratios is not None and all(r <= 1 for _, r, _, _ in ratios),
                          "the parameter digest within rtol 1e-3 of the straight run's"
                          + ("" if ratios is None else
                             f" (worst {max(r for _, r, _, _ in ratios):.3f} of the tolerance)"))
    print(f"FAILED: {len(failures)} check(s)" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

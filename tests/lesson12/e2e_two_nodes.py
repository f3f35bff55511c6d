#!/usr/bin/env python3
"""Lesson 12 end to end across two "nodes" and back to one: a job of 2 x 2 ranks on lesson 04's
two network namespaces (scripts/two-nodes.sh) saves step 2; a job of 2 ranks on one node, on
another mesh, resumes from that checkpoint (torchrun's --nnodes=1:2 elasticity, one node lost).

    e2e_two_nodes.py --e2e-run tests/support/e2e_run.py --two-nodes-script S --torchrun T
                     [--torchrun-flags "..."] [--rdzv-port0] --program P --baseline L02
                     --mix MIX --resume-mix MIX2 -- MODEL ARGS...

Both runs go through tests/support/e2e_run.py, judged on exit codes and numbers: the first
reports world 4 and the checkpoint of step 2; the second world 2, resumed_from_step 2, and the
losses and parameter digest of lesson 02's single-process run of 4 steps (the baseline's
tolerance: another mesh sums in another order). Exit 77 (a skip for ctest) where namespaces
cannot be made, as two-nodes.sh says.
"""
import argparse
import subprocess
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--e2e-run", required=True)
    ap.add_argument("--two-nodes-script", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--torchrun-flags", default="")
    ap.add_argument("--rdzv-port0", action="store_true")
    ap.add_argument("--program", required=True)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--mix", required=True)
    ap.add_argument("--resume-mix", required=True)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    model = a.args[1:] if a.args[:1] == ["--"] else a.args
    run = [sys.executable, a.e2e_run, "--torchrun", a.torchrun,
           f"--torchrun-flags={a.torchrun_flags}", *(["--rdzv-port0"] if a.rdzv_port0 else []),
           "--program", a.program]
    with tempfile.TemporaryDirectory(prefix="dtc-l12-two-nodes-") as d:
        first = subprocess.run([*run, "--nproc", "4", "--launcher", "two-nodes",
                                "--two-nodes-script", a.two_nodes_script,
                                "--json-equals", "world=4", "--json-equals", "checkpoints=[2]",
                                "--", *model, "--mix", a.mix, "--steps", "2",
                                "--checkpoint-dir", d, "--checkpoint-every", "2", "--json"])
        if first.returncode != 0:
            return first.returncode  # 77: no namespaces here, a skip
        second = subprocess.run([*run, "--nproc", "2", "--json-equals", "world=2",
                                 "--json-equals", "resumed_from_step=2",
                                 "--losses-like", a.baseline,
                                 "--losses-like-args=" + " ".join([*model, "--steps", "4"]),
                                 "--", *model, "--mix", a.resume_mix, "--steps", "4",
                                 "--checkpoint-dir", d, "--json"])
        return second.returncode


if __name__ == "__main__":
    sys.exit(main())

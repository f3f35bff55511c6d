#!/usr/bin/env python3
"""Lesson 06's benchmark: the hand-built C++ DDP against PyTorch's DistributedDataParallel.

    bench/lesson06_vs_pytorch.py --program build/bin/lesson06_solution [--steps 30] [--smoke]

Runs, one after the other, with the same model (lesson 02's GPT, default 4 layers, hidden 128,
seq 64), global batch, world size (2), gloo on the CPU and 1 thread per rank (OMP_NUM_THREADS=1,
torch.set_num_threads(1)), all launched by the venv's torchrun:
  1. lesson06 --sync bucketed on 2 ranks          3. PyTorch DDP on 2 ranks
  2. lesson06 --sync naive, 4. --sync flat         5. lesson06 and PyTorch on 1 rank
and prints each median step time (after 2 warm-up steps), tokens/s, and the ratios
C++/PyTorch and bucketed/naive. Exit 1 when a run fails or the two sides' losses disagree
(rtol 1e-3: different kernels, same maths). --smoke: a tiny model, 4 steps, runs 1-3 only (ctest).
--cpp-torchrun debian launches a light-path (LibTorch 1.13) build with Debian's torchrun: a 1.13
rank cannot talk to the 2.x agent's TCPStore ("Broken pipe"); PyTorch's side stays on the venv.
"""
import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys

from bench_support import python_worker, torchrun_argv

ROOT = pathlib.Path(__file__).resolve().parents[1]
VENV = pathlib.Path(os.environ.get("DTC_CACHE", pathlib.Path.home() / ".cache" / "dtc-course"))
VENV_BIN = VENV / "venv" / "bin"


def run(cmd, env):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-4000:])
        raise SystemExit(f"FAIL: {' '.join(map(str, cmd))} exited {p.returncode}")
    return json.loads([ln for ln in p.stdout.splitlines() if ln.strip()][-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--program", required=True, help="build/bin/lesson06_solution")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--bucket-kb", type=float, default=256)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 4 steps (for ctest)")
    ap.add_argument("--cpp-torchrun", choices=["venv", "debian"], default="venv",
                    help="torchrun for the C++ program: debian for a light-path build (a "
                         "LibTorch 1.13 rank cannot talk to the 2.x agent's store)")
    a = ap.parse_args()
    model = ["--layers", "4", "--hidden", "128", "--heads", "4", "--seq", "64"]
    steps = a.steps
    if a.smoke:
        model = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16"]
        steps = 4
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", DTC_DEVICE="cpu")
    common = [*model, "--steps", str(steps), "--global-batch", str(a.global_batch),
              "--bucket-kb", str(a.bucket_kb)]

    def torchrun(n):
        return [*torchrun_argv(str(VENV_BIN / "torchrun")), "--standalone",
                f"--nproc_per_node={n}"]

    def cpp_torchrun(n):
        if a.cpp_torchrun == "venv":
            return torchrun(n)
        with socket.socket() as sock:  # Debian's --standalone always takes port 29400
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return [*torchrun_argv("torchrun"), "--nnodes=1", f"--nproc_per_node={n}",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--redirects", "2",
                "--tee", "2"]

    def cpp(n, sync):
        return run(cpp_torchrun(n) + ["--no_python", a.program, *common, "--sync", sync, "--json"],
                   env)

    def torch_ddp(n):
        return run(torchrun(n) + python_worker(ROOT / "bench" / "lesson06_pytorch_ddp.py", *common,
                                               "--threads", "1", python=VENV_BIN / "python"),
                   env)

    res = {"C++ bucketed, 2 ranks": cpp(2, "bucketed"), "C++ naive, 2 ranks": cpp(2, "naive"),
           "PyTorch DDP, 2 ranks": torch_ddp(2)}
    if not a.smoke:  # the smoke run (ctest) keeps to the three that the checks below need
        res["C++ flat, 2 ranks"] = cpp(2, "flat")
        res["C++ bucketed, 1 rank"] = cpp(1, "bucketed")
        res["PyTorch DDP, 1 rank"] = torch_ddp(1)
    print(f"lesson 06 benchmark: {' '.join(model)}, global batch {a.global_batch}, "
          f"{steps} steps, bucket {a.bucket_kb:g} KiB, gloo, 1 thread per rank")
    print(f"  {'run':<24} {'median step ms':>15} {'tokens/s':>10} {'final loss':>11}")
    for name, r in res.items():
        print(f"  {name:<24} {r['step_time_s'] * 1e3:>15.2f} {r['tokens_per_s']:>10.0f} "
              f"{r['losses'][-1]:>11.4f}")
    c, p = res["C++ bucketed, 2 ranks"], res["PyTorch DDP, 2 ranks"]
    naive = res["C++ naive, 2 ranks"]
    ratio = c["step_time_s"] / p["step_time_s"]
    print(f"  C++ / PyTorch step time (2 ranks):   {ratio:.3f}  (goal <= 1.0)")
    print(f"  bucketed / naive step time:          "
          f"{c['step_time_s'] / naive['step_time_s']:.3f}  (goal < 1.0)")
    result = {"cpp_over_pytorch": ratio,
              "bucketed_over_naive": c["step_time_s"] / naive["step_time_s"]}
    if "C++ bucketed, 1 rank" in res:
        one, pone = res["C++ bucketed, 1 rank"], res["PyTorch DDP, 1 rank"]
        result["cpp_2_over_1_ranks_tokens_per_s"] = c["tokens_per_s"] / one["tokens_per_s"]
        result["pytorch_2_over_1_ranks_tokens_per_s"] = p["tokens_per_s"] / pone["tokens_per_s"]
        print(f"  2 ranks / 1 rank tokens/s: C++ {result['cpp_2_over_1_ranks_tokens_per_s']:.2f}, "
              f"PyTorch {result['pytorch_2_over_1_ranks_tokens_per_s']:.2f}")
    print("RESULT " + json.dumps(result))
    worst = max(abs(x - y) / (1e-5 + 1e-3 * abs(y)) for x, y in zip(c["losses"], p["losses"]))
    if worst > 1.0:
        print(f"FAIL: C++ and PyTorch losses differ beyond rtol 1e-3 (worst {worst:.2f})")
        return 1
    print("ok: C++ DDP and PyTorch DDP losses agree within rtol 1e-3")
    return 0


if __name__ == "__main__":
    sys.exit(main())

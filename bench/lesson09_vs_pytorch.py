#!/usr/bin/env python3
"""Lesson 09's pipeline against PyTorch's torch.distributed.pipelining, on CPU gloo.

Runs both in one go on the same model split, the same initial weights (the course's
deterministic init) and the same batches, with the same world size, micro-batches and
schedule, one thread per rank; prints the median step time of each and their ratio, the
largest difference between their losses, and the bubble each side measured.

    ~/.cache/dtc-course/venv/bin/python bench/lesson09_vs_pytorch.py \\
        --binary build/bin/lesson09_solution --nproc 4 --micro-batches 4 --steps 20
    ~/.cache/dtc-course/venv/bin/python bench/lesson09_vs_pytorch.py \\
        --nproc 2 --micro-batches 8 --steps 10 --schedule all       # the four in one table
    # smoke size (ctest): --nproc 2 --steps 2 --layers 2 --hidden 32 --seq 16

--schedule gpipe, 1f1b, interleaved or zb-h1 (the C++ program's names), both (gpipe and 1f1b,
the default) or all (the four in turn). PyTorch's side, per schedule:

- gpipe: ScheduleGPipe, one PipelineStage per rank (the same blocks as the C++ stage).
- 1f1b: Schedule1F1B, one PipelineStage per rank.
- interleaved: ScheduleInterleaved1F1B with --virtual-stages v PipelineStage objects per rank;
  rank r's chunk c is virtual stage c p + r of p v (stage_blocks(layers, p v, c p + r): the
  C++ make_chunks' rule, Megatron's round robin, and PyTorch's default stage-to-rank mapping,
  stage i on rank i mod p). The C++ program runs --schedule interleaved --virtual-stages v.
  --layers must be a multiple of p v, and --micro-batches of p (Megatron's and the lesson's
  rule; PyTorch's own is looser). Its order is the C++ program's, op for op (checked for p = 2,
  m = 4 and 8, and p = 4, m = 8, v = 2, with PyTorch 2.15).
- zb-h1: ScheduleInterleavedZeroBubble with ONE PipelineStage per rank. With one local stage
  its order is ZB-H1's, op for op: 1F1B's forwards, I (BACKWARD_INPUT) where 1F1B has B, stage
  s's W (BACKWARD_WEIGHT) of micro-batch j right after its I of j + s, the rest at the end
  (schedules.py, _get_1f1b_rank_ops with enable_zero_bubble: warm-up p - 1 - r forwards,
  num_1f1b_microbatches = rank). Checked against the C++ program's printed order for p = 2,
  m = 8 and p = 4, m = 8 with PyTorch 2.15: identical. It runs on CPU gloo with one stage per
  rank (an older PyTorch whose class refuses one stage per rank fails here, with its error).
  The other zero-bubble class, ScheduleZBVZeroBubble, is ZB-V, not ZB-H1: it raises "ZBV
  requires exactly 2 stages per rank" otherwise and places them in a V (stage i and
  2p - 1 - i on one rank), a different schedule. Where I and W differ: PyTorch's W
  (stage_backward_weight) resumes from the gradients that I left at each weight's node; the
  lesson's W runs autograd again from the output (README section 8), so its W costs more.

Losses: each micro-batch's mean loss unscaled, on the last stage; the schedule's scale_grads
then divides the accumulated gradients by m after the last backward (PipelineStage.scale_grads:
param.grad.div_(m)), where the lesson divides each micro-batch's loss by m before its backward:
the same gradients, up to the order of fp32 operations. AdamW with lesson 02's hyperparameters.

The bubble, for each side, as the C++ program defines it (its "mean" column): one window for
every stage, from a barrier before the schedule's step to a barrier after it (no optimizer
step), the best of --bubble-steps steps (the step whose window, the slowest rank's, is the
shortest); each rank's idle time is the window less its compute, idle / window averaged over
the ranks. The C++ program measures it itself (its sweep, restricted to --micro-batches).
PyTorch's is measured from outside the schedule: its compute is the time inside each stage's
forward_one_chunk, backward_one_chunk and backward_weight_one_chunk and the schedule's
_maybe_compute_loss; everything else in the window (sends, receives, waits, the schedule's own
Python) is idle. "theory" is the papers' (p - 1)/(u + p - 1) with u = m, v m (interleaved) or
3 m (ZB-H1, F = B = W).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from bench_support import last_json, python_worker, torchrun_launcher

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "reference"))

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]

# Which PyTorch class runs each schedule (v PipelineStage objects per rank for interleaved, else
# one: chunks_per_rank).
PYTORCH_CLASS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
}



def stage_blocks(layers: int, stages: int, stage: int):
    """The lesson's rule: layers // stages each, the first layers % stages one more."""
    base, extra = divmod(layers, stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


def chunks_per_rank(schedule: str, virtual_stages: int) -> int:
    """Model chunks (PipelineStage objects) per rank: v for interleaved, else one."""
    return virtual_stages if schedule == "interleaved" else 1


# ------------------------------------------------------------------------------------------
# PyTorch's side (one process per rank, started by torchrun)
# ------------------------------------------------------------------------------------------


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    import lesson02_reference as ref
    from dist_exit import finish_and_exit

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ref.Gpt(256, a.seq, a.hidden, a.layers, a.heads, tied=False)
    ref.init_weights(model, a.seed, a.layers)
    chunks = chunks_per_rank(a.schedule, a.virtual_stages)
    num_stages = world * chunks

    def stage_module(index):
        """Virtual stage `index` of `num_stages`: its blocks, and the embeddings or the head."""
        first, last = stage_blocks(a.layers, num_stages, index)
        return ref.GptStage(model, first, last, embed=index == 0, head=index == num_stages - 1)

    mb = a.batch // a.micro_batches
    stages, modules = [], []
    for c in range(chunks):  # rank r's chunk c is virtual stage c p + r (round robin)
        index = c * world + rank
        module = stage_module(index)
        example = (torch.zeros(mb, a.seq, dtype=torch.long) if index == 0 else
                   torch.zeros(mb, a.seq, a.hidden))
        modules.append(module)
        stages.append(pipelining.PipelineStage(module, index, num_stages, torch.device("cpu"),
                                               input_args=(example,)))

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    kind = getattr(pipelining, PYTORCH_CLASS[a.schedule])
    if a.schedule in ("gpipe", "1f1b"):
        schedule = kind(stages[0], a.micro_batches, loss_fn=loss_fn)
    else:  # the multi-stage runtime: a list of the rank's stages (one for zb-h1)
        schedule = kind(stages, a.micro_batches, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)

    def run_step(x, y, mb_losses):
        if holds_last:
            schedule.step(*((x,) if holds_first else ()), target=y, losses=mb_losses)
        elif holds_first:
            schedule.step(x)
        else:
            schedule.step()

    corpus = (ROOT / "data" / "coriolanus.txt").read_bytes()
    losses, times = [], []
    for step in range(a.steps):
        start = time.perf_counter()
        _, x, y = ref.batch(corpus, a.seed, step, a.batch, a.seq)
        opt.zero_grad(set_to_none=True)
        mb_losses = []
        run_step(x, y, mb_losses)
        opt.step()
        # the loss lives on the last stage: each micro-batch's mean, unscaled
        loss = torch.tensor([sum(float(v) for v in mb_losses) / a.micro_batches
                             if holds_last else 0.0])
        dist.all_reduce(loss)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)

    # The bubble, as the C++ program's sweep measures it: barrier, the schedule's step (no
    # optimizer), barrier; compute is the time inside the stages' compute calls.
    bubble = None
    if a.bubble_steps > 0:
        compute = [0.0]

        def timed(fn):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    compute[0] += time.perf_counter() - t0
            return call

        for s in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(s, name, timed(getattr(s, name)))
        schedule._maybe_compute_loss = timed(schedule._maybe_compute_loss)
        _, x, y = ref.batch(corpus, a.seed, 0, a.batch, a.seq)
        windows, computes = [], []
        for _ in range(a.bubble_steps):
            opt.zero_grad(set_to_none=True)
            compute[0] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            run_step(x, y, [])
            dist.barrier()
            windows.append(time.perf_counter() - t0)
            computes.append(compute[0])
        common = torch.tensor(windows, dtype=torch.float64)
        dist.all_reduce(common, op=dist.ReduceOp.MAX)  # each step's window, the slowest rank's
        best = int(torch.argmin(common))
        window = float(common[best])
        per_rank = torch.zeros(world, dtype=torch.float64)
        per_rank[rank] = max(0.0, window - computes[best]) / window if window > 0 else 0.0
        dist.all_reduce(per_rank)
        bubble = per_rank.tolist()
    if rank == 0:
        print(json.dumps({"losses": losses, "step_s": times, "bubble": bubble,
                          "class": type(schedule).__name__, "stages_per_rank": len(stages),
                          "torch": torch.__version__}), flush=True)
    finish_and_exit()  # tests/reference/dist_exit.py: why not a plain return


# ------------------------------------------------------------------------------------------
# The driver: both runs, one after the other, then the comparison
# ------------------------------------------------------------------------------------------



def torchrun(a, cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = torchrun_launcher(a.torchrun, a.nproc)
    run = subprocess.run(launcher + cmd, capture_output=True, text=True, env=env,
                         timeout=a.timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({run.returncode}):\n"
                           f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return last_json(run.stdout)


def check_options(a, schedules):
    """What the C++ program would refuse, said before anything starts, naming the flag: the
    message, or None."""
    if a.batch % a.micro_batches != 0:
        return f"--micro-batches {a.micro_batches} does not divide --batch {a.batch}"
    if "interleaved" in schedules:
        v, p = a.virtual_stages, a.nproc
        if v < 2:
            return (f"--virtual-stages {v}: the interleaved schedule needs 2 or more "
                    "model chunks per rank (with one, use --schedule 1f1b)")
        if a.layers % (p * v) != 0:
            return (f"--layers {a.layers} is not a multiple of {p * v} (--nproc {p} x "
                    f"--virtual-stages {v}): the interleaved schedule cuts the model into "
                    f"{p * v} chunks of equal size; pass --layers {p * v} or another multiple, "
                    "or fewer --virtual-stages")
        if a.micro_batches % p != 0:
            return (f"--micro-batches {a.micro_batches} is not a multiple of --nproc {p}: "
                    "the interleaved schedule sends micro-batches through each chunk in groups "
                    "of p")
    return None


def theory(schedule: str, p: int, m: int, v: int) -> float:
    """The papers' bubble, idle / window: (p - 1)/(u + p - 1), u = m, v m or 3 m."""
    u = {"interleaved": v * m, "zb-h1": 3 * m}.get(schedule, m)
    return (p - 1) / (u + p - 1)


def cpp_bubble(cpp: dict, schedule: str, m: int, v: int):
    """The C++ program's measured mean bubble for (schedule, m) from its sweep, or None."""
    for row in cpp.get("bubble") or []:
        if (row["schedule"] == schedule and row["micro_batches"] == m and
                (schedule != "interleaved" or row["virtual_stages"] == v)):
            return row["mean"]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default=str(ROOT / "build" / "bin" / "lesson09_solution"))
    ap.add_argument("--torchrun", default=str(pathlib.Path(sys.executable).parent / "torchrun"))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--schedule", choices=SCHEDULES + ["both", "all"], default="both",
                    help="one schedule, both (gpipe and 1f1b) or all four (default: both)")
    ap.add_argument("--virtual-stages", type=int, default=2,
                    help="v, model chunks per rank for --schedule interleaved (default 2)")
    ap.add_argument("--bubble-steps", type=int, default=3,
                    help="steps for each side's bubble measurement, the best kept (C++: "
                         "--sweep-steps); 0 skips it")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--json", action="store_true",
                    help="also print one JSON object with every row on the last line")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0

    schedules = {"both": ["gpipe", "1f1b"], "all": SCHEDULES}.get(a.schedule, [a.schedule])
    problem = check_options(a, schedules)
    if problem:
        ap.error(problem)
    shape = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
             "--seq", str(a.seq), "--seed", str(a.seed)]
    model = shape + ["--global-batch", str(a.batch), "--steps", str(a.steps),
                     "--micro-batches", str(a.micro_batches)]
    # The C++ program's bubble comes from its own sweep, restricted to this run's m.
    sweep = (["--sweep", str(a.micro_batches), "--sweep-steps", str(a.bubble_steps)]
             if a.bubble_steps > 0 else ["--no-sweep"])
    print(f"lesson 09 vs torch.distributed.pipelining: {a.nproc} stages, {a.micro_batches} "
          f"micro-batches of {a.batch // a.micro_batches}, GPT L={a.layers} h={a.hidden} "
          f"seq={a.seq}, {a.steps} steps, gloo on CPU, 1 thread per rank")
    print(f"{'schedule':<11} {'C++ ms/step':>12} {'PyTorch ms/step':>16} {'ratio C++/PT':>13} "
          f"{'max |loss diff|':>16} {'bubble C++':>11} {'bubble PT':>10} {'theory':>7}")
    worst = 0.0
    rows, notes = [], []
    for schedule in schedules:
        v = chunks_per_rank(schedule, a.virtual_stages)
        extra = ["--virtual-stages", str(v)] if schedule == "interleaved" else []
        cpp = torchrun(a, ["--no_python", a.binary, *model, "--schedule", schedule, *extra,
                           "--json", *sweep])
        py = torchrun(a, python_worker(pathlib.Path(__file__).resolve(), "--worker", *shape,
                                    "--batch", a.batch, "--steps", a.steps,
                                    "--micro-batches", a.micro_batches, "--schedule", schedule,
                                    "--virtual-stages", a.virtual_stages,
                                    "--bubble-steps", a.bubble_steps))
        # the median over steps after the first (which warms up)
        c = statistics.median(cpp["step_s"][1:] or cpp["step_s"]) * 1e3
        p = statistics.median(py["step_s"][1:] or py["step_s"]) * 1e3
        diff = max(abs(x - y) for x, y in zip(cpp["losses"], py["losses"]))
        worst = max(worst, diff)
        bc = cpp_bubble(cpp, schedule, a.micro_batches, v) if a.bubble_steps > 0 else None
        bp = statistics.mean(py["bubble"]) if py.get("bubble") else None
        th = theory(schedule, a.nproc, a.micro_batches, v)
        print(f"{schedule:<11} {c:>12.2f} {p:>16.2f} {c / p:>13.2f} {diff:>16.2e} "
              f"{'-' if bc is None else f'{bc:.3f}':>11} {'-' if bp is None else f'{bp:.3f}':>10}"
              f" {th:>7.3f}", flush=True)
        notes.append(f"  {schedule}: C++ --schedule {schedule}{''.join(' ' + e for e in extra)}; "
                     f"PyTorch {py['class']}, {py['stages_per_rank']} PipelineStage per rank"
                     + (" (one local stage: ZB-H1's order)" if schedule == "zb-h1" else ""))
        rows.append({"schedule": schedule, "virtual_stages": v, "cpp_ms_per_step": c,
                     "pytorch_ms_per_step": p, "ratio": c / p, "max_loss_diff": diff,
                     "bubble_cpp": bc, "bubble_pytorch": bp, "bubble_theory": th,
                     "bubble_pytorch_per_rank": py.get("bubble"),
                     "pytorch_class": py["class"],
                     "pytorch_stages_per_rank": py["stages_per_rank"],
                     "cpp_losses": cpp["losses"], "pytorch_losses": py["losses"],
                     "torch": py["torch"], "libtorch": cpp.get("torch")})
    print("\n".join(["per schedule:"] + notes))
    if a.bubble_steps > 0:
        print("bubble: idle / window, mean over the ranks, the best of "
              f"{a.bubble_steps} steps (C++: its own sweep; PyTorch: idle = window less the "
              "time in the stages' forward/backward/weight calls and the loss)")
    if a.json:
        print(json.dumps({"stages": a.nproc, "micro_batches": a.micro_batches,
                          "batch": a.batch, "layers": a.layers, "hidden": a.hidden,
                          "heads": a.heads, "seq": a.seq, "steps": a.steps, "rows": rows}))
    # The same maths: losses agree to fp32 over a few steps (dtc::kFp32VsPyTorch, rtol 1e-4).
    if worst > 1e-3:
        print(f"LOSSES DIFFER: {worst:.3e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Lesson 09's pipeline against PyTorch's torch.distributed.pipelining, on CPU gloo.

Runs both in one go on the same model split, the same initial weights (the course's
deterministic init) and the same batches, with the same world size, micro-batches and
schedule, one thread per rank; prints the median step time of each and their ratio, and the
largest difference between their losses.

    ~/.cache/dtc-course/venv/bin/python bench/lesson09_vs_pytorch.py \\
        --binary build/bin/lesson09_solution --nproc 4 --micro-batches 4 --steps 20
    # smoke size (ctest): --nproc 2 --steps 2 --layers 2 --hidden 32 --seq 16

PyTorch's side: PipelineStage (one per rank, the same blocks as the C++ stage) driven by
ScheduleGPipe or Schedule1F1B with the loss on the last stage, each micro-batch's mean loss
unscaled; the schedule's scale_grads then divides the accumulated gradients by m after the last
backward (PipelineStage.scale_grads: param.grad.div_(m)), where the lesson divides each
micro-batch's loss by m before its backward: the same gradients, up to the order of fp32
operations. AdamW with lesson 02's hyperparameters.
"""
import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "reference"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_blocks(layers: int, stages: int, stage: int):
    """The lesson's rule: layers // stages each, the first layers % stages one more."""
    base, extra = divmod(layers, stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


# ------------------------------------------------------------------------------------------
# PyTorch's side (one process per rank, started by torchrun)
# ------------------------------------------------------------------------------------------


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import lesson02_reference as ref
    from dist_exit import finish_and_exit

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ref.Gpt(256, a.seq, a.hidden, a.layers, a.heads, tied=False)
    ref.init_weights(model, a.seed, a.layers)
    first, last = stage_blocks(a.layers, world, rank)

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = rank == 0
            self.head = rank == world - 1
            if self.embed:
                self.wte, self.wpe = model.wte, model.wpe
            self.blocks = torch.nn.ModuleList(model.h[i] for i in range(first, last))
            if self.head:
                self.ln_f, self.lm_head = model.ln_f, model.lm_head

        def forward(self, x):
            if self.embed:
                x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
            for b in self.blocks:
                x = b(x)
            if self.head:
                x = self.lm_head(self.ln_f(x))
            return x

    module = Stage()
    mb = a.batch // a.micro_batches
    example = (torch.zeros(mb, a.seq, dtype=torch.long) if rank == 0 else
               torch.zeros(mb, a.seq, a.hidden))
    stage = PipelineStage(module, rank, world, torch.device("cpu"), input_args=(example,))

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    kind = ScheduleGPipe if a.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, a.micro_batches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    corpus = (ROOT / "data" / "coriolanus.txt").read_bytes()
    losses, times = [], []
    for step in range(a.steps):
        start = time.perf_counter()
        _, x, y = ref.batch(corpus, a.seed, step, a.batch, a.seq)
        opt.zero_grad(set_to_none=True)
        mb_losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=mb_losses)
        else:
            schedule.step()
        opt.step()
        # the loss lives on the last stage: each micro-batch's mean, unscaled
        loss = torch.tensor([sum(float(v) for v in mb_losses) / a.micro_batches
                             if rank == world - 1 else 0.0])
        dist.all_reduce(loss)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({"losses": losses, "step_s": times}), flush=True)
    finish_and_exit()  # tests/reference/dist_exit.py: why not a plain return


# ------------------------------------------------------------------------------------------
# The driver: both runs, one after the other, then the comparison
# ------------------------------------------------------------------------------------------


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON line in the output:\n" + text[-3000:])


def torchrun(a, cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = [a.torchrun, "--nnodes=1", f"--nproc_per_node={a.nproc}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{free_port()}"]
    run = subprocess.run(launcher + cmd, capture_output=True, text=True, env=env,
                         timeout=a.timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({run.returncode}):\n"
                           f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return last_json(run.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default=str(ROOT / "build" / "bin" / "lesson09_solution"))
    ap.add_argument("--torchrun", default=str(pathlib.Path(sys.executable).parent / "torchrun"))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "both"], default="both")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0

    shape = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
             "--seq", str(a.seq), "--seed", str(a.seed)]
    model = shape + ["--global-batch", str(a.batch), "--steps", str(a.steps),
                     "--micro-batches", str(a.micro_batches)]
    print(f"lesson 09 vs torch.distributed.pipelining: {a.nproc} stages, {a.micro_batches} "
          f"micro-batches of {a.batch // a.micro_batches}, GPT L={a.layers} h={a.hidden} "
          f"seq={a.seq}, {a.steps} steps, gloo on CPU, 1 thread per rank")
    print(f"{'schedule':<8} {'C++ ms/step':>12} {'PyTorch ms/step':>16} {'ratio C++/PT':>13} "
          f"{'max |loss diff|':>16}")
    worst = 0.0
    for schedule in (["gpipe", "1f1b"] if a.schedule == "both" else [a.schedule]):
        cpp = torchrun(a, ["--no_python", a.binary, *model, "--schedule", schedule, "--json",
                           "--no-sweep"])
        py = torchrun(a, [str(pathlib.Path(__file__).resolve()), "--worker", *shape,
                          "--batch", str(a.batch), "--steps", str(a.steps),
                          "--micro-batches", str(a.micro_batches), "--schedule", schedule])
        # the median over steps after the first (which warms up)
        c = statistics.median(cpp["step_s"][1:] or cpp["step_s"]) * 1e3
        p = statistics.median(py["step_s"][1:] or py["step_s"]) * 1e3
        diff = max(abs(x - y) for x, y in zip(cpp["losses"], py["losses"]))
        worst = max(worst, diff)
        print(f"{schedule:<8} {c:>12.2f} {p:>16.2f} {c / p:>13.2f} {diff:>16.2e}", flush=True)
    # The same maths: losses agree to fp32 over a few steps (dtc::kFp32VsPyTorch, rtol 1e-4).
    if worst > 1e-3:
        print(f"LOSSES DIFFER: {worst:.3e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

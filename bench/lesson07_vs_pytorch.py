#!/usr/bin/env python3
"""Lesson 07 benchmark: this lesson's ZeRO stages against PyTorch's own, in one go.

    ~/.cache/dtc-course/venv/bin/python bench/lesson07_vs_pytorch.py \
        --program build/bin/lesson07_solution --torchrun ~/.cache/dtc-course/venv/bin/torchrun
    ... --smoke              # tiny sizes, 3 steps: what ctest runs (lesson07.solution.bench_smoke)

Same model (tests/reference/lesson02_reference.py: the course's GPT, same init), same batches,
same world size (--nproc, default 2), gloo on the CPU, 1 thread per rank (OMP_NUM_THREADS=1):
    stage 0  lesson07 --stage 0   vs  DistributedDataParallel + torch.optim.AdamW
    stage 1  lesson07 --stage 1   vs  DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    stage 3  lesson07 --stage 3   vs  FSDP2: fully_shard on every block, then on the model
    3 nr     lesson07 --stage 3 --no-reshard-after-forward
                                  vs  FSDP2 with reshard_after_forward=False (FSDP1 SHARD_GRAD_OP)
(stage 2 has no separate PyTorch counterpart on CPU; ours is printed on its own line). Bytes
sent per step: ours as counted (ring count of the calls made); PyTorch's by the same count of
the collectives it makes, from their sizes (DDP's allreduce 2 Psi; ZeroRedundancyOptimizer adds
a broadcast of every updated partition, Psi: 3 Psi against our stage 1's 2 Psi; FSDP2 3 Psi less
the second gather of its root, which it does not reshard,
or 2 Psi without resharding), so the time ratios of stage 1 compare unequal traffic. For each:
the median over --repeats runs of the mean step time (with its range), and per-rank bytes of parameters + gradients + AdamW state held
by the tensors (PyTorch: counted from the tensors each rank holds, DTensor local shards; ours:
measured by the counting allocator), and their ratios ours / PyTorch. PyTorch's runs are this
script again, under torchrun, with --worker.
"""
import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

from bench_support import python_worker, torchrun_launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]



def torchrun(args, nproc, argv):
    cmd = [*torchrun_launcher(args.torchrun, nproc), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if p.returncode != 0:
        return None, (p.stdout + p.stderr)[-3000:]
    for line in reversed(p.stdout.splitlines()):
        if line.strip().startswith("{"):
            return json.loads(line), ""
    return None, p.stdout[-3000:]


# ------------------------------------------------------------------------------------------
# PyTorch's side (runs under torchrun)
# ------------------------------------------------------------------------------------------


def tensor_bytes(t) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def worker(a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "tests" / "reference"))
    import lesson02_reference as ref
    from dist_exit import finish_and_exit

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ref.Gpt(256, a.seq, a.hidden, a.layers, a.heads, True)
    ref.init_weights(model, a.seed, a.layers)
    hp = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if a.worker == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **hp)
    elif a.worker == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      foreach=False, **hp)
    else:  # fsdp2, fsdp2-noreshard
        from torch.distributed.fsdp import fully_shard
        reshard = a.worker == "fsdp2"
        for block in model.h:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        net = model
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **hp)
    corpus = (ROOT / "data" / "coriolanus.txt").read_bytes()
    rows = a.global_batch // world
    losses, times, grad_bytes = [], [], 0
    for step in range(a.steps):
        _, x, y = ref.batch(corpus, a.seed, step, a.global_batch, a.seq)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = net(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        if step == 0:
            grad_bytes = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        opt.step()
        times.append(time.perf_counter() - t0)
        l = loss.detach().clone()
        dist.all_reduce(l)
        losses.append(l.item() / world)
    param_bytes = sum(tensor_bytes(p) for p in model.parameters())
    state = opt.optim.state if a.worker == "zero1" else opt.state
    opt_bytes = sum(tensor_bytes(v) for s in state.values() for k, v in s.items()
                    if k != "step" and torch.is_tensor(v))
    if rank == 0:
        print(json.dumps({"losses": losses, "step_s": sum(times) / len(times),
                          "bytes": {"params": param_bytes, "grads": grad_bytes,
                                    "optimizer": opt_bytes}}), flush=True)
    finish_and_exit()  # tests/reference/dist_exit.py: why not a plain return


# ------------------------------------------------------------------------------------------
# The comparison
# ------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--program", default=str(ROOT / "build/bin/lesson07_solution"))
    ap.add_argument("--torchrun", default=os.path.expanduser("~/.cache/dtc-course/venv/bin/torchrun"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each side; times are the median of the runs' mean step times, "
                         "with their range")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 3 steps (ctest)")
    ap.add_argument("--worker", choices=["ddp", "zero1", "fsdp2", "fsdp2-noreshard"],
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.smoke:
        a.steps, a.layers, a.hidden, a.seq, a.global_batch, a.repeats = 3, 2, 64, 32, 4, 1
    if a.worker:
        return worker(a)

    sizes = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
             "--seq", str(a.seq), "--global-batch", str(a.global_batch), "--seed", str(a.seed),
             "--steps", str(a.steps)]
    print(f"lesson07 vs PyTorch: GPT {a.layers} layers, hidden {a.hidden}, seq {a.seq}, global "
          f"batch {a.global_batch}, {a.steps} steps, {a.nproc} ranks, gloo, 1 thread per rank")
    rows = []
    # (label, our flags, PyTorch worker, its name, PyTorch's bytes per step in Psi units)
    pairs = [("0", ["--stage", "0"], "ddp", "DDP + AdamW", 2),
             ("1", ["--stage", "1"], "zero1", "DDP + ZeroRedundancyOptimizer", 3),
             ("2", ["--stage", "2"], None, "-", None),
             ("3", ["--stage", "3"], "fsdp2", "FSDP2 fully_shard", 3),
             ("3 nr", ["--stage", "3", "--no-reshard-after-forward"], "fsdp2-noreshard",
              "FSDP2 reshard_after_forward=F", 2)]
    if a.smoke:  # two pairs, to keep ctest's smoke run short
        pairs = [pairs[1], pairs[3]]
    ok = True
    def median_and_range(times):
        times = sorted(times)
        return times[len(times) // 2], times[0], times[-1]

    for stage, flags, mode, name, their_psi in pairs:
        our_times, ours = [], None
        for _ in range(a.repeats):
            ours, err = torchrun(a, a.nproc, ["--no_python", a.program, *flags, "--json", *sizes])
            if ours is None:
                break
            our_times.append(ours["stages"][0]["step_s"])
        if ours is None:
            print(f"stage {stage}: lesson07 failed:\n{err}")
            ok = False
            continue
        s = ours["stages"][0]
        s["step_s"] = median_and_range(our_times)
        m = s["memory"]["measured"]
        our_bytes = m["params"] + m["grads"] + m["optimizer"]
        theirs, terr, their_times = (None, "", [])
        for _ in range(a.repeats if mode else 0):
            theirs, terr = torchrun(a, a.nproc, python_worker(__file__, "--worker", mode, *sizes))
            if theirs is None:
                break
            their_times.append(theirs["step_s"])
        if theirs is not None:
            theirs["step_s"] = median_and_range(their_times)
        psi = s["psi"]
        their_sent = their_psi and their_psi * (a.nproc - 1) / a.nproc * 4 * psi
        if mode == "fsdp2":  # FSDP2 keeps its root (the outer unit) gathered after forward too
            their_sent -= (a.nproc - 1) / a.nproc * 4 * s["outer_padded"]
        if theirs is None:
            rows.append((stage, name, s["step_s"], None, our_bytes, None, s["comm"]["bytes_per_step"],
                         None, their_sent))
            if mode:
                print(f"stage {stage}: PyTorch's {name} did not run: {terr.strip().splitlines()[-1:]}")
            continue
        tb = theirs["bytes"]
        their_bytes = tb["params"] + tb["grads"] + tb["optimizer"]
        dl = max(abs(x - y) for x, y in zip(s["losses"], theirs["losses"]))
        rows.append((stage, name, s["step_s"], theirs["step_s"], our_bytes, their_bytes,
                     s["comm"]["bytes_per_step"], dl, their_sent))
    print(f"\n{'stage':<6} {'PyTorch counterpart':<31} {'ours ms':>17} {'torch ms':>17} "
          f"{'ratio':>6} {'ours MiB':>9} {'torch MiB':>10} {'ratio':>6} {'sent MiB':>9} "
          f"{'torch sent':>10} {'max |dloss|':>12}")
    ms = lambda t: f"{1000 * t[0]:.1f} ({1000 * t[1]:.0f}-{1000 * t[2]:.0f})" if t else "-"
    for stage, name, ot, tt, ob, tb, sent, dl, tsent in rows:
        f = lambda v, fmt: (fmt.format(v) if v is not None else "-")
        print(f"{stage:<6} {name:<31} {ms(ot):>17} {ms(tt):>17} "
              f"{f(tt and ot[0] / tt[0], '{:>6.2f}'):>6} {ob / 2**20:>9.3f} "
              f"{f(tb and tb / 2**20, '{:>10.3f}'):>10} {f(tb and ob / tb, '{:>6.2f}'):>6} "
              f"{sent / 2**20:>9.3f} {f(tsent and tsent / 2**20, '{:>10.3f}'):>10} "
              f"{f(dl, '{:>12.2e}'):>12}")
    print(f"\nms = the median of {a.repeats} runs' mean step times (their range). "
          "ratio = ours / PyTorch (time: < 1 is faster; bytes: params + grads + AdamW state per "
          "rank, 1.00 is the same memory). sent = bytes one rank sends per step (ring count): "
          "ours counted, PyTorch's from the collectives it makes (2 or 3 Psi); stage 1's times "
          "compare 2 Psi with ZeroRedundancyOptimizer's 3 Psi.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""PyTorch's own DistributedDataParallel on the course's GPT: the other side of lesson 06's
benchmark (bench/lesson06_vs_pytorch.py starts it; run it alone the same way):

    OMP_NUM_THREADS=1 ~/.cache/dtc-course/venv/bin/torchrun --standalone --nproc_per_node=2 \
        bench/lesson06_pytorch_ddp.py --steps 30

The model, its initial weights and the batches are lesson 02's (tests/reference/
lesson02_reference.py), each rank takes rows [rank*B/W, (rank+1)*B/W) of the global batch,
gloo on the CPU, AdamW as lesson 02. Rank 0 prints one JSON line: losses, step_time_s (median
after 2 warm-up steps), tokens_per_s.
"""
import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reference"))
import lesson02_reference as ref  # noqa: E402
from dist_exit import finish_and_exit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-kb", type=float, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = (ROOT / "data" / "coriolanus.txt").read_bytes()
    model = ref.Gpt(256, a.seq, a.hidden, a.layers, a.heads, True)
    ref.init_weights(model, a.seed, a.layers)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_kb / 1024.0)
    opt = torch.optim.AdamW(ddp.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    rows = a.global_batch // world
    losses, times = [], []
    start = time.perf_counter()
    for step in range(a.steps):
        offs = [ref.offset(a.seed, step, r, a.seq, len(corpus))
                for r in range(rank * rows, (rank + 1) * rows)]
        x = torch.tensor([list(corpus[o:o + a.seq]) for o in offs], dtype=torch.long)
        y = torch.tensor([list(corpus[o + 1:o + a.seq + 1]) for o in offs], dtype=torch.long)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = ddp(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the global mean loss, as lesson06 reports it
        times.append(time.perf_counter() - t0)
        losses.append(total.item() / world)
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"losses": losses, "step_time_s": statistics.median(times[2:] or times),
                          "tokens_per_s": a.steps * a.global_batch * a.seq / elapsed,
                          "world_size": world, "torch": torch.__version__}))
    finish_and_exit()  # tests/reference/dist_exit.py: why not a plain return


if __name__ == "__main__":
    main()

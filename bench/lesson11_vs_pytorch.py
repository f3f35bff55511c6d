#!/usr/bin/env python3
"""Lesson 11's N-D composition against PyTorch's own, on CPU gloo, in one run.

    ~/.cache/dtc-course/venv/bin/python bench/lesson11_vs_pytorch.py \\
        --binary build/bin/lesson11_solution                       # 8 ranks, dp 2 x tp 2 x pp 2
    ... --nproc 4 --mix 1x2x2 --steps 20                           # another mesh
    ... --smoke                                                    # what ctest runs

Both sides train the course's GPT, untied, from the same initial weights (the course's
deterministic init), on the same batches, with AdamW at lesson 02's hyperparameters (lr 3e-3,
betas 0.9/0.999, eps 1e-8, weight decay 0.01 on every parameter), on the same mesh of
--nproc ranks, dp x tp x pp (--mix, default 2x2x2), one thread per rank (OMP_NUM_THREADS=1),
both under the venv's torchrun:

- ours: build/bin/lesson11_solution --mix DPxTPxPPx1:3:none:MICRO --untied --json: ZeRO-3 over
  dp (each rank keeps its shard of every parameter, gradient and AdamW moment; the whole
  parameters gathered at the start of a step and kept for all its micro-batches), lesson 08's
  tensor-parallel blocks over tp (the embeddings, LayerNorms, row-parallel biases, ln_f and the
  head held whole by every tp rank), lesson 09's 1F1B over pp.
- PyTorch, as torchtitan composes them on one DeviceMesh (init_device_mesh("cpu", (pp, dp, tp),
  mesh_dim_names=("pp", "dp", "tp"))): DTensor TP on the "tp" submesh (parallelize_module with
  ColwiseParallel on c_attn and c_fc, RowwiseParallel on both c_proj, the rest left whole as
  ours; c_attn's rows reordered Megatron-style to [q_r; k_r; v_r] per rank before
  ColwiseParallel shards them, as bench/lesson08_vs_pytorch.py does), FSDP2 on the "dp"
  submesh (fully_shard on every block of the stage, then on the stage's root module;
  reshard_after_forward=False when pp > 1, torchtitan's default under a pipeline, True with
  pp 1, its default then, where ours still keeps the whole parameters for the step), and
  torch.distributed.pipelining over "pp" (one PipelineStage per rank on the "pp" group,
  Schedule1F1B). The model is tests/reference/lesson02_reference.py's; each rank keeps the
  blocks of its stage by the lesson's rule (stage_blocks: layers // pp each, the first
  layers % pp one more), the embeddings on the first stage, ln_f and lm_head on the last.
  With pp 1 there is no pipeline: the replica's micro-batches in turn, their gradients
  accumulated, FSDP2's reduce-scatter after the last only (set_requires_gradient_sync), as
  ours; a degree of 1 leaves its part out on both sides.

Both map rank = tp_rank + tp (dp_rank + dp pp_rank) (pp slowest, tp fastest); dp replica d
takes rows [d b / dp, (d + 1) b / dp) of each global batch, cut into the same micro-batches
(--micro-batches per replica, default one sequence each, ours' default). The losses: each
micro-batch's mean cross-entropy; ours divides each micro-batch's loss by m before its backward,
PyTorch's schedule divides the accumulated gradients by m after the last (scale_grads), and
both average over dp (ours: the reduce-scatter's divisor; FSDP2: its gradient divide factor);
the step's loss is the mean over the micro-batches and the replicas. Same maths, so the curves
must agree to fp32 rounding: the largest relative difference over the first 8 steps must stay
within 1e-4 (the course's rtol against PyTorch), later steps are reported, not judged. The
tied model is not compared: PyTorch's pipelining cannot share one weight between two stages
(torchtitan does not support tied weights with pipelining), so both sides run --untied.

What the table holds:
- ms/step: the median over steps 2..N (the first warms up) of each step's time on its slowest
  rank. A step is the whole of it on both sides: the batch, the parameters' gathers, the
  schedule, the gradients' reduction, the optimizer and the loss's allreduce. Ours' --json
  reports only tokens_per_s (a mean over every step, the first included), so ours runs with
  --trace DIR and its per-step times are read from each rank's "step N" spans (rank<r>.json).
  What --trace costs is below this machine's noise at the default size (three runs each way
  on the 2-core machine: 177-196 ms/step without, 178-194 with; bench/trace_overhead.py
  measures it for lessons 02, 06 and 09). PyTorch's: time.perf_counter around the step on every
  rank. The ratio is PyTorch / ours: above 1, ours is faster.
- state bytes, rank 0 (the first stage, dp 0, tp 0 on both sides): parameters + gradients +
  AdamW's two moments after the last step, counted from the tensors the rank holds (ours: its
  own count, the JSON's memory.measured; PyTorch: the DTensors' local shards, the optimizer's
  "step" counters left out). FSDP2 cuts each parameter's dim 0 into dp pieces, ours each
  flattened parameter (padded to a multiple of dp); rank 0 holds the larger piece on both,
  and at the sizes tried the two counts are equal to the byte.
- peak RSS: each process's ru_maxrss, the largest over the ranks (ours: each rank's LibTorch
  process, measured by a thin wrapper that this script puts between torchrun and the binary;
  PyTorch: the worker's own, its interpreter and the torch import included). At these sizes
  it is the runtimes' footprint, not the training state's.

If PyTorch's full composition fails on CPU (a collective gloo lacks, a DTensor rule a kernel
misses), the script prints which and its first error line, then falls back, in order, to TP +
PP with the dp replicas' gradients averaged by an allreduce (DDP's maths, no sharding), to
FSDP + PP with every tp rank computing the whole blocks, and to PP alone; the table names the
composition that ran. The losses are still compared (the same maths), the memory and the time
then are not like with like. With PyTorch 2.15 the full composition runs on CPU gloo.
"""
import argparse
import json
import os
import pathlib
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from bench_support import last_json, python_worker, torchrun_launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]
THIS = str(pathlib.Path(__file__).resolve())
# PyTorch's compositions, the full one first, then the fallbacks in order.
PARTS = ["fsdp+tp+pp", "tp+pp", "fsdp+pp", "pp"]
RTOL, JUDGED = 1e-4, 8  # the losses' tolerance, over the first JUDGED steps



def stage_blocks(layers: int, stages: int, stage: int):
    """The lesson's rule: layers // stages each, the first layers % stages one more."""
    base, extra = divmod(layers, stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


def local_bytes(t) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


# ------------------------------------------------------------------------------------------
# PyTorch's side (one process per rank, started by torchrun)
# ------------------------------------------------------------------------------------------


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT / "tests" / "reference"))
    import lesson02_reference as ref
    from dist_exit import finish_and_exit

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, tp, pp = a.dp, a.tp, a.pp
    parts = set(a.parts.split("+"))
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = (mesh[d].get_local_rank() for d in ("pp", "dp", "tp"))
    use_tp, use_fsdp = "tp" in parts and tp > 1, "fsdp" in parts and dp > 1
    applied = "+".join(p for p, on in (("fsdp", use_fsdp), ("tp", use_tp), ("pp", pp > 1))
                       if on) or "none"  # what this mesh leaves of them (a degree 1: none)
    h, heads = a.hidden, a.heads

    model = ref.Gpt(256, a.seq, h, a.layers, heads, tied=False)
    ref.init_weights(model, a.seed, a.layers)
    first, last = stage_blocks(a.layers, pp, pp_rank)
    if use_tp:
        # Megatron's head split: c_attn's rows reordered so that ColwiseParallel's Shard(0)
        # gives tp rank r its own heads, and the reference's attention on the local heads.
        ref.prepare_tp_heads(model.h[first:last], h, heads, tp)
    stage = ref.GptStage(model, first, last, embed=pp_rank == 0, head=pp_rank == pp - 1)
    del model  # the other stages' parts
    if use_tp:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        plan = {}
        for j in range(len(stage.blocks)):
            plan[f"blocks.{j}.attn.c_attn"] = ColwiseParallel()
            plan[f"blocks.{j}.attn.c_proj"] = RowwiseParallel()
            plan[f"blocks.{j}.mlp.c_fc"] = ColwiseParallel()
            plan[f"blocks.{j}.mlp.c_proj"] = RowwiseParallel()
        parallelize_module(stage, mesh["tp"], plan)
    if use_fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in stage.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=pp == 1)
        fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=pp == 1)

    rows = a.batch // dp
    m = a.micro_batches

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    schedule = None
    if pp > 1:
        from torch.distributed import pipelining
        example = (torch.zeros(rows // m, a.seq, dtype=torch.long) if stage.embed else
                   torch.zeros(rows // m, a.seq, h))
        pstage = pipelining.PipelineStage(stage, pp_rank, pp, torch.device("cpu"),
                                          input_args=(example,), group=mesh["pp"].get_group())
        schedule = pipelining.Schedule1F1B(pstage, m, loss_fn=loss_fn)
    params = list(stage.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            foreach=False)
    dp_group = mesh["dp"].get_group()
    corpus = (ROOT / "data" / "coriolanus.txt").read_bytes()
    losses, times = [], []
    for step in range(a.steps):
        start = time.perf_counter()
        _, x, y = ref.batch(corpus, a.seed, step, a.batch, a.seq)
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        opt.zero_grad(set_to_none=True)
        value = 0.0
        if schedule is None:  # pp 1: the micro-batches in turn, their gradients accumulated
            for i, (xc, yc) in enumerate(zip(x.chunk(m), y.chunk(m))):
                if use_fsdp:  # one reduce-scatter, after the last, as ours
                    stage.set_requires_gradient_sync(i == m - 1)
                loss = loss_fn(stage(xc), yc)
                (loss / m).backward()
                value += loss.item() / m
        elif stage.head:
            mb_losses = []
            schedule.step(target=y, losses=mb_losses)
            value = sum(float(v) for v in mb_losses) / m
        elif stage.embed:
            schedule.step(x)
        else:
            schedule.step()
        if dp > 1 and not use_fsdp:  # the fallbacks without FSDP: the replicas' mean, DDP's maths
            for p in params:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=dp_group)
                g.div_(dp)
        opt.step()
        # the last stage's loss (every tp rank holds the same: tp rank 0's), the replicas' mean
        total = torch.tensor([value if stage.head and tp_rank == 0 else 0.0])
        dist.all_reduce(total)
        losses.append(total.item() / dp)
        times.append(time.perf_counter() - start)

    # Rank r's state after the last step, counted from the tensors it holds (DTensor: its local
    # shard), and its peak RSS; every rank's, gathered.
    state = torch.zeros(world, 4, dtype=torch.float64)
    state[rank, 0] = sum(local_bytes(p) for p in params)
    state[rank, 1] = sum(local_bytes(p.grad) for p in params if p.grad is not None)
    state[rank, 2] = sum(local_bytes(v) for s in opt.state.values() for k, v in s.items()
                         if k != "step" and torch.is_tensor(v))
    state[rank, 3] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    dist.all_reduce(state)
    step_s = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # each step's slowest rank
    if rank == 0:
        print(json.dumps({"losses": losses, "step_s": step_s.tolist(),
                          "bytes": [{"params": int(r[0]), "grads": int(r[1]),
                                     "optimizer": int(r[2])} for r in state.tolist()],
                          "rss": [int(r[3]) for r in state.tolist()], "parts": a.parts,
                          "applied": applied,
                          "schedule": type(schedule).__name__ if schedule else None,
                          "torch": torch.__version__}), flush=True)
    finish_and_exit()  # tests/reference/dist_exit.py: why not a plain return


# ------------------------------------------------------------------------------------------
# Between torchrun and our binary: run it, then write its peak RSS (ours has no such key)
# ------------------------------------------------------------------------------------------


def rss_wrap(out_dir: str, cmd: list) -> int:
    code = subprocess.call(cmd)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    pathlib.Path(out_dir, f"rank{os.environ.get('RANK', '0')}").write_text(str(rss))
    return code if code >= 0 else 128 - code


# ------------------------------------------------------------------------------------------
# The driver: both runs, one after the other, then the comparison
# ------------------------------------------------------------------------------------------



def torchrun(a, cmd):
    """(the last JSON line, seconds) of cmd on --nproc ranks; RuntimeError with the output."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = torchrun_launcher(a.torchrun, a.nproc)
    start = time.perf_counter()
    run = subprocess.run(launcher + cmd, capture_output=True, text=True, env=env,
                         timeout=a.timeout)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise RuntimeError(f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}")
    return last_json(run.stdout), wall


def first_error(text: str) -> str:
    """The first line that names an error in a failed run's output."""
    for line in text.splitlines():
        line = line.split("]:", 1)[-1].strip()
        if re.search(r"(Error|Exception|error:)", line) and "Traceback" not in line:
            return line[:300]
    return (text.strip().splitlines() or ["(no output)"])[-1][:300]


def step_times(trace_dir: pathlib.Path, nproc: int, steps: int):
    """Each step's time on its slowest rank, from the ranks' "step N" spans (seconds)."""
    per_rank = []
    for r in range(nproc):
        events = json.loads((trace_dir / f"rank{r}.json").read_text())["traceEvents"]
        spans = {e["name"]: e["dur"] for e in events
                 if e.get("ph") == "X" and re.fullmatch(r"step \d+", e.get("name", ""))}
        per_rank.append([spans[f"step {s}"] * 1e-6 for s in range(steps)])
    return [max(column) for column in zip(*per_rank)]


def median_ms(step_s):
    return statistics.median(step_s[1:] or step_s) * 1e3


def main() -> int:
    if len(sys.argv) > 3 and sys.argv[1] == "--rss-wrap" and sys.argv[3] == "--":
        return rss_wrap(sys.argv[2], sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default=str(ROOT / "build" / "bin" / "lesson11_solution"))
    ap.add_argument("--torchrun", default=str(pathlib.Path(sys.executable).parent / "torchrun"))
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--mix", default="2x2x2", help="DPxTPxPP, multiplying to --nproc "
                    "(default 2x2x2)")
    ap.add_argument("--micro-batches", type=int, default=0,
                    help="micro-batches per replica (default: one sequence each)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", "--global-batch", dest="batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--pytorch-parts", choices=["auto"] + PARTS, default="auto",
                    help="PyTorch's composition: auto (the full one, then the fallbacks on "
                         "failure) or one of them")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, 3 steps (ctest): layers 2, hidden 32, heads 2, seq 16")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--json", action="store_true",
                    help="also print one JSON object with both sides on the last line")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--parts", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    if a.smoke:
        a.steps, a.layers, a.hidden, a.heads, a.seq = 3, 2, 32, 2, 16

    try:
        dp, tp, pp = (int(v) for v in a.mix.lower().split("x"))
    except ValueError:
        ap.error(f"--mix {a.mix}: write DPxTPxPP, e.g. 2x2x2")
    if dp * tp * pp != a.nproc:
        ap.error(f"--mix {a.mix} is {dp * tp * pp} ranks, --nproc {a.nproc}: pass a mix whose "
                 f"degrees multiply to {a.nproc} (e.g. --nproc 4 --mix 1x2x2)")
    if a.batch % dp:
        ap.error(f"--dp {dp} does not divide --batch {a.batch}")
    rows = a.batch // dp
    m = a.micro_batches or rows
    if rows % m:
        ap.error(f"--micro-batches {m} does not divide a replica's {rows} rows")
    if a.layers < pp:
        ap.error(f"--layers {a.layers}: fewer blocks than the {pp} stages")
    if a.heads % tp or a.hidden % a.heads:
        ap.error(f"--heads {a.heads} must divide --hidden {a.hidden} and be a multiple of tp {tp}")
    mix = f"{dp}x{tp}x{pp}x1:3:none:{rows // m}"
    sizes = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
             "--seq", str(a.seq), "--seed", str(a.seed), "--steps", str(a.steps),
             "--global-batch", str(a.batch), "--lr", str(a.lr)]
    print(f"lesson 11 vs PyTorch, dp {dp} x tp {tp} x pp {pp} on {a.nproc} ranks: GPT L="
          f"{a.layers} h={a.hidden} a={a.heads} s={a.seq}, untied, global batch {a.batch}, "
          f"{m} micro-batches of {rows // m} per replica, {a.steps} steps, gloo on CPU, "
          "1 thread per rank", flush=True)

    # Ours: the binary behind the RSS wrapper, with --trace for its per-step times.
    with tempfile.TemporaryDirectory(prefix="dtc-l11-bench-") as tmp:
        trace, rss_dir = pathlib.Path(tmp, "trace"), pathlib.Path(tmp, "rss")
        rss_dir.mkdir()
        try:
            ours, ours_wall = torchrun(a, [THIS, "--rss-wrap", str(rss_dir), "--", a.binary,
                                           "--mix", mix, "--untied", *sizes, "--json",
                                           "--trace", str(trace)])
            ours_steps = step_times(trace, a.nproc, a.steps)
            ours_rss = [int((rss_dir / f"rank{r}").read_text()) for r in range(a.nproc)]
        except (RuntimeError, OSError, KeyError, subprocess.TimeoutExpired) as e:
            print(f"ours (lesson11 --mix {mix}) failed: {e}", file=sys.stderr)
            return 1
    print(f"  ours: {a.binary} --mix {mix} --untied ({ours_wall:.1f} s)", flush=True)

    # PyTorch's: the full composition, or the first fallback that runs.
    worker_args = [THIS, "--worker", *sizes, "--batch", str(a.batch), "--micro-batches", str(m),
                   "--dp", str(dp), "--tp", str(tp), "--pp", str(pp)]
    theirs, failures = None, []
    for parts in (PARTS if a.pytorch_parts == "auto" else [a.pytorch_parts]):
        try:
            theirs, theirs_wall = torchrun(a, python_worker(*worker_args, "--parts", parts))
            break
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            why = first_error(str(e))
            failures.append((parts, why))
            print(f"  PyTorch {parts}: did not run on CPU gloo: {why}", flush=True)
    if theirs is None:
        print("PyTorch's side did not run in any composition", file=sys.stderr)
        return 1
    if theirs["parts"] != PARTS[0]:
        print(f"  {'FALLBACK: ' if failures else ''}PyTorch ran {theirs['parts']} instead of "
              f"{PARTS[0]}: time and memory below compare unequal compositions", flush=True)
    print(f"  PyTorch {theirs['torch']}: {theirs['parts']} ({theirs['applied']} on this mesh), "
          f"{theirs['schedule'] or 'no pipeline'} ({theirs_wall:.1f} s)", flush=True)

    ms_ours, ms_theirs = median_ms(ours_steps), median_ms(theirs["step_s"])
    mo = ours["memory"]["measured"]
    so = mo["params"] + mo["grads"] + mo["optimizer"]
    mt = theirs["bytes"][0]
    st = mt["params"] + mt["grads"] + mt["optimizer"]
    rss_o, rss_t = max(ours_rss), max(theirs["rss"])
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(ours["losses"], theirs["losses"])]
    judged = max(rel[:JUDGED])

    label = f"PyTorch {theirs['applied']}"
    kib = lambda b: f"{b / 1024:.1f}"
    print(f"\n{'':<44} {'ours':>12} {label:>17} {'PyTorch/ours':>13}")
    rows_out = [
        (f"ms/step, median of steps 2-{a.steps}, slowest rank", f"{ms_ours:.1f}",
         f"{ms_theirs:.1f}", ms_theirs / ms_ours),
        ("state KiB, rank 0: params+grads+AdamW", kib(so), kib(st), st / so),
        ("  params", kib(mo["params"]), kib(mt["params"]), mt["params"] / mo["params"]),
        ("  grads", kib(mo["grads"]), kib(mt["grads"]),
         mt["grads"] / mo["grads"] if mo["grads"] else float("nan")),
        ("  AdamW moments", kib(mo["optimizer"]), kib(mt["optimizer"]),
         mt["optimizer"] / mo["optimizer"] if mo["optimizer"] else float("nan")),
        ("peak RSS MiB, largest rank (whole process)", f"{rss_o / 2**20:.0f}",
         f"{rss_t / 2**20:.0f}", rss_t / rss_o),
    ]
    for name, o, t, r in rows_out:
        print(f"{name:<44} {o:>12} {t:>17} {r:>13.2f}")
    print(f"{'loss, first -> last':<44} {ours['losses'][0]:>5.3f}->{ours['losses'][-1]:.3f} "
          f"{theirs['losses'][0]:>10.3f}->{theirs['losses'][-1]:.3f}")
    n = min(JUDGED, len(rel))
    print(f"{'max relative loss difference':<44} {judged:>12.2e} over the first {n} steps "
          f"(tolerance {RTOL:g}); {max(rel):.2e} over all {len(rel)}")
    print(f"\nms/step: ours from its --trace spans, PyTorch's from perf_counter on every rank; "
          f"ratio above 1: ours is faster.\nstate: counted from the tensors rank 0 holds after "
          f"the last step (PyTorch: DTensor local shards).\nRSS: ru_maxrss per process, the "
          f"runtime included (Python and torch on PyTorch's side).")
    if a.json:
        print(json.dumps({"mix": a.mix, "nproc": a.nproc, "ours_mix": mix,
                          "pytorch_parts": theirs["parts"], "fallbacks": failures,
                          "ms_per_step": {"ours": ms_ours, "pytorch": ms_theirs},
                          "state_bytes_rank0": {"ours": mo, "pytorch": mt},
                          "peak_rss_bytes": {"ours": ours_rss, "pytorch": theirs["rss"]},
                          "losses": {"ours": ours["losses"], "pytorch": theirs["losses"]},
                          "max_rel_loss_diff": judged, "torch": theirs["torch"],
                          "wall_s": {"ours": ours_wall, "pytorch": theirs_wall}}))
    if judged > RTOL:
        print(f"LOSSES DIFFER: {judged:.3e} > {RTOL:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

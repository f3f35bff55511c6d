#!/usr/bin/env python3
"""Lesson 04 end-to-end tests: the real lesson04 program under real launchers.

    e2e.py MODE --program build/bin/lesson04_solution --torchrun-kind venv|debian
           [--venv-torchrun PATH] [--two-nodes-script scripts/two-nodes.sh]

MODE is one of
    torchrun     2 ranks on one node through torchrun (the venv's 2.x, or Debian's 1.13)
    restart      the same with --max_restarts=1 while rank 1 fails on the first attempt
    mpirun       2 ranks through OpenMPI's mpirun
    no-launcher  the program alone: exit 2 and the exact torchrun command, which then works
    two-nodes    2 nodes x 2 ranks through c10d rendezvous in network namespaces (exit 77, a
                 skip, where namespaces are not permitted)
    multinode-static, multinode-c10d
                 the program's own launch commands for 2 "nodes" x 2 ranks on this machine
                 (--hosts 127.0.0.1,127.0.0.1: your torchrun_command), read by torchrun's own
                 argument parser, then run, one torchrun per node, side by side

Every check compares with a closed form: N ranks report ranks 0..N-1, and allreduce(SUM) of
rank + 1 is N (N + 1) / 2. Each run takes its own free port, so tests may run in parallel.
Registered in lessons/04_launch/lesson.cmake (ctest -L lesson04 -R e2e).
"""
import argparse
import collections
import json
import os
import pathlib
import shlex
import subprocess
import sys
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "support"))
from e2e_common import DEBIAN_TORCHRUN_FLAGS, free_port, torchrun_argv  # noqa: E402

TIMEOUT_S = 90
SKIP = 77


class Failure(Exception):
    pass


def clean_env() -> dict:
    """This environment without any launcher variable a surrounding job may have left."""
    env = dict(os.environ)
    for name in list(env):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "MASTER_ADDR", "MASTER_PORT") or name.startswith(("OMPI_", "TORCHELASTIC_")):
            del env[name]
    return env


def run(cmd, env=None):
    print("$ " + shlex.join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                           env=env if env is not None else clean_env())
    except subprocess.TimeoutExpired as e:
        raise Failure(f"did not finish in {TIMEOUT_S} s (a hang is a bug):\n"
                      f"{e.stdout}\n{e.stderr}")
    print(p.stdout[-4000:], end="")
    print(p.stderr[-6000:], end="", file=sys.stderr)
    return p


def last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise Failure("rank 0 printed nothing on stdout")
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise Failure(f"the last line of stdout is not JSON ({e}): {lines[-1]!r}")


def expect(cond: bool, what: str):
    if not cond:
        raise Failure(what)
    print(f"ok: {what}")


def check_job(j: dict, launcher: str, world: int, nodes: int, restart: int = 0):
    """The closed-form facts of a job of `world` ranks on `nodes` nodes."""
    expect(j["launcher"] == launcher, f"launcher is {launcher} (got {j['launcher']})")
    expect(j["world_size"] == world, f"world_size is {world} (got {j['world_size']})")
    expect(j["nodes"] == nodes, f"{nodes} node(s) (got {j['nodes']})")
    expected = world * (world + 1) // 2
    expect(j["expected_sum"] == expected and j["allreduce_sum"] == expected,
           f"allreduce(SUM) of rank+1 = N(N+1)/2 = {expected} (got {j['allreduce_sum']})")
    ranks = j["ranks"]
    expect(sorted(r["rank"] for r in ranks) == list(range(world)),
           f"ranks 0..{world - 1} each report once (got {[r['rank'] for r in ranks]})")
    per_node = world // nodes
    by_node = collections.defaultdict(list)
    for r in ranks:
        by_node[r["group_rank"]].append(r)
    expect(sorted(by_node) == list(range(nodes)), f"node indices 0..{nodes - 1}")
    for node, rs in by_node.items():
        expect(sorted(r["local_rank"] for r in rs) == list(range(per_node)),
               f"node {node} holds local ranks 0..{per_node - 1}")
        expect(all(r["local_world_size"] == per_node for r in rs),
               f"node {node}: LOCAL_WORLD_SIZE {per_node}")
        expect(len({r["host"] for r in rs}) == 1, f"node {node}'s ranks share one host name")
        expect(all(r["rank"] == node * per_node + r["local_rank"] for r in rs),
               f"node {node}: rank = node x {per_node} + local rank")
    expect(all(r["restart_count"] == restart for r in ranks),
           f"every rank is on attempt {restart}")
    expect(j["restart_count"] == restart and j["store_prefix"] == f"attempt{restart}/",
           f"store keys scoped by the restart count: attempt{restart}/")
    expect(all(r["device"] == "cpu" or r["device"] == f"cuda:{r['local_rank']}" for r in ranks),
           "each rank's device is cpu or cuda:<local_rank>")


def torchrun_cmd(args, extra):
    """2 ranks on one node: the venv's torchrun with --standalone (it picks a free port), or
    Debian's 1.13, whose --standalone always takes port 29400 (parallel tests would join each
    other's rendezvous), with an explicit c10d endpoint on a free port instead (and
    e2e_common.DEBIAN_TORCHRUN_FLAGS)."""
    if args.torchrun_kind == "venv":
        return [*torchrun_argv(args.venv_torchrun), "--standalone", "--nproc_per_node=2", *extra,
                "--no_python"]
    return [*torchrun_argv("torchrun"), "--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}", f"--rdzv_id={uuid.uuid4()}",
            *DEBIAN_TORCHRUN_FLAGS, *extra, "--no_python"]


def mode_torchrun(args):
    p = run(torchrun_cmd(args, []) + [args.program, "--json"])
    expect(p.returncode == 0, f"torchrun exits 0 (got {p.returncode})")
    j = last_json(p.stdout)
    check_job(j, "torchrun", 2, 1)
    # Observed: 2.x's agent hosts the store for its workers, 1.13's does not.
    agent = args.torchrun_kind == "venv"
    expect(j["use_agent_store"] is agent, f"TORCHELASTIC_USE_AGENT_STORE is {agent}")
    expect(j["run_id"] != "", "TORCHELASTIC_RUN_ID is set")
    for r in range(2):
        expect(f"[rank {r}] rank {r}/2 (local {r}/2, node 0) via torchrun" in p.stderr,
               f"rank {r} describes itself on stderr")


def mode_restart(args):
    p = run(torchrun_cmd(args, ["--max_restarts=1"]) + [args.program, "--json", "--crash-rank", "1"])
    expect(p.returncode == 0, f"torchrun exits 0 after one restart (got {p.returncode})")
    expect("failing on purpose" in p.stderr, "rank 1 failed on the first attempt")
    j = last_json(p.stdout)
    expect(j["max_restarts"] == 1, "TORCHELASTIC_MAX_RESTARTS is 1")
    check_job(j, "torchrun", 2, 1, restart=1)


def mode_mpirun(args):
    port = free_port()
    p = run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x",
             "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}", args.program, "--json"])
    expect(p.returncode == 0, f"mpirun exits 0 (got {p.returncode})")
    j = last_json(p.stdout)
    check_job(j, "mpirun", 2, 1)
    expect(j["master_port"] == port and not j["use_agent_store"],
           f"rank 0 hosts the store on MASTER_PORT {port}")


def mode_no_launcher(args):
    p = run([args.program, "--json"])
    expect(p.returncode == 2, f"exit 2, bad input (got {p.returncode})")
    expect("needs at least 2 ranks, but it was started as 1 (launcher: none)" in p.stderr,
           "the message says what is wrong")
    hint = [ln.strip() for ln in p.stderr.splitlines()
            if "--standalone --nproc_per_node=2 --no_python" in ln]
    expect(len(hint) == 1 and hint[0].endswith(f"--no_python {args.program} --json"),
           f"the message shows the command: {hint}")
    if args.torchrun_kind == "venv":  # 1.13's --standalone takes the fixed port 29400: not here
        q = run(shlex.split(hint[0]))
        expect(q.returncode == 0, "the command it shows works as written")
        check_job(last_json(q.stdout), "torchrun", 2, 1)


def mode_two_nodes(args):
    env = clean_env()
    env["TORCHRUN"] = (args.venv_torchrun if args.torchrun_kind == "venv"
                       else "torchrun --redirects 2 --tee 2")
    p = run([args.two_nodes_script, args.program, "--json"], env=env)
    if p.returncode == SKIP:
        print("SKIPPED: " + p.stderr.strip().splitlines()[-1])
        sys.exit(SKIP)
    expect(p.returncode == 0, f"both nodes exit 0 (got {p.returncode})")
    j = last_json(p.stdout)
    check_job(j, "torchrun", 4, 2)
    hosts = collections.Counter(r["host"] for r in j["ranks"])
    expect(hosts == {"node0": 2, "node1": 2}, f"2 ranks on host node0, 2 on node1 (got {hosts})")


def torchrun_parse(args, commands) -> list:
    """What torchrun's own argument parser (torch.distributed.run.get_args_parser, of the torch
    that this path's torchrun belongs to) makes of each of `commands` after its first word: one
    interpreter for all of them (the import of torch is its cost), leaving without its teardown."""
    python = (str(pathlib.Path(args.venv_torchrun).with_name("python"))
              if args.torchrun_kind == "venv" else "/usr/bin/python3")
    code = ("import json, os, sys\n"
            "from torch.distributed.run import get_args_parser\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        a = vars(get_args_parser().parse_args(argv))\n"
            "    except SystemExit:\n"
            "        print(json.dumps(None))\n"
            "        continue\n"
            "    print(json.dumps({k: v for k, v in a.items()\n"
            "                      if isinstance(v, (str, int, bool, list))}))\n"
            "sys.stdout.flush()\n"
            "sys.stderr.flush()\n"
            "os._exit(0)\n")
    argvs = [shlex.split(command)[1:] for command in commands]
    p = subprocess.run([python, "-c", code, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=60)
    parsed = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    if p.returncode != 0 or len(parsed) != len(commands):
        raise Failure(f"torchrun's parser did not run:\n{p.stderr[-2000:]}")
    for command, a in zip(commands, parsed):
        if a is None:
            raise Failure(f"torchrun's parser rejects the command {command!r}:\n"
                          f"{p.stderr[-2000:]}")
    return parsed


def mode_multinode(args, rendezvous: str):
    port = free_port()
    job_id = f"job{uuid.uuid4().hex[:8]}"
    program_args = ["--json", "--timeout-s", "60"]
    p = run([args.program, "--hosts", "127.0.0.1,127.0.0.1", "--nproc-per-node", "2", "--port",
             str(port), "--rdzv", rendezvous, "--job-id", job_id, "--json", "--", args.program,
             *program_args])
    expect(p.returncode == 0, f"the program prints the commands and exits 0 (got {p.returncode})")
    commands = last_json(p.stdout)["commands"]
    expect(len(commands) == 2, f"one command per node (got {len(commands)})")
    for node, a in enumerate(torchrun_parse(args, commands)):
        print(f"node {node}: torchrun reads {json.dumps(a)}")
        expect(str(a["nnodes"]) in ("2", "2:2") and str(a["nproc_per_node"]) == "2",
               f"node {node}: --nnodes 2, --nproc_per_node 2")
        expect(a["standalone"] is False, f"node {node}: no --standalone (it means one node)")
        expect(a["no_python"] is True and a["training_script"] == args.program and
               a["training_script_args"] == program_args,
               f"node {node}: every rank runs {args.program} {' '.join(program_args)}, no python")
        if rendezvous == "static":
            expect(a["rdzv_backend"] == "static" and a["node_rank"] == node,
                   f"node {node}: static rendezvous, --node_rank {node}")
            endpoint = a["rdzv_endpoint"] or f"{a['master_addr']}:{a['master_port']}"
            expect(endpoint == f"127.0.0.1:{port}",
                   f"node {node}: node 0's store on the first host, port {port} (got {endpoint})")
        else:
            expect(a["rdzv_backend"] == "c10d" and a["rdzv_endpoint"] == f"127.0.0.1:{port}" and
                   a["rdzv_id"] == job_id,
                   f"node {node}: c10d rendezvous at 127.0.0.1:{port}, id {job_id}")
    if rendezvous == "c10d":
        expect(commands[0] == commands[1], "c10d: both nodes type the same command")
    # Both "nodes" at once, as two people would type them into a shell on two machines.
    procs = []
    for command in commands:
        print("$ " + command, flush=True)
        procs.append(subprocess.Popen(["/bin/sh", "-c", command], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=clean_env()))
    outs = []
    try:
        for q in procs:
            outs.append(q.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for q in procs:
            q.kill()
        raise Failure(f"the two nodes did not finish in {TIMEOUT_S} s (a hang is a bug)")
    for node, (q, (out, err)) in enumerate(zip(procs, outs)):
        print(out[-3000:], end="")
        print(err[-4000:], end="", file=sys.stderr)
        expect(q.returncode == 0, f"node {node}'s torchrun exits 0 (got {q.returncode})")
    # Rank 0 prints the job's JSON: on the node that the rendezvous numbered 0.
    reports = [out for out, _ in outs if out.strip()]
    expect(len(reports) == 1, f"one node prints rank 0's report (got {len(reports)})")
    check_job(last_json(reports[0]), "torchrun", 4, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["torchrun", "restart", "mpirun", "no-launcher", "two-nodes",
                                     "multinode-static", "multinode-c10d"])
    ap.add_argument("--program", required=True)
    ap.add_argument("--torchrun-kind", choices=["venv", "debian"], required=True)
    ap.add_argument("--venv-torchrun", default=os.path.expanduser(
        "~/.cache/dtc-course/venv/bin/torchrun"))
    ap.add_argument("--two-nodes-script")
    args = ap.parse_args()
    modes = {"torchrun": mode_torchrun, "restart": mode_restart, "mpirun": mode_mpirun,
             "no-launcher": mode_no_launcher, "two-nodes": mode_two_nodes,
             "multinode-static": lambda a: mode_multinode(a, "static"),
             "multinode-c10d": lambda a: mode_multinode(a, "c10d")}
    try:
        modes[args.mode](args)
    except Failure as e:
        print(f"FAILED ({args.mode}): {e}", file=sys.stderr)
        return 1
    except (KeyError, TypeError) as e:
        print(f"FAILED ({args.mode}): the JSON lacks a key or has a wrong type: {e!r}",
              file=sys.stderr)
        return 1
    print(f"PASSED ({args.mode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

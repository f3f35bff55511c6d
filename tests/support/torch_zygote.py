#!/usr/bin/env python3
"""torchrun, started from an interpreter that has already imported torch.

    python -S torch_zygote.py PYTHON TORCHRUN [TORCHRUN'S ARGS...]

Runs the TORCHRUN script (the venv's or Debian's console script, by the interpreter PYTHON its
first line names: e2e_common.torchrun_argv) with its arguments, as `TORCHRUN ARGS...` would, and
exits with its exit status (or dies of its signal). What is different is where the process comes
from. Every torchrun imports torch before it parses its first argument: about 1.6 CPU seconds on
the course's 2-core machine, and the tests and benchmarks start torchrun some 150 times. Here a
server, started by the first launch and reused by the next ones, imports torch once; each launch
is a fork of it (a copy of the interpreter with torch's modules loaded) that then runs torchrun's
own script, so the rendezvous, the agent, the workers, the restarts, the output and the exit
status are torchrun's own. The fork runs with the launch's arguments, environment, working
directory and standard streams (passed over a Unix socket), in a process group of its own.

    python -S torch_zygote.py --worker PYTHON SCRIPT [SCRIPT'S ARGS...]

runs a rank's own Python file the same way, as `PYTHON SCRIPT ARGS...` would: the command a
benchmark gives torchrun for its PyTorch ranks (bench/bench_support.py, python_worker), which
each import torch, and torch.distributed's FSDP, tensor and pipelining modules, for 2-3 CPU
seconds. Its server imports those once; the fork's output is line-buffered, as `python -u`
(torchrun's own way) leaves it.

A server serves only launches with its exact environment, interpreter and torchrun script (the
hash of all three names it): torch reads some variables when it is imported (LOGLEVEL,
TORCH_CPP_LOG_LEVEL), so a launch with other variables gets a server of its own; for --worker,
the variables torchrun's agent sets per rank and per launch (RANK, MASTER_PORT, TORCHELASTIC_*:
WORKER_VARIABLES), which torch does not read as it is imported, are left out of that
comparison, so that every rank of every launch alike shares one server. A server exits
after IDLE_S seconds without a launch. A signal to this process (SIGTERM, SIGINT, SIGHUP) goes on
to torchrun; if this process dies (a test's timeout kills it), torchrun gets SIGTERM, as its
agent stops its workers on, then SIGKILL 10 s later. Where anything of this fails before torchrun
starts (no socket, a server that cannot import torch), the launch runs the script itself, in this
process, as torchrun_quick_exit.py does. DTC_TORCH_ZYGOTE=0 turns the server off: every launch
then imports torch itself. Linux only (abstract sockets, pidfds).
"""
import errno
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

from torchrun_quick_exit import run_and_exit

IDLE_S = 120
HERE = os.path.dirname(os.path.abspath(__file__))
QUICK_EXIT = os.path.join(HERE, "torchrun_quick_exit.py")


# What torchrun's agent sets for each worker: different between ranks and between launches, and
# read by none of torch's modules as they are imported (torch.distributed reads them at
# init_process_group). Left out of a --worker server's key, along with every TORCHELASTIC_*.
WORKER_VARIABLES = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                    "NCCL_ASYNC_ERROR_HANDLING"}
WORKER_MODULES = ["torch.distributed.run", "torch.distributed.fsdp", "torch.distributed.tensor",
                  "torch.distributed.pipelining"]


def worker_key_env(env: dict) -> dict:
    return {k: v for k, v in env.items()
            if k not in WORKER_VARIABLES and not k.startswith("TORCHELASTIC_")}


def key_of(python: str, script: str, env: dict, worker: bool = False) -> str:
    """What a fork inherits from the server and torchrun would otherwise inherit from its
    launcher: the interpreter and script (for --worker: this file, whatever the rank's script),
    the environment (for --worker: worker_key_env), the limits, CPUs and umask; and this
    file's own text, so that a launch never meets a server of an older version of it."""
    import resource
    if worker:
        script = os.path.abspath(__file__)
        env = worker_key_env(env)
    umask = os.umask(0)
    os.umask(umask)
    st = os.stat(script)
    h = hashlib.sha256()
    for mine in (os.path.abspath(__file__), QUICK_EXIT):  # a server of this very code
        with open(mine, "rb") as f:
            h.update(f.read())
    h.update(json.dumps(["worker" if worker else "torchrun",
                         os.path.realpath(python), os.path.realpath(script), st.st_mtime_ns,
                         sorted(env.items()), sorted(os.sched_getaffinity(0)), umask,
                         [resource.getrlimit(r) for r in (resource.RLIMIT_NOFILE,
                                                          resource.RLIMIT_CORE,
                                                          resource.RLIMIT_STACK)]]).encode())
    return h.hexdigest()[:24]


def in_other_netns() -> bool:
    """Whether this process runs in a network namespace of its own (lesson 04's two nodes): its
    torchrun must run there, not in a server outside it."""
    try:
        return os.stat("/proc/self/ns/net").st_ino != os.stat("/proc/1/ns/net").st_ino
    except OSError:
        return False


def state_dir() -> str:
    d = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"dtc-torch-zygote-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def address(key: str) -> str:
    return f"\0dtc-torch-zygote-{os.getuid()}-{key}"


def send_msg(sock, obj) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def recv_msg(sock, buf: bytearray):
    """The next newline-ended JSON message from SOCK (None at end of stream)."""
    while b"\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf.extend(chunk)
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


# --- the launch (client) ----------------------------------------------------------------------

def run_here(python: str, script: str, args: list, worker: bool = False) -> None:
    """The fallback: torchrun in a process of its own, as torchrun_quick_exit.py runs it (a
    --worker's script as the interpreter itself would, unbuffered as torchrun runs it)."""
    if worker:
        os.execv(python, [python, "-u", script, *args])
    os.execv(python, [python, QUICK_EXIT, script, *args])


def connect(key: str):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address(key))
        return s
    except OSError:
        s.close()
        return None


def start_server(python: str, script: str, key: str, worker: bool = False):
    """Connects to the server of KEY, starting it (once, under a lock) when there is none."""
    sock = connect(key)
    if sock:
        return sock
    d = state_dir()
    with open(os.path.join(d, key + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = connect(key)
        if sock:
            return sock
        with open(os.path.join(d, key + ".log"), "ab") as log:
            mode = "--serve-worker" if worker else "--serve"
            server = subprocess.Popen([python, os.path.abspath(__file__), mode, key, script],
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                      start_new_session=True, close_fds=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            sock = connect(key)
            if sock:
                return sock
            if server.poll() is not None:  # it could not import torch or bind: run here
                return None
            time.sleep(0.05)
        return None


def client(python: str, script: str, args: list, worker: bool = False) -> None:
    if os.environ.get("DTC_TORCH_ZYGOTE", "1") == "0" or in_other_netns():
        run_here(python, script, args, worker)
    env = dict(os.environ)
    key = key_of(python, script, env, worker)
    try:
        sock = start_server(python, script, key, worker)
    except OSError:
        sock = None
    if sock is None:
        run_here(python, script, args, worker)
    buf = bytearray()
    try:
        socket.send_fds(sock, [b"F"], [0, 1, 2])
        send_msg(sock, {"argv": [os.path.abspath(script), *args], "env": env,
                        "cwd": os.getcwd(), "worker": worker})
        started = recv_msg(sock, buf)
    except OSError:
        started = None
    if not started or "pid" not in started:  # nothing ran: run it here
        sock.close()
        run_here(python, script, args, worker)
    pid = started["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    while True:
        try:
            done = recv_msg(sock, buf)
            break
        except InterruptedError:
            continue
    if done is None:  # the server's side died without a status
        print(f"torch_zygote: lost torchrun (pid {pid}) without its exit status", file=sys.stderr)
        os._exit(1)
    status = done["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


# --- the server ---------------------------------------------------------------------------------

def run_torchrun(request: dict) -> None:
    """In the fork: becomes the launch's torchrun, then exits with its status."""
    os.setpgid(0, 0)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    worker = request.get("worker", False)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=worker or stream is sys.stderr
                           or os.isatty(stream.fileno()))
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as for the script itself
    run_and_exit(sys.argv[0])  # the same end as torchrun_quick_exit.py's


def manage(conn) -> None:
    """In a fork of the server, for one launch: starts its torchrun, reports its pid and exit
    status, and stops it when the launch goes away."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _msg, fds, _flags, _addr = socket.recv_fds(conn, 1, 3)
    request = recv_msg(conn, bytearray())
    if request is None or len(fds) != 3:
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        try:
            run_torchrun(request)
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    send_msg(conn, {"pid": pid})
    try:
        pidfd = os.pidfd_open(pid)
        watch, tick = [pidfd, conn], 1.0
    except (AttributeError, OSError):  # no pidfds (Linux before 5.3): look every 50 ms
        watch, tick = [conn], 0.05
    stopping_since = None
    while True:
        ready, _, _ = select.select(watch, [], [], tick)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            try:
                send_msg(conn, {"status": status})
            except OSError:
                pass
            os._exit(0)
        if conn in ready and stopping_since is None:
            try:
                gone = not conn.recv(4096)
            except OSError:
                gone = True
            if gone:  # the launch died: stop its torchrun as a signal to it would
                stopping_since = time.monotonic()
                watch = [w for w in watch if w is not conn]
                tick = min(tick, 1.0)
                os.kill(pid, signal.SIGTERM)
        if stopping_since is not None and time.monotonic() - stopping_since > 10:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def serve(key: str, script: str, worker: bool = False) -> None:
    import importlib
    import torch.distributed.run  # noqa: F401  what every torchrun imports first
    if worker:  # and what the benchmarks' PyTorch ranks import
        for module in WORKER_MODULES:
            try:
                importlib.import_module(module)
            except Exception:  # 1.13 has no pipelining, and its FSDP fails under Python 3.11:
                pass  # a rank that needs one imports it (and fails) as it would without this
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address(key))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:  # another server of this key won the race
            return
        raise
    listener.listen(64)
    os.chdir("/")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the managers reap themselves
    last = time.monotonic()
    while True:
        ready, _, _ = select.select([listener], [], [], 5.0)
        if not ready:
            if time.monotonic() - last > IDLE_S:
                return
            continue
        conn, _ = listener.accept()
        last = time.monotonic()
        if os.fork() == 0:
            listener.close()
            try:
                manage(conn)
            finally:
                os._exit(1)
        conn.close()


# --- the self-test (ctest course.torch_zygote) -------------------------------------------------

def selftest(torchrun: str, flags: list) -> int:
    """Launches torchrun on 2 ranks through the server and without it, and checks what a caller
    sees: the ranks' output, the working directory and environment of each launch, the exit
    status of a failed run (the same as torchrun's own), one server for launches alike, and that
    killing a launch stops its torchrun and ranks."""
    import shutil
    import tempfile
    sys.path.insert(0, HERE)
    from e2e_common import free_port, torchrun_argv
    me = torchrun_argv(torchrun)  # what the tests and benchmarks run
    if len(me) != 5 or me[2] != os.path.abspath(__file__):
        print(f"torch_zygote selftest: {torchrun} is not started through this file: {me}")
        return 1
    python, script = me[3], me[4]
    port = "0" if not flags else "{port}"  # 1.13's c10d store cannot bind port 0 itself
    base = ["--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", *flags, "--no_python"]
    failures = []

    def check(what, ok, detail=""):
        print(("ok    " if ok else "FAIL  ") + what + (f": {detail}" if detail and not ok else ""))
        if not ok:
            failures.append(what)

    def with_port(cmd):
        return [c.replace("{port}", str(free_port())) for c in cmd]

    def run(cmd, cwd, env=None):
        return subprocess.run(with_port(cmd), cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=120)

    tmp = tempfile.mkdtemp(prefix="dtc-zygote-selftest-")
    try:
        env = dict(os.environ, DTC_ZYGOTE_SELFTEST=tmp)
        key = key_of(python, script, env)
        rank_cmd = ["sh", "-c", 'echo "rank $RANK of $WORLD_SIZE in $(pwd) tag $TAG"']
        for sub in ("a", "b"):
            os.makedirs(os.path.join(tmp, sub))
            p = run([*me, *base, *rank_cmd], os.path.join(tmp, sub), dict(env))
            want = {f"rank {r} of 2 in {os.path.join(tmp, sub)} tag " for r in (0, 1)}
            got = {line for line in p.stdout.splitlines() if line.startswith("rank ")}
            check(f"launch {sub}: exit 0, both ranks' lines, in the launch's directory",
                  p.returncode == 0 and got == want,
                  f"exit {p.returncode}, {sorted(got)}\n{p.stderr}")
        servers = _servers(lambda pid: _cmdline(pid).endswith(f"--serve\0{key}\0{script}"))
        check("one server for the two launches", len(servers) == 1, f"{len(servers)} servers")
        p = run([*me, *base, *rank_cmd], tmp, dict(env, TAG="x"))
        check("a launch with another variable has it (its own server)",
              p.returncode == 0 and p.stdout.count(" tag x") == 2, p.stdout + p.stderr)
        fail = ["sh", "-c", "exit 3"]
        plain = run([python, script, *base, *fail], tmp, dict(env))
        zyg = run([*me, *base, *fail], tmp, dict(env))
        check("a failed rank: the same exit status as torchrun's own",
              plain.returncode == zyg.returncode != 0,
              f"{plain.returncode} against {zyg.returncode}")
        # --worker: a rank's Python file in a fork of one server for every rank, torch's
        # distributed modules already imported there (a rank that imported them itself would
        # find torch.distributed.run missing from sys.modules before its first import)
        worker = os.path.join(tmp, "worker.py")
        with open(worker, "w") as f:
            f.write("import os, sys\n"  # one write per line: the two ranks share the pipe
                    "preloaded = 'torch.distributed.run' in sys.modules\n"
                    "sys.stdout.write(f\"worker {os.environ['RANK']} preloaded {preloaded}\\n\")\n"
                    "sys.stdout.flush()\n"
                    "sys.exit(int(os.environ.get('WORKER_EXIT', '0')))\n")
        wcmd = [python, "-S", os.path.abspath(__file__), "--worker", python, worker]
        for launch in ("c", "d"):
            p = run([*me, *base, *wcmd], tmp, dict(env))
            got = sorted(line for line in p.stdout.splitlines() if line.startswith("worker "))
            check(f"--worker, launch {launch}: both ranks ran in forks of a server that imported "
                  "torch.distributed", p.returncode == 0 and got == [
                      "worker 0 preloaded True", "worker 1 preloaded True"],
                  f"exit {p.returncode}, {got}\nstdout: {p.stdout[-2000:]}\n"
                  f"stderr: {p.stderr[-2000:]}")
        wservers = _servers(lambda pid: "\0--serve-worker\0" in _cmdline(pid)
                            and f"DTC_ZYGOTE_SELFTEST={tmp}" in _environ(pid))
        check("--worker: one server for the ranks of both launches", len(wservers) == 1,
              f"{len(wservers)} servers")
        plain = run([python, script, *base, python, worker], tmp, dict(env, WORKER_EXIT="3"))
        zyg = run([*me, *base, *wcmd], tmp, dict(env, WORKER_EXIT="3"))
        check("--worker, a failed rank: the same exit status as without the server",
              plain.returncode == zyg.returncode != 0,
              f"{plain.returncode} against {zyg.returncode}")
        marker = os.path.join(tmp, "alive")
        # each rank writes its pid (the sleep's, after exec) where the check finds it whole
        sleeper = ["sh", "-c", f"echo $$ > {marker}.tmp.$RANK; "
                               f"mv {marker}.tmp.$RANK {marker}.$RANK; exec sleep 60"]
        launch = subprocess.Popen(with_port([*me, *base, *sleeper]), cwd=tmp, env=dict(env),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(f"{marker}.{r}") for r in (0, 1)):
            time.sleep(0.1)
        check("a launch to kill: both ranks started",
              all(os.path.exists(f"{marker}.{r}") for r in (0, 1)))
        pids = []
        for r in (0, 1):
            try:
                with open(f"{marker}.{r}") as f:
                    pids.append(int(f.read()))
            except (OSError, ValueError):
                pass
        launch.kill()
        launch.wait()
        deadline = time.monotonic() + 30
        left = None
        while time.monotonic() < deadline:
            left = [pid for pid in pids if _alive(pid)]
            if not left:
                break
            time.sleep(0.2)
        check("a killed launch: its torchrun and ranks stop", not left, f"still running: {left}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("torch_zygote selftest: " + ("FAILED: " + ", ".join(failures) if failures else "passed"))
    return 1 if failures else 0


def _alive(pid: int) -> bool:
    """Whether PID runs (a zombie, ended and not yet reaped, does not)."""
    fields = _stat_fields(str(pid))
    return bool(fields) and fields[0] != "Z"


def _servers(is_server) -> list:
    """The pids for which @p is_server holds, less the forks of one of them that still manage a
    launch that has just ended (they share its command line, and go a moment later)."""
    pids = [pid for pid in os.listdir("/proc") if pid.isdigit() and is_server(pid)]
    return [pid for pid in pids if _ppid(pid) not in pids]


def _stat_fields(pid: str) -> list:
    """/proc/PID/stat's fields after the command name: state, ppid, ... ([] when it is gone)."""
    try:
        return _proc_text(pid, "stat", strip=False).rsplit(")", 1)[1].split()
    except IndexError:
        return []


def _ppid(pid: str) -> str:
    fields = _stat_fields(pid)
    return fields[1] if len(fields) > 1 else ""


def _environ(pid: str) -> str:
    return _proc_text(pid, "environ")


def _proc_text(pid: str, name: str, strip: bool = True) -> str:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return text.rstrip("\0") if strip else text


def _cmdline(pid: str) -> str:
    return _proc_text(pid, "cmdline")


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--selftest":  # TORCHRUN [FLAGS...]
        sys.exit(selftest(sys.argv[2], sys.argv[3:]))
    if len(sys.argv) >= 4 and sys.argv[1] in ("--serve", "--serve-worker"):
        serve(sys.argv[2], sys.argv[3], sys.argv[1] == "--serve-worker")
        os._exit(0)  # idle: without tearing torch's modules down
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":  # PYTHON SCRIPT [ARGS...]
        client(sys.argv[2], sys.argv[3], sys.argv[4:], worker=True)
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    client(sys.argv[1], sys.argv[2], sys.argv[3:])


if __name__ == "__main__":
    main()

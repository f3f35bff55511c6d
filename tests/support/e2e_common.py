"""Shared by the end-to-end scripts (tests/support/e2e_run.py, tests/lessonNN/e2e.py)."""
import pathlib
import shlex
import shutil
import socket
import uuid

ZYGOTE = pathlib.Path(__file__).resolve().with_name("torch_zygote.py")
QUICK_EXIT = ZYGOTE.with_name("torchrun_quick_exit.py")
# Debian's torchrun 1.13: output redirection made explicit (it crashes under Python 3.11
# otherwise), and its ranks looked at every 0.1 s as 2.x does (its default, 5 s, made each run
# wait that long at its end). DTC_TORCHRUN_FLAGS (cmake/DtcTorch.cmake) holds the same.
DEBIAN_TORCHRUN_FLAGS = ["--redirects", "2", "--tee", "2", "--monitor_interval", "0.1"]


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest_ratios(got, want, rel, atol, sum_rel=None):
    """Compares two "param_digest" lists (dtc/digest.h) parameter by parameter: for each, the
    larger of |sumsq - sumsq'| / (rel sumsq' + atol) and |sum - sum'| / (sum_rel sqrt(numel
    sumsq') + atol), the sum measured against its own scale (sum_rel: rel unless given). At
    most 1 where they agree. Returns [(name, ratio, got, want)], or None when the names or
    sizes differ."""
    sum_rel = rel if sum_rel is None else sum_rel
    got, want = got or [], want or []
    if len(got) != len(want) or any(g["name"] != w["name"] or g["numel"] != w["numel"]
                                    for g, w in zip(got, want)):
        return None
    out = []
    for g, w in zip(got, want):
        scale = (w["numel"] * w["sumsq"]) ** 0.5
        ratio = max(abs(g["sumsq"] - w["sumsq"]) / (rel * w["sumsq"] + atol),
                    abs(g["sum"] - w["sum"]) / (sum_rel * scale + atol))
        out.append((w["name"], ratio, g, w))
    return out


def torchrun_argv(torchrun: str) -> list:
    """The command that starts @p torchrun (a path, or a name on PATH): the script, run by the
    interpreter its first line names, in a fork of a server that has imported torch already
    (torch_zygote.py: torchrun itself, without the import before it or the interpreter's
    teardown after it). [torchrun] as it is where that line names no Python."""
    path = shutil.which(torchrun) or torchrun
    try:
        with open(path, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace")
    except OSError:
        return [torchrun]
    interpreter = shlex.split(first[2:]) if first.startswith("#!") else []
    if not interpreter or "python" not in pathlib.Path(interpreter[-1]).name:
        return [torchrun]
    if len(interpreter) != 1:  # "#!/usr/bin/env python3": by its quick exit only
        return [*interpreter, str(QUICK_EXIT), path]
    return [interpreter[0], "-S", str(ZYGOTE), interpreter[0], path]


def torchrun_cmd(torchrun, flags, port0, nproc, program, args):
    """torchrun on one machine with a rendezvous of this run's own (a c10d store on a free port,
    or with @p port0 on port 0, which torchrun 2.x binds itself): a port picked beforehand can be
    taken by a run started at the same moment, whose store this torchrun would then join. @p flags
    is a string of extra torchrun flags (the light path's)."""
    port = 0 if port0 else free_port()
    return [*torchrun_argv(torchrun), f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={uuid.uuid4()}",
            *shlex.split(flags), "--no_python", program, *args]

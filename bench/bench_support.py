"""What the benchmarks against PyTorch (bench/lessonNN_vs_pytorch.py) share: a free port for a
torchrun rendezvous, the command that starts torchrun on one machine, the command of PyTorch's
ranks, and the last JSON line of a program's output."""
import json
import os
import pathlib
import socket
import sys

SUPPORT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "support"
sys.path.insert(0, str(SUPPORT))
from e2e_common import torchrun_argv  # noqa: E402,F401  (torchrun, without the teardown after)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_json(text: str) -> dict:
    """The last line of @p text that starts with '{', parsed; RuntimeError with the output's tail
    when there is none."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON line in the output:\n" + text[-3000:])


def torchrun_launcher(torchrun: str, nproc: int) -> list:
    """@p torchrun on this machine, @p nproc ranks, a c10d rendezvous on a free port of its own
    (started without the interpreter's teardown after it: e2e_common.torchrun_argv)."""
    return [*torchrun_argv(torchrun), "--nnodes=1", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}"]


def _zygote_workers() -> bool:
    return os.environ.get("DTC_ZYGOTE_WORKERS") == "1"


def python_worker(script, *args, python=None) -> list:
    """What follows torchrun's own flags to run the Python file @p script with @p args on each
    rank, as torchrun runs a script (`python -u SCRIPT ARGS`, by torchrun's interpreter: pass it
    as @p python where it is not this one). With DTC_ZYGOTE_WORKERS=1 (the
    ctest smoke runs set it), each rank is a fork of a server that has imported torch and
    torch.distributed's FSDP, tensor and pipelining modules instead (tests/support/
    torch_zygote.py --worker): 2-3 CPU seconds less per rank. The benchmarks' real runs keep their
    own imports, so that the wall times they print include them, as a user's would."""
    if _zygote_workers():
        return ["--no_python", *python_command(script, *args, python=python)]
    return [str(script), *map(str, args)]


def python_command(script, *args, python=None) -> list:
    """@p script with @p args as one process of @p python (default: this interpreter), a
    single-device PyTorch run; or a fork of that same server with DTC_ZYGOTE_WORKERS=1."""
    python = str(python or sys.executable)
    if _zygote_workers():
        return [python, "-S", str(SUPPORT / "torch_zygote.py"), "--worker", python, str(script),
                *map(str, args)]
    return [python, str(script), *map(str, args)]

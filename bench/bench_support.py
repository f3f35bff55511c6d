"""What the benchmarks against PyTorch (bench/lessonNN_vs_pytorch.py) share: a free port for a
torchrun rendezvous, the command that starts torchrun on one machine, and the last JSON line of
a program's output."""
import json
import pathlib
import socket
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "support"))
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

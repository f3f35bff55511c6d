"""The clean end of a PyTorch worker that the benchmarks start under torchrun.

PyTorch 2.15 on gloo sometimes aborts *after* destroy_process_group() has returned, while the
interpreter shuts down ("terminate called without an active exception": a C++ thread object
destroyed while still joinable). Measured on the 2-core course machine with
bench/lesson06_pytorch_ddp.py at its smoke size: 1 run in 8 to 16 aborted, always after the
results were printed and the group destroyed on both ranks. torchrun then reports the job as
failed. The worker's work is done at that point, so it leaves with os._exit(0), which runs no
C++ static destructors.
"""
import os
import sys

import torch.distributed as dist


def finish_and_exit() -> None:
    """Every rank past its last collective, the process group destroyed, then exit 0."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

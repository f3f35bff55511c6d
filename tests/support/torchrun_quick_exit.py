#!/usr/bin/env python3
"""torchrun itself, without the interpreter's teardown once it has finished.

    python torchrun_quick_exit.py TORCHRUN [TORCHRUN'S ARGS...]

Runs the TORCHRUN script (the venv's or Debian's console script, by the interpreter its first
line names: e2e_common.torchrun_argv) with its arguments, exactly as `TORCHRUN ARGS...` would,
and exits with its exit status. Only what comes after is different: the atexit handlers run,
the output is flushed, and the process ends with os._exit, skipping the finalisation of the
interpreter, which tears down torch's thousands of modules one by one: 0.5-1 s of CPU for every
launch on the course's 2-core machine (`python -c "import torch"` spends longer ending than
importing there), after the ranks have ended and every line has been written. The rendezvous,
the workers, the restarts and the exit status are torchrun's own.
"""
import atexit
import os
import runpy
import sys
import traceback


def run_and_exit(script: str) -> None:
    """Runs @p script as __main__ with the present sys.argv, then ends the process with its exit
    status, without the interpreter's finalisation (also used by torch_zygote.py's forks)."""
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # as the interpreter would: the traceback, then exit status 1
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code & 0xFF)


def main() -> None:
    script = sys.argv[1]
    sys.argv = [script, *sys.argv[2:]]
    run_and_exit(script)


if __name__ == "__main__":
    main()

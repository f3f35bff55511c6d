#!/usr/bin/env python3
"""A GoogleTest program run once per ctest run, its tests still reported one by one.

ctest runs every discovered GoogleTest case in a process of its own, and a LibTorch test program
spends about 0.6 s of every start in LibTorch's static initialisation: on the 2-core machine the
course is tested on, three quarters of the unit tests' time. So each test program runs once, as
`scripts/run-unit-tests.sh` runs it for a learner, and each case's ctest entry reports that run's
result for its case:

    gtest_once.py run BINARY [--timeout S]     the fixture (ctest: <prefix>run_once): runs BINARY
                                               once and keeps each case's result and output in
                                               BINARY.results.json
    gtest_once.py BINARY --gtest_filter=S.T ...
                                               a case's entry (the target's test executor, which
                                               gtest_discover_tests puts before BINARY): prints
                                               the case's output from that run, exits 0 if it
                                               passed, 1 if it failed

Nothing is taken on trust: a case whose result is missing (the program crashed or hung before
it finished, the results are older than the binary, or ctest ran the case without its fixture)
runs by itself, in its own process, as plain ctest would run it. DTC_GTEST_ISOLATE=1 runs every
case that way (ISOLATE=1 of scripts/run-unit-tests.sh). Discovery (--gtest_list_tests) and any
other use go straight to BINARY. Registered by dtc_discover_tests() (cmake/DtcLesson.cmake).
"""
import json
import os
import re
import subprocess
import sys

# "[  FAILED  ] Ranks/L08Ops.X/4ranks, where GetParam() = 4 (12 ms)": the name ends at a space or
# a comma (GoogleTest names hold neither).
RESULT = re.compile(r"^\[ +(OK|FAILED|SKIPPED) +\] ([^ ,]+)")
START = re.compile(r"^\[ RUN +\] (\S+)$")


def results_path(binary):
    return binary + ".results.json"


def stamp(binary):
    st = os.stat(binary)
    return [st.st_mtime_ns, st.st_size]


def run_once(binary, timeout):
    """Runs every case of BINARY in one process; writes each finished case's status and output."""
    path = results_path(binary)
    if os.path.exists(path):
        os.remove(path)
    if not os.access(binary, os.X_OK):
        print(f"gtest_once: {binary} is not built; build it (cmake --build <build>)", file=sys.stderr)
        return 2
    if os.environ.get("DTC_GTEST_ISOLATE"):
        print("gtest_once: DTC_GTEST_ISOLATE is set: every case runs in its own process")
        return 0
    before = stamp(binary)
    cases, current, lines = {}, None, []
    died = None
    proc = subprocess.Popen([binary, "--gtest_color=no"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        died = f"did not finish in {timeout} s"
    if died is None and proc.returncode not in (0, 1):
        died = f"died (exit status {proc.returncode})"
    for line in out.splitlines():
        m = START.match(line)
        if m:
            current, lines = m.group(1), [line]
            continue
        if current is not None:
            lines.append(line)
            r = RESULT.match(line)
            if r and r.group(2) == current:
                cases[current] = {"status": r.group(1), "output": "\n".join(lines)}
                current = None
    sys.stdout.write(out)
    if died:
        print(f"\ngtest_once: the test program {died} in {current or 'between cases'}; "
              f"the {current or 'unfinished'} case and those after it run each in its own "
              "process when their ctest entries run")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        # complete: the program ran to GoogleTest's closing line, so every case it selected has
        # its result here (scripts/mutants.py reads the reference's results on that condition)
        complete = died is None and any(line.startswith("[==========] ") and " ran." in line
                                        for line in out.splitlines())
        json.dump({"binary": before, "cases": cases, "complete": complete}, f)
    os.replace(tmp, path)
    return 0


def report(binary, args):
    """One case's ctest entry: its result from the run, or the case run alone."""
    binary = os.path.abspath(binary)
    name = next((a.split("=", 1)[1] for a in args if a.startswith("--gtest_filter=")), None)
    alone = [binary, *args]
    if name is None or os.environ.get("DTC_GTEST_ISOLATE"):
        os.execv(binary, alone)
    try:
        with open(results_path(binary)) as f:
            data = json.load(f)
        case = data["cases"][name] if data["binary"] == stamp(binary) else None
    except (OSError, ValueError, KeyError):
        case = None
    if case is None:
        print(f"gtest_once: no result of {name} from the program's single run: running it alone",
              flush=True)
        os.execv(binary, alone)
    output = case["output"]
    if case["status"] == "FAILED":
        # ctest takes any "[  SKIPPED ]" in a case's output for a skip (gtest_discover_tests'
        # SKIP_REGULAR_EXPRESSION), also a failed case's: a failure is never shown as a skip
        output = output.replace("[  SKIPPED ]", "[  skipped ]")
    print(output)
    return 1 if case["status"] == "FAILED" else 0


def main(argv):
    # One intra-op thread in every test process and each of its threads (test_main.cpp sets
    # LibTorch's count, but a thread-rank starts with OpenMP's and OpenBLAS's default of one
    # per core, whose idle workers spin): on 2 cores the light path's lesson 09 suite took 11 s
    # of system CPU with the default, 0.5 s with 1. A value of the caller's own is kept.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if len(argv) >= 2 and argv[0] == "run":
        timeout = 600
        if len(argv) >= 4 and argv[2] == "--timeout":
            timeout = int(argv[3])
        return run_once(os.path.abspath(argv[1]), timeout)
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    return report(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Checks that a learner test suite "bites": run on the untouched exercise, every test that
needs the learner's code fails because of a TODO, and every test of given code passes.

    scripts/check_bite.py --lesson L01 build/tests/lesson01_tests

Convention: a test suite whose name ends in "Given" tests code that the lesson gives in full
(validation, parsing); it must pass on the untouched exercise. Every other test must fail, and
its failure must mention the lesson's TODO marker: it failed loudly, on a stub, not by luck.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lesson", required=True, help="the TODO tag, e.g. L01")
    ap.add_argument("binary", help="the learner's GoogleTest binary")
    ap.add_argument("--timeout", type=int, default=240)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        try:
            run = subprocess.run([args.binary, f"--gtest_output=json:{report}"],
                                 capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"bite: {args.binary} did not finish in {args.timeout} s", file=sys.stderr)
            return 1
        if not os.path.exists(report):
            print(f"bite: {args.binary} wrote no report (exit {run.returncode}); it crashed?\n"
                  f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}", file=sys.stderr)
            return 1
        with open(report) as f:
            data = json.load(f)

    marker = f"TODO({args.lesson})"
    problems, todo_tests, given_tests = [], 0, 0
    for suite in data["testsuites"]:
        given = suite["name"].endswith("Given")
        for test in suite["testsuite"]:
            name = f"{suite['name']}.{test['name']}"
            if test.get("result") == "SKIPPED" or test.get("status") == "NOTRUN":
                problems.append(f"{name}: skipped on the untouched exercise")
                continue
            failures = test.get("failures", [])
            text = "\n".join(f.get("failure", "") for f in failures)
            if given:
                given_tests += 1
                if failures:
                    problems.append(f"{name}: tests given code but fails on the untouched "
                                    f"exercise:\n{text[:500]}")
            else:
                todo_tests += 1
                if not failures:
                    problems.append(f"{name}: passes on the untouched exercise (it does not "
                                    "bite: assert on the learner's results)")
                elif marker not in text:
                    problems.append(f"{name}: fails, but not on a {marker} stub:\n{text[:500]}")
    if todo_tests == 0:
        problems.append("no test exercises a TODO")
    for p in problems:
        print(f"bite: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"bite: {args.lesson}: all {todo_tests} TODO tests fail on the untouched exercise, "
          f"all {given_tests} tests of given code pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())

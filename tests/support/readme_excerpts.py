#!/usr/bin/env python3
"""A README's quoted runs of a program, checked against the program: every excerpt stays true.

    readme_excerpts.py README.md --program build/bin/lesson01_solution --as build/bin/lesson01

In each fenced block of README.md, a line "$ build/bin/lesson01 ARGS   # comment" is a run:
the program (--program, standing for the --as path the README writes) runs with ARGS, and every
non-empty line that follows it in the block, up to the next "$ " line or the end of the block,
must appear verbatim in what the run printed (stdout and stderr), except lines containing "..."
(elisions). Exit 0 when every excerpt holds, 1 otherwise (each stale line is printed), 2 when
the README quotes no run.
"""
import argparse
import pathlib
import re
import shlex
import subprocess
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("readme")
    ap.add_argument("--program", required=True)
    ap.add_argument("--as", dest="as_path", required=True)
    a = ap.parse_args()
    text = pathlib.Path(a.readme).read_text()
    runs = 0
    stale = 0
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if not line.startswith(f"$ {a.as_path} "):
                continue
            args = shlex.split(line[len(f"$ {a.as_path} "):].split("#")[0])
            quoted = []
            for nxt in lines[i + 1:]:
                if nxt.startswith("$ "):
                    break
                quoted.append(nxt)
            r = subprocess.run([a.program, *args], capture_output=True, text=True, timeout=120)
            out = r.stdout + r.stderr
            runs += 1
            missing = [q for q in quoted if q.strip() and "..." not in q and q.strip() not in out]
            print(f"{'ok  ' if not missing else 'FAIL'} {a.as_path} {' '.join(args)}")
            for q in missing:
                print(f"       README line not in the output: {q.strip()}")
            stale += len(missing)
    if runs == 0:
        print(f"readme_excerpts: {a.readme} quotes no run of {a.as_path}")
        return 2
    print(f"readme_excerpts: {runs} run(s), {stale} stale line(s)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

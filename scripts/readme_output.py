#!/usr/bin/env python3
"""Regenerates the program output that the lessons' READMEs quote, by running the programs.

A README marks each quoted run with a comment on the line before its fenced block:

    <!-- output: nproc=2 steps=2 from="Per rank" build/bin/lesson07_solution -->
    ```text
    ...replaced by this script...
    ```

  nproc=N      run under the venv's torchrun (--standalone --nproc_per_node=N --no_python);
               without it, the program runs as one process
  steps=K      keep the first K progress lines ("step 3/20 ...") and the last, with "..." between
  from="TEXT"  keep the output from the first line that contains TEXT

The program's stderr and stdout are quoted together, in order, with OMP_NUM_THREADS=1;
torchrun's own log lines are left out. The numbers are this machine's, measured now.

    scripts/readme_output.py [--build build] [--lessons 06 07] [--list]
    make readme-output              # every marked block of every lesson
"""
import argparse
import os
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARK = re.compile(r"^<!-- output: (.*) -->\s*$")
STEP = re.compile(r"^(\[rank \d+\] )?step +\d+/\d+ ")
TORCHRUN_LOG = re.compile(r"^[WIE]\d{4} |^\*+$")


def torchrun() -> str:
    """The venv's torchrun (scripts/paths.sh says where the venv lives)."""
    venv = subprocess.run(["bash", "-c", f"source {ROOT / 'scripts' / 'paths.sh'}; echo $DTC_VENV"],
                          capture_output=True, text=True).stdout.strip()
    path = pathlib.Path(venv) / "bin" / "torchrun"
    if not path.exists():
        raise SystemExit(f"readme_output: no {path}; run `make deps` first")
    return str(path)


def parse(spec: str):
    words = shlex.split(spec)
    opts = {}
    while words and re.match(r"^(nproc|steps|from)=", words[0]):
        key, value = words.pop(0).split("=", 1)
        opts[key] = value
    if not words:
        raise SystemExit(f"readme_output: no command in <!-- output: {spec} -->")
    return opts, words


def run(opts, command, build: pathlib.Path) -> str:
    program = command[0]
    if program.startswith("build/"):
        program = str(build / program[len("build/"):])
    cmd = [program, *command[1:]]
    if "nproc" in opts:
        cmd = [torchrun(), "--standalone", f"--nproc_per_node={opts['nproc']}", "--no_python", *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"readme_output: {' '.join(command)} exited {p.returncode}:\n"
                         f"{p.stdout[-3000:]}")
    lines = [l.rstrip() for l in p.stdout.splitlines() if not TORCHRUN_LOG.match(l)]
    if "from" in opts:
        start = next((i for i, l in enumerate(lines) if opts["from"] in l), None)
        if start is None:
            raise SystemExit(f"readme_output: no line of {' '.join(command)} contains "
                             f"{opts['from']!r}")
        lines = lines[start:]
    if "steps" in opts:
        keep = int(opts["steps"])
        steps = [i for i, l in enumerate(lines) if STEP.match(l)]
        if len(steps) > keep + 1:
            drop = set(steps[keep:-1])
            out = []
            for i, l in enumerate(lines):
                if i in drop:
                    if i == steps[keep]:
                        out.append("...")
                    continue
                out.append(l)
            lines = out
    # Blank lines inside stay; blank lines at either end go.
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines)


def regenerate(readme: pathlib.Path, build: pathlib.Path, list_only: bool) -> int:
    text = readme.read_text().split("\n")
    count = 0
    i = 0
    while i < len(text):
        m = MARK.match(text[i])
        if not m:
            i += 1
            continue
        opts, command = parse(m.group(1))
        j = i + 1
        while j < len(text) and not text[j].strip():
            j += 1
        if j >= len(text) or not text[j].startswith("```"):
            raise SystemExit(f"{readme}:{i + 1}: the marker must come right before a fenced block")
        end = j + 1
        while end < len(text) and not text[end].startswith("```"):
            end += 1
        if end >= len(text):
            raise SystemExit(f"{readme}:{j + 1}: the fenced block never closes")
        count += 1
        print(f"{readme.relative_to(ROOT)}:{i + 1}: {' '.join(command)}", flush=True)
        if not list_only:
            body = run(opts, command, build).split("\n")
            text[j + 1:end] = body
            end = j + 1 + len(body)
        i = end + 1
    if not list_only and count:
        readme.write_text("\n".join(text))
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build", help="the build directory (default: build)")
    ap.add_argument("--lessons", nargs="*", help="lesson numbers, e.g. 06 07 (default: all)")
    ap.add_argument("--list", action="store_true", help="list the marked blocks, run nothing")
    a = ap.parse_args()
    build = (ROOT / a.build).resolve()
    readmes = sorted(ROOT.glob("lessons/*/README.md"))
    if a.lessons:
        readmes = [r for r in readmes if r.parent.name[:2] in a.lessons]
    total = sum(regenerate(r, build, a.list) for r in readmes)
    print(f"readme_output: {total} block(s) {'listed' if a.list else 'regenerated'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

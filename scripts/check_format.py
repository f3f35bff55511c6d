#!/usr/bin/env python3
"""Checks (or, with --fix, applies) clang-format on the course's C++ sources, and that no line
is longer than 100 columns (clang-format leaves comments alone: ReflowComments is off).

Generated exercise files (lessons/NN_topic/X.cpp with a twin in solutions/) are checked but not
fixed: they are formatted through their solutions and scripts/exercises.py, which lays out its
DTC_TODO calls as clang-format does.

    scripts/check_format.py [--fix] [--clang-format PATH]
"""
import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIRS = ["common", "lessons", "solutions", "tests", "bench", "cmake"]
SUFFIXES = {".cpp", ".h", ".hpp", ".cc", ".cu"}


WIDTH = 100


def generated(p: pathlib.Path) -> bool:
    rel = p.relative_to(ROOT)
    return rel.parts[0] == "lessons" and (ROOT / "solutions" / rel.parts[1] / p.name).exists()


def sources(with_generated: bool = False):
    for d in DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.suffix not in SUFFIXES:
                continue
            if generated(p) and not with_generated:
                continue  # generated from its solution
            yield p


def long_lines(files):
    for p in files:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if len(line) > WIDTH:
                yield f"{p.relative_to(ROOT)}:{i}: {len(line)} columns (the limit is {WIDTH})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fix", action="store_true")
    ap.add_argument("--clang-format", default="clang-format")
    args = ap.parse_args()
    if args.fix:
        subprocess.run([args.clang_format, "-i", *[str(p) for p in sources()]], check=True)
        return 0
    paths = list(sources(with_generated=True))
    files = [str(p) for p in paths]
    r = subprocess.run([args.clang_format, "--dry-run", "--Werror", *files],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-6000:])
        print("HINT: run `make format` to apply the course's style (.clang-format); for an "
              "exercise file, format its solution and run `make exercises`.", file=sys.stderr)
        return 1
    long = list(long_lines(paths))
    if long:
        sys.stderr.write("\n".join(long[:40]) + "\n")
        print(f"HINT: {len(long)} line(s) over {WIDTH} columns: wrap them (clang-format does not "
              "reflow comments); for an exercise file, wrap its solution and run `make exercises`.",
              file=sys.stderr)
        return 1
    print(f"format: {len(files)} files as clang-format leaves them, none over {WIDTH} columns")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Checks (or, with --fix, applies) clang-format on the course's hand-written C++ sources.

Generated exercise files (lessons/NN_topic/X.cpp with a twin in solutions/) are skipped: they
are formatted through their solutions.

    scripts/check_format.py [--fix] [--clang-format PATH]
"""
import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIRS = ["common", "lessons", "solutions", "tests", "bench", "cmake"]
SUFFIXES = {".cpp", ".h", ".hpp", ".cc", ".cu"}


def sources():
    for d in DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.suffix not in SUFFIXES:
                continue
            rel = p.relative_to(ROOT)
            if rel.parts[0] == "lessons" and (ROOT / "solutions" / rel.parts[1] / p.name).exists():
                continue  # generated from its solution
            yield p


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fix", action="store_true")
    ap.add_argument("--clang-format", default="clang-format")
    args = ap.parse_args()
    files = [str(p) for p in sources()]
    if args.fix:
        subprocess.run([args.clang_format, "-i", *files], check=True)
        return 0
    r = subprocess.run([args.clang_format, "--dry-run", "--Werror", *files],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-6000:])
        print("HINT: run `make format` to apply the course's style (.clang-format).",
              file=sys.stderr)
        return 1
    print(f"format: {len(files)} files as clang-format leaves them")
    return 0


if __name__ == "__main__":
    sys.exit(main())

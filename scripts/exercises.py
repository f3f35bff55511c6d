#!/usr/bin/env python3
"""Generates the learners' exercise files from the reference solutions, and checks them.

The solution is the source. In solutions/NN_topic/*.cpp, each region

    // BEGIN SOLUTION: one-line hint, written as an instruction
    //   (optional continuation lines of the hint, indented after the //)
    ...reference code...
    // END SOLUTION

becomes, in lessons/NN_topic/*.cpp,

    // TODO(LNN)
    DTC_TODO("LNN", "one-line hint, written as an instruction (continued)");

(the hint written once, in the call: its message is what a test that reaches it prints; a long
one is split into string literals within 100 columns, as clang-format lays them out)

which throws at run time, so an untouched exercise fails its tests loudly. Everything outside
the regions is copied as it is. The last line of a generated file records a checksum of its
content, so the generator can tell a learner's edits from its own output.

    scripts/exercises.py generate [--force] [NN ...]   write the exercises (refuses to overwrite
                                                       an edited one without --force)
    scripts/exercises.py check                         exercises == a fresh generation?
    scripts/exercises.py selftest                      the overwrite guard, on a scratch copy
"""
import argparse
import hashlib
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".cpp", ".cc", ".h", ".hpp"}
BEGIN = re.compile(r"^(?P<indent>\s*)// BEGIN SOLUTION(?::\s*(?P<hint>.*))?$")
END = re.compile(r"^\s*// END SOLUTION\s*$")
CONTINUATION = re.compile(r"^\s*//\s{2,}(?P<text>\S.*)$")
# The trailer: "// generated from SRC; checksum SUM" (within 100 columns for a path of up to 55
# characters); the older "// exercise generated from SRC by scripts/exercises.py; checksum SUM" is
# still read.
CHECKSUM = re.compile(r"^// (?:exercise )?generated from (?P<src>\S+)(?: by scripts/exercises\.py)?; "
                      r"checksum (?P<sum>[0-9a-f]{16})$")


class ExerciseError(Exception):
    pass


def checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def lesson_tag(path: pathlib.Path) -> str:
    m = re.match(r"(\d\d)_", path.parent.name)
    if not m:
        raise ExerciseError(f"{path}: the lesson folder must be named NN_topic")
    return f"L{m.group(1)}"


def c_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


WIDTH = 100  # .clang-format's ColumnLimit


def todo_call(indent: str, tag: str, hint_lines):
    """The DTC_TODO call that carries the hint, the one place it is written, as clang-format lays
    it out: on one line when it fits in WIDTH columns, else one string literal per line of the
    solution's hint (a line too long for WIDTH split at spaces), aligned after the open
    parenthesis."""
    one = f'{indent}DTC_TODO("{tag}", "{c_string(" ".join(hint_lines))}");'
    if len(one) <= WIDTH:
        return [one]
    pad = indent + " " * len("DTC_TODO(")
    room = WIDTH - len(pad) - 4  # two quotes, and ");" after the last piece
    pieces = []
    for k, line in enumerate(hint_lines):
        text = c_string(line) + (" " if k + 1 < len(hint_lines) else "")
        current = ""
        for word in text.rstrip(" ").split(" "):
            candidate = word if not current else current + " " + word
            if current and len(candidate) + 1 > room:  # + 1: the space the piece keeps
                pieces.append(current + " ")
                current = word
            else:
                current = candidate
        pieces.append(current + (" " if text.endswith(" ") else ""))
    lines = [f'{indent}DTC_TODO("{tag}",']
    lines += [f'{pad}"{piece}"' for piece in pieces]
    lines[-1] += ");"
    return lines


def transform(src: pathlib.Path, root: pathlib.Path) -> str:
    """The exercise text for one solution file (checksum line included)."""
    tag = lesson_tag(src)
    lines = src.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if not m:
            if END.match(lines[i]):
                raise ExerciseError(f"{src}:{i + 1}: END SOLUTION without BEGIN SOLUTION")
            out.append(lines[i])
            i += 1
            continue
        start = i
        indent = m.group("indent")
        hint_lines = [(m.group("hint") or "").strip()]
        i += 1
        while i < len(lines) and CONTINUATION.match(lines[i]) and hint_lines[0]:
            hint_lines.append(CONTINUATION.match(lines[i]).group("text").strip())
            i += 1
        if not hint_lines[0]:
            raise ExerciseError(f"{src}:{start + 1}: BEGIN SOLUTION needs a hint: "
                                "'// BEGIN SOLUTION: what to do, as an instruction'")
        while i < len(lines) and not END.match(lines[i]):
            if BEGIN.match(lines[i]):
                raise ExerciseError(f"{src}:{i + 1}: nested BEGIN SOLUTION (the one at line "
                                    f"{start + 1} is not closed)")
            i += 1
        if i == len(lines):
            raise ExerciseError(f"{src}:{start + 1}: BEGIN SOLUTION is never closed by "
                                "'// END SOLUTION'")
        i += 1  # skip END
        out.append(f"{indent}// TODO({tag})")
        out.extend(todo_call(indent, tag, hint_lines))
    body = "\n".join(out) + "\n"
    rel = src.relative_to(root).as_posix()
    return body + f"// generated from {rel}; checksum {checksum(body)}\n"


def pairs(root: pathlib.Path, lessons=None):
    """(solution file, exercise file) for every solution source."""
    found = []
    for src in sorted((root / "solutions").glob("*/*")):
        if src.suffix not in SOURCE_SUFFIXES:
            continue
        if lessons and src.parent.name[:2] not in lessons:
            continue
        found.append((src, root / "lessons" / src.parent.name / src.name))
    return found


def edited(dst: pathlib.Path) -> bool:
    """True when dst is not exactly what the generator last wrote (a learner changed it)."""
    text = dst.read_text()
    body, _, last = text.rstrip("\n").rpartition("\n")
    m = CHECKSUM.match(last)
    return not m or checksum(body + "\n") != m.group("sum")


def generate(root: pathlib.Path, force: bool, lessons) -> int:
    refused = []
    for src, dst in pairs(root, lessons):
        text = transform(src, root)
        if dst.exists():
            if dst.read_text() == text:
                continue
            if edited(dst) and not force:
                refused.append(dst)
                continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)
        print(f"wrote {dst.relative_to(root)}")
    if refused:
        for dst in refused:
            print(f"refused: {dst.relative_to(root)} has your edits; it was left as it is",
                  file=sys.stderr)
        print("HINT: to replace your work with fresh TODOs anyway, run "
              "`scripts/exercises.py generate --force` (or `make exercises FORCE=1`); "
              "save a copy first.", file=sys.stderr)
        return 1
    return 0


def check(root: pathlib.Path) -> int:
    problems = []
    all_pairs = pairs(root)
    for src, dst in all_pairs:
        if not dst.exists():
            problems.append(f"{dst.relative_to(root)} is missing")
        elif dst.read_text() != transform(src, root):
            why = ("edited by hand (its checksum does not match)" if edited(dst)
                   else f"out of date with {src.relative_to(root)}")
            problems.append(f"{dst.relative_to(root)} is {why}")
        elif "DTC_TODO" not in dst.read_text():
            problems.append(f"{src.relative_to(root)} has no BEGIN SOLUTION region: "
                            "nothing for the learner to do")
    for problem in problems:
        print(f"exercise drift: {problem}", file=sys.stderr)
    if problems:
        print("HINT: regenerate with `make exercises` and commit the result.", file=sys.stderr)
        return 1
    print(f"exercises in sync: {len(all_pairs)} file(s)")
    return 0


def selftest() -> int:
    """Runs the generator on a scratch copy: it must refuse to overwrite an edited exercise."""
    with tempfile.TemporaryDirectory() as tmp:
        scratch = pathlib.Path(tmp)
        for part in ("lessons", "solutions", "scripts"):
            shutil.copytree(ROOT / part, scratch / part)
        cmd = [sys.executable, str(scratch / "scripts" / "exercises.py")]
        src, dst = pairs(scratch)[0]
        fresh = dst.read_text()

        def run(*args):
            return subprocess.run(cmd + list(args), capture_output=True, text=True)

        failures = []
        if run("check").returncode != 0:
            failures.append("check fails on the pristine copy")
        work = fresh.replace("DTC_TODO(", "/* learner's work */ DTC_TODO(", 1)
        dst.write_text(work)
        r = run("generate")
        if r.returncode == 0 or dst.read_text() != work:
            failures.append("generate overwrote an edited exercise without --force")
        if "refused" not in r.stderr or "--force" not in r.stderr:
            failures.append(f"generate's refusal does not say what to do: {r.stderr!r}")
        if run("check").returncode == 0:
            failures.append("check passes on an edited exercise")
        r = run("generate", "--force")
        if r.returncode != 0 or dst.read_text() != fresh:
            failures.append("generate --force did not restore the exercise")
        # A solution change regenerates an untouched exercise without --force.
        src.write_text(src.read_text() + "\n// a new line in the solution\n")
        r = run("generate")
        if r.returncode != 0 or "a new line in the solution" not in dst.read_text():
            failures.append("generate did not update an untouched exercise after a solution "
                            "change")
    for f in failures:
        print(f"selftest: FAIL: {f}", file=sys.stderr)
    if not failures:
        print("selftest: the generator refuses to overwrite edits, --force restores, "
              "untouched exercises follow their solutions")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write lessons/ from solutions/")
    g.add_argument("--force", action="store_true", help="overwrite exercises with edits")
    g.add_argument("lessons", nargs="*", help="lesson numbers, e.g. 01 (default: all)")
    sub.add_parser("check", help="fail if an exercise differs from a fresh generation")
    sub.add_parser("selftest", help="test the overwrite guard on a scratch copy")
    args = parser.parse_args()
    try:
        if args.cmd == "generate":
            return generate(ROOT, args.force, set(args.lessons))
        if args.cmd == "check":
            return check(ROOT)
        return selftest()
    except ExerciseError as e:
        print(f"exercises.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

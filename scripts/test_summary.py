#!/usr/bin/env python3
"""The learner's summary of a lesson's unit tests: what passes, part by part, and what to do next.

    scripts/test_summary.py RESULTS.json LESSON_DIR NN
    scripts/test_summary.py --selftest                  (ctest course.test_summary)

RESULTS.json is GoogleTest's --gtest_output=json of the lesson's test program; LESSON_DIR the
exercise (lessons/NN_topic). The parts are the TODO(LNN) regions of the reference solution
(solutions/NN_topic; the exercise's own TODOs where there is none), so that a part stays in the
table once its TODO is written: its function, and the tests its text names ("Tests: L02Mixed.*"
or "(L07Stages.*; hints ...)"). Printed after the test program's own output
(scripts/run-unit-tests.sh, `make test-lessonNN`):

    lesson 01: 32 of 67 tests pass
      ledger.cpp    count_params       6/6   done
      ledger.cpp    bytes_per_param    3/5   failing: L01Bytes.MixedAdamIs16: Expected ...
      strategy.cpp  collective_bytes   0/1   TODO: not written yet
      ...
    next: collective_bytes (01_memory_ledger/strategy.cpp:193), hints: the lesson's README
      what must hold: return what each of n ranks sends: ...

A part is "TODO: not written yet" while its DTC_TODO is in the exercise or a test reports it not
done; "waits for" another part when its tests fail only on that part's TODO; "done" when every
test it names passes; "failing" otherwise, with the first failure's message (the "got X,
expected Y" the tests print). Tests no part names (the given code's) count in the total only.
Exit 0 always: the test program's exit status is the verdict.
"""
import fnmatch
import json
import pathlib
import re
import sys

TODO = re.compile(r'DTC_TODO\("L(\d\d)",((?:\s*"(?:[^"\\]|\\.)*")+)\s*\)', re.S)
# The reference solution's regions (scripts/exercises.py): "// BEGIN SOLUTION: what must hold"
# and its continuation lines, the text each exercise's DTC_TODO carries.
BEGIN = re.compile(r"^[ \t]*// BEGIN SOLUTION: (.*(?:\n[ \t]*//   .*)*)", re.M)
# A function's definition starts at column 0 in the course's code (a member of a local struct,
# at column 2): its name is the identifier before the first "(" of that line.
DEFINITION = re.compile(r"^( {0,2})(?:(?:static|inline|virtual|constexpr)\s+)*[A-Za-z_][\w:<>,*&\s]*?"
                        r"\b([A-Za-z_~][\w:~]*)\s*\(")
STRUCT = re.compile(r"^(?:struct|class)\s+(\w+)")
KEYWORDS = {"if", "for", "while", "switch", "return", "catch", "sizeof", "DTC_TODO"}
# What dtc::todo throws (common/src/todo.cpp): "TODO(LNN) not done yet: <signature>\n  at F:L".
NOT_DONE = re.compile(r"TODO\(L\d\d\) not done yet: (.*?)\n\s*at (\S+):(\d+)")
# The tests a TODO names: "Tests: L01Params.*; ..." or "(L07Stages.*, L07Bf16.*; hints ...)".
TEST_NAME = re.compile(r"\bL\d\d[A-Za-z]\w*(?:\.[\w*/]*|\*)?")


def function_before(text: str, at: int) -> str:
    lines = text[:at].splitlines()
    for i in range(len(lines) - 1, -1, -1):
        before = lines[i]
        d = DEFINITION.match(before)
        if not d or d.group(2) in KEYWORDS or before.lstrip().startswith(("//", "#", "}")):
            continue
        if "=" in before.split("(", 1)[0] or before.rstrip().endswith(";"):
            continue
        if not d.group(1):
            return d.group(2)
        for above in reversed(lines[:i]):  # a member: its struct's name
            s = STRUCT.match(above)
            if s:
                return f"{s.group(1)}::{d.group(2)}"
        return d.group(2)
    return "?"


def short(name: str) -> str:
    return name.split("::")[-1]


def tests_named(message: str):
    return [n if ("." in n or n.endswith("*")) else n + ".*" for n in TEST_NAME.findall(message)]


def regions(folder: pathlib.Path, nn: str, solution: bool):
    """Every TODO(LNN) of the folder's .cpp files, in file order: dicts with file, line, last,
    function, ordinal (among the file's regions of that function), message, tests."""
    out = []
    for path in sorted(folder.glob("*.cpp")):
        text = path.read_text()
        seen = {}
        for m in (BEGIN if solution else TODO).finditer(text):
            if solution:
                message = " ".join(s.strip().lstrip("/").strip() for s in m.group(1).splitlines())
            else:
                if m.group(1) != nn:
                    continue
                message = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(2))).replace('\\"', '"')
            function = function_before(text, m.start())
            k = (path.name, short(function))
            seen[k] = seen.get(k, 0) + 1
            line = text.count("\n", 0, m.start()) + 1
            out.append({"file": path.name, "line": line, "last": line + m.group(0).count("\n"),
                        "function": function, "ordinal": seen[k], "message": message,
                        "tests": tests_named(message)})
    return out


def bare(name: str) -> str:
    """A test's name without a parameterised suite's prefix or parameter: Ranks/L08Ops.X/4 ->
    L08Ops.X."""
    suite, _, test = name.partition(".")
    return suite.split("/")[-1] + "." + test.split("/")[0]


def pending_todos(message: str):
    """The (file name, line) of every not-done TODO a failure message reports."""
    return [(pathlib.Path(f).name, int(n)) for _, f, n in NOT_DONE.findall(message)]


def main(argv) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 0
    try:
        results = json.loads(pathlib.Path(argv[0]).read_text())
    except (OSError, ValueError):
        return 0  # no results (a crash): the program's own output says what happened
    nn = argv[2]
    tests = {}  # full name: (passed, first failure's message)
    for suite in results.get("testsuites", []):
        for t in suite.get("testsuite", []):
            if t.get("result") in ("SKIPPED", "SUPPRESSED") or t.get("status") == "NOTRUN":
                continue
            failures = t.get("failures", [])
            tests[f"{suite['name']}.{t['name']}"] = (not failures,
                                                     failures[0]["failure"] if failures else "")
    if not tests:
        return 0
    lesson_dir = pathlib.Path(argv[1])
    # The parts: the reference solution's regions where the course has them (a part stays in the
    # table once its TODO is written and removed), else the exercise's TODOs.
    solution_dir = lesson_dir.parent.parent / "solutions" / lesson_dir.name
    parts = regions(solution_dir, nn, True) if solution_dir.is_dir() else []
    learner = regions(lesson_dir, nn, False)
    if not parts:
        parts = learner
    key = lambda r: (r["file"], short(r["function"]), r["ordinal"])
    index = {key(r): k for k, r in enumerate(parts)}
    where = {key(r): r for r in learner}  # the learner's TODOs still in place

    def which(file_line):
        """The part of the learner's TODO whose DTC_TODO call spans this (file, line)."""
        f, n = file_line
        for r in learner:
            if r["file"] == f and r["line"] <= n <= r["last"]:
                return index.get(key(r))
        return None

    reported = set()  # the parts some failure reports as not done yet
    for _, msg in tests.values():
        for fl in pending_todos(msg):
            k = which(fl)
            if k is not None:
                reported.add(k)
    passed = sum(1 for ok, _ in tests.values() if ok)
    print(f"\nlesson {nn}: {passed} of {len(tests)} tests pass")
    width = max([len(r["function"]) for r in parts] + [8])
    fwidth = max([len(r["file"]) for r in parts] + [8]) + 2
    nxt = None
    for k, part in enumerate(parts):
        mine = {n: r for n, r in tests.items()
                if any(fnmatch.fnmatch(bare(n), p) or fnmatch.fnmatch(n, p) or
                       fnmatch.fnmatch(n, "*/" + p) for p in part["tests"])}
        ok = sum(1 for good, _ in mine.values() if good)
        failing = [(n, msg) for n, (good, msg) in mine.items() if not good]
        if k in reported or key(part) in where:
            status = "TODO: not written yet"
            if nxt is None:
                nxt = where.get(key(part), part)
        elif mine and not failing:
            status = "done"
        elif failing and all(pending_todos(msg) for _, msg in failing):
            others = sorted({short(parts[j]["function"]) for _, msg in failing
                             for fl in pending_todos(msg) if (j := which(fl)) is not None})
            status = "waits for " + (", ".join(others) if others else "other TODOs")
        elif failing:
            name, msg = next((n, m) for n, m in failing if not pending_todos(m))
            lines = [s.strip() for s in msg.splitlines() if s.strip()]
            status = f"failing: {name}: " + " | ".join(lines[1:4] if len(lines) > 1 else lines)
        else:
            status = "(no test of it ran)"
        print(f"  {part['file']:<{fwidth}}{part['function']:<{width}}  {ok:>3}/{len(mine):<3} {status}"[:300])
    if nxt is not None:
        message = nxt["message"]
        hint = re.search(r"hints?:? ([^;)]*)|(README [^;)]*)", message)
        hint = (hint.group(1) or hint.group(2)).strip() if hint else "the lesson's README"
        what = re.split(r"\s*(?:Tests:|\(L\d\d)", message, maxsplit=1)[0].strip().rstrip(".")
        print(f"next: {nxt['function']} ({lesson_dir.name}/{nxt['file']}:{nxt['line']}), "
              f"hints: {hint}\n  what must hold: {what}")
    elif passed < len(tests):
        print("next: every TODO is written; fix the first failing part above (its test's "
              "message says what it got and what it expected)")
    return 0


def selftest() -> int:
    """A made-up lesson 99 (its solution's regions, an exercise with one TODO written, one written
    wrong, one not yet written) and its results: the summary must say so, part by part."""
    import contextlib
    import io
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "solutions" / "99_demo").mkdir(parents=True)
        (root / "lessons" / "99_demo").mkdir(parents=True)
        (root / "solutions" / "99_demo" / "demo.cpp").write_text(
            "int add(int a, int b) {\n  // BEGIN SOLUTION: the sum (Tests: L99Add.*; hints: README\n"
            "  //   section 2)\n  return a + b;\n  // END SOLUTION\n}\n\n"
            "int mul(int a, int b) {\n  // BEGIN SOLUTION: the product (L99Mul.*; README section 3)\n"
            "  return a * b;\n  // END SOLUTION\n}\n\n"
            "struct Fn {\n  static int neg(int a) {\n    // BEGIN SOLUTION: minus a (L99Neg.*; hints: "
            "README section 4)\n    return -a;\n    // END SOLUTION\n  }\n};\n")
        exercise = ("int add(int a, int b) { return a + b; }\n\n"
                    "int mul(int a, int b) { return a + b; }\n\n"
                    "struct Fn {\n  static int neg(int a) {\n"
                    "    DTC_TODO(\"L99\", \"minus a (L99Neg.*; hints: README section 4)\");\n  }\n};\n")
        (root / "lessons" / "99_demo" / "demo.cpp").write_text(exercise)
        todo_line = exercise.splitlines().index(
            '    DTC_TODO("L99", "minus a (L99Neg.*; hints: README section 4)");') + 1
        results = {"testsuites": [
            {"name": "L99Add", "testsuite": [{"name": "Small", "result": "COMPLETED"}]},
            {"name": "L99Mul", "testsuite": [{"name": "Two", "failures": [
                {"failure": "demo_test.cpp:9\nExpected equality of these values:\n  mul(2, 3)\n"
                            "    Which is: 5\n  6"}]}]},
            {"name": "Ranks/L99Neg", "testsuite": [{"name": "One/2", "failures": [
                {"failure": "unknown file\nC++ exception with description \"TODO(L99) not done "
                            "yet: static int Fn::neg(int)\n  at ../lessons/99_demo/demo.cpp:"
                            f"{todo_line}\n  HINT: minus a\" thrown in the test body."}]}]}]}
        (root / "r.json").write_text(json.dumps(results))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main([str(root / "r.json"), str(root / "lessons" / "99_demo"), "99"])
    text = out.getvalue()
    want = ["lesson 99: 1 of 3 tests pass",
            r"demo\.cpp\s+add\s+1/1\s+done",
            r"demo\.cpp\s+mul\s+0/1\s+failing: L99Mul\.Two: Expected equality of these values:"
            r" \| mul\(2, 3\) \| Which is: 5",
            r"demo\.cpp\s+Fn::neg\s+0/1\s+TODO: not written yet",
            rf"next: Fn::neg \(99_demo/demo\.cpp:{todo_line}\), hints: README section 4",
            r"what must hold: minus a$"]
    missing = [w for w in want if not re.search(w, text, re.M)]
    if missing:
        print(text + "\ntest_summary selftest: missing " + "; ".join(missing), file=sys.stderr)
        return 1
    print("test_summary selftest: every part as expected")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--selftest"]:
        sys.exit(selftest())
    sys.exit(main(sys.argv[1:]))

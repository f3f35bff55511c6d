#!/usr/bin/env python3
"""Grades a learner's submission with the course's own tests.

    scripts/grade.py SUBMISSION [--out grade] [--build build-grade] [--lessons 01 02 ...]
    make grade SUBMISSION=path/to/their/lessons [LESSONS="03 06"]   (default: lessons/, all)
    scripts/grade.py --write-points BUILD   (instructors: after changing a test suite)
    scripts/grade.py --check-points BUILD   (ctest grade.points: is tests/points.json current?)

SUBMISSION is a copy of lessons/. Only the exercise files are taken from it (the files that
have a twin in solutions/); the contract headers, the programs and the tests are the course's
own, so a learner cannot pass by editing a test (the nbgrader principle). A lesson missing from
the submission is graded on the untouched exercise.

Each lesson is built and run on its own: a compile error, a crash or a hang (killed after
--timeout seconds) costs that lesson's points and nothing else. Points: one per test of the
learner's code (suites not named ...Given); tests of given code are not scored; and one per
end-to-end run of the learner's program (ctest label e2e), run once the unit tests have run.
The points available come from tests/points.json (the reference solution's tests, kept current
by ctest grade.points), so grading builds the learner's code only. Progress and the time of each
lesson are printed as grading goes.

Writes, under --out: submission/ (what was graded), lessonNN.xml (JUnit XML, one per lesson),
summary.md, summary.html and summary.json. Exits 0 when grading finished, whatever the score.
"""
import argparse
import html
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
POINTS = ROOT / "tests" / "points.json"


def lessons_in_course():
    return sorted(p.name for p in (ROOT / "solutions").iterdir() if re.match(r"\d\d_", p.name))


def stage(submission: pathlib.Path, staged: pathlib.Path, notes: dict):
    """Copies the exercise files from the submission, falling back to the untouched ones. A file
    already staged with the same content is left as it is (its objects stay built); anything
    else in the folder is removed."""
    wanted = {}
    for lesson in lessons_in_course():
        for sol in sorted((ROOT / "solutions" / lesson).iterdir()):
            theirs = submission / lesson / sol.name
            if theirs.is_file():
                wanted[staged / lesson / sol.name] = theirs
            else:
                wanted[staged / lesson / sol.name] = ROOT / "lessons" / lesson / sol.name
                notes.setdefault(lesson[:2], []).append(f"{sol.name} not submitted: untouched exercise")
    if staged.exists():
        for path in sorted(staged.rglob("*"), reverse=True):
            if path in wanted:
                continue
            if path.is_dir() and not path.is_symlink():
                if not any(w.is_relative_to(path) for w in wanted):
                    shutil.rmtree(path)
            else:
                path.unlink()
    for dst, src in wanted.items():
        dst.parent.mkdir(parents=True, exist_ok=True)
        data = src.read_bytes()
        if not dst.is_file() or dst.is_symlink() or dst.read_bytes() != data:
            dst.unlink(missing_ok=True)
            dst.write_bytes(data)


def configured(build: pathlib.Path, options) -> bool:
    """True when build/ was configured by grade.py with these -D options already: its
    build.ninja then re-runs CMake by itself when a CMake file or a globbed folder changed."""
    cache = build / "CMakeCache.txt"
    if not (cache.is_file() and (build / "build.ninja").is_file()):
        return False
    text = cache.read_text(errors="replace")
    for option in [f"-DCMAKE_HOME_DIRECTORY={ROOT}", *options]:
        name, value = option[2:].split("=", 1)
        m = re.search(rf"^{re.escape(name)}:[A-Z]+=(.*)$", text, re.M)
        if not m or m.group(1) != value:
            return False
    return True


def run(cmd, timeout=None, **kw):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        return e


def list_tests(binary: pathlib.Path):
    r = run([str(binary), "--gtest_list_tests"], timeout=60)
    tests, suite = [], None
    if isinstance(r, subprocess.TimeoutExpired) or r.returncode != 0:
        return tests
    for line in r.stdout.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            suite = line.strip().rstrip(".")
        else:
            tests.append((suite, line.strip().split()[0]))
    return tests


def scored(tests):
    return [t for t in tests if not t[0].endswith("Given")]


def failure_xml(path: pathlib.Path, lesson: str, tests, reason: str):
    """A JUnit file for a lesson that could not run: every scored test fails with the reason."""
    suites = ET.Element("testsuites", name=f"lesson{lesson}", tests=str(len(tests)),
                        failures=str(len(tests)))
    suite = ET.SubElement(suites, "testsuite", name=f"lesson{lesson}", tests=str(len(tests)),
                          failures=str(len(tests)))
    for s, t in tests:
        case = ET.SubElement(suite, "testcase", classname=s, name=t)
        ET.SubElement(case, "failure", message=reason).text = reason
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def points_of(nn: str, build: pathlib.Path, jobs: str):
    """The scored tests of lesson nn: tests/points.json, else (a lesson not in it) the list of
    the solution's test binary, built for it."""
    if POINTS.exists():
        points = json.loads(POINTS.read_text())
        if nn in points:
            return [tuple(name.split(".", 1)) for name in points[nn]]
    print(f"lesson{nn}: not in {POINTS.name}: building the solution's tests to count the points",
          flush=True)
    run(["cmake", "--build", str(build), "-j", jobs, "--target", f"lesson{nn}_solution_tests"])
    return scored(list_tests(build / "tests" / f"lesson{nn}_solution_tests"))


def solution_points(build: pathlib.Path):
    """{NN: [Suite.Test, ...]} from the solution test binaries of an existing build."""
    points = {}
    for lesson in lessons_in_course():
        binary = build / "tests" / f"lesson{lesson[:2]}_solution_tests"
        if binary.exists():
            points[lesson[:2]] = [f"{s}.{t}" for s, t in scored(list_tests(binary))]
    return points


def grade_lesson(nn: str, build: pathlib.Path, out: pathlib.Path, timeout: int, jobs: str,
                 fail_fast: bool = False):
    t0 = time.monotonic()
    result = _grade_lesson(nn, build, out, timeout, jobs, fail_fast)
    result["seconds"] = round(time.monotonic() - t0)
    print(f"lesson{nn}: {result['passed']} / {result['total']} points, {result['status']} "
          f"({result['seconds']} s)", flush=True)
    return result


def _grade_lesson(nn: str, build: pathlib.Path, out: pathlib.Path, timeout: int, jobs: str,
                  fail_fast: bool = False):
    """Builds and runs lesson nn's learner tests. fail_fast (scripts/mutants.py): stop at the
    first failing test, whose name goes to result["first_failure"]; the rest count as lost."""
    result = {"lesson": nn, "status": "ok", "passed": 0, "total": 0, "detail": ""}
    t0 = time.monotonic()
    # The points available: the reference solution's scored tests (tests/points.json).
    sol_tests = points_of(nn, build, jobs)
    e2e = list_e2e(nn, build)
    result["total"] = len(sol_tests) + len(e2e)
    xml_path = out / f"lesson{nn}.xml"
    print(f"lesson{nn}: building ...", end="", flush=True)
    r = run(["cmake", "--build", str(build), "-j", jobs, "--target", f"lesson{nn}_tests"])
    print(f" {'built' if r.returncode == 0 else 'does not compile'} ({time.monotonic() - t0:.0f} s)",
          flush=True)
    if r.returncode != 0:
        errors = [l for l in (r.stdout + r.stderr).splitlines() if "error" in l][:10]
        result.update(status="compile error", detail="\n".join(errors))
        failure_xml(xml_path, nn, sol_tests, "compile error:\n" + result["detail"])
        return result
    binary = build / "tests" / f"lesson{nn}_tests"
    if xml_path.exists():
        xml_path.unlink()
    r = run([str(binary), f"--gtest_output=xml:{xml_path}",
             *(["--gtest_fail_fast"] if fail_fast else [])], timeout=timeout)
    if isinstance(r, subprocess.TimeoutExpired):
        result.update(status="hang", detail=f"killed after {timeout} s")
        failure_xml(xml_path, nn, sol_tests, f"hang: the tests were killed after {timeout} s")
        return result
    if not xml_path.exists():
        result.update(status="crash", detail=f"exit code {r.returncode}\n{r.stderr[-1500:]}")
        failure_xml(xml_path, nn, sol_tests, "crash: " + result["detail"])
        return result
    root = ET.parse(xml_path).getroot()
    scored_names = {f"{s}.{t}" for s, t in sol_tests}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        if name in scored_names and case.find("failure") is None and case.get("result") != "skipped":
            result["passed"] += 1
        elif case.find("failure") is not None and "first_failure" not in result:
            result["first_failure"] = name
    grade_e2e(nn, build, result, jobs, xml_path, e2e,
              skip=fail_fast and result["passed"] < len(sol_tests))
    return result


E2E_LINE = re.compile(r"Test\s+#\d+: (\S+) \.*\s*(\**\s*)(Passed|Failed|Timeout|Not Run|\S+)")


def list_e2e(nn, build):
    """The learner-flavour end-to-end tests of lesson nn (ctest labels lessonNN-learner, e2e)."""
    listed = run(["ctest", "--test-dir", str(build), "-N", "-L", f"^lesson{nn}-learner$",
                  "-L", "^e2e$"])
    if isinstance(listed, subprocess.TimeoutExpired):
        return []
    return re.findall(r"Test\s+#\d+: (\S+)", listed.stdout)


def e2e_programs(nn, build):
    """The targets lesson nn's end-to-end runs need besides the learner's program: the course's
    programs their command lines name (lesson 02's reference, for its losses and parameters)."""
    shown = run(["ctest", "--test-dir", str(build), "--show-only=json-v1", "-L",
                 f"^lesson{nn}-learner$", "-L", "^e2e$"])
    if isinstance(shown, subprocess.TimeoutExpired) or shown.returncode != 0:
        return ["lesson02_solution"]
    bin_dir = str(build / "bin") + os.sep
    needed = set()
    for test in json.loads(shown.stdout).get("tests", []):
        for arg in test.get("command", []):
            for m in re.finditer(re.escape(bin_dir) + r"(lesson\d\d_solution)\b", arg):
                needed.add(m.group(1))
    return sorted(needed)


def grade_e2e(nn, build, result, jobs, xml_path, names, skip):
    """The learner's own program on real processes (ctest label e2e, learner flavour): one point
    each (counted in result["total"] already), scored after the unit tests, added to the
    lesson's JUnit file."""
    if not names:
        return
    outcome = {n: "not run: the unit tests failed first" for n in names}
    if not skip:
        # The learner's program, and the reference programs the runs compare with (lesson
        # 02's single-process losses and parameters), only those: lesson 01 needs no LibTorch.
        built = run(["cmake", "--build", str(build), "-j", jobs, "--target", f"lesson{nn}",
                     *e2e_programs(nn, build)])
        if built.returncode != 0:
            outcome = {n: "the program did not build" for n in names}
        else:
            r = run(["ctest", "--test-dir", str(build), "-L", f"^lesson{nn}-learner$", "-L",
                     "^e2e$", "-j", jobs, "--timeout", "240", "--output-on-failure"],
                    timeout=1800)
            text = r.stdout if not isinstance(r, subprocess.TimeoutExpired) else ""
            for m in E2E_LINE.finditer(text):
                if m.group(1) in outcome:
                    outcome[m.group(1)] = "passed" if m.group(3) == "Passed" else m.group(3).lower()
    tree = ET.parse(xml_path)
    suite = ET.SubElement(tree.getroot(), "testsuite", name=f"lesson{nn}.e2e",
                          tests=str(len(names)))
    for n in names:
        case = ET.SubElement(suite, "testcase", classname=f"lesson{nn}.e2e", name=n)
        if outcome[n] == "passed":
            result["passed"] += 1
        else:
            ET.SubElement(case, "failure", message=outcome[n]).text = outcome[n]
            result.setdefault("first_failure", n)
    tree.write(xml_path, encoding="utf-8", xml_declaration=True)


def write_summary(out: pathlib.Path, results, submission: str, notes: dict):
    total = sum(r["total"] for r in results)
    passed = sum(r["passed"] for r in results)
    rows = [(f"lesson{r['lesson']}", r["status"], f"{r['passed']} / {r['total']}",
             f"{r['passed']}", f"{r.get('seconds', '')}",
             "; ".join(notes.get(r["lesson"], []) + ([r["detail"].splitlines()[0]]
                                                     if r["detail"] else [])))
            for r in results]
    md = [f"# Grade of {submission}", "",
          "| lesson | status | tests passed / total | points | seconds | notes |",
          "|---|---|---|---|---|---|"]
    md += [f"| {a} | {b} | {c} | {d} | {e} | {f} |" for a, b, c, d, e, f in rows]
    md += [f"| **total** | | {passed} / {total} | **{passed}** | "
           f"{sum(r.get('seconds', 0) for r in results)} | |", ""]
    (out / "summary.md").write_text("\n".join(md))
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in row) + "</tr>"
                    for row in rows)
    (out / "summary.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>Grade</title>"
        "<style>body{font-family:sans-serif}td,th{border:1px solid #999;padding:4px 8px}"
        "table{border-collapse:collapse}</style>"
        f"<h1>Grade of {html.escape(submission)}</h1><table><tr><th>lesson</th><th>status</th>"
        f"<th>tests passed / total</th><th>points</th><th>seconds</th><th>notes</th></tr>{cells}"
        f"<tr><th>total</th><td></td><td>{passed} / {total}</td><th>{passed}</th><td></td>"
        "<td></td></tr>"
        "</table>")
    (out / "summary.json").write_text(json.dumps(
        {"submission": submission, "points": passed, "max_points": total, "lessons": results},
        indent=2))
    print("\n".join(md))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("submission", nargs="?", default=str(ROOT / "lessons"))
    ap.add_argument("--out", default=str(ROOT / "grade"))
    ap.add_argument("--build", default=str(ROOT / "build-grade"))
    ap.add_argument("--lessons", nargs="*", help="lesson numbers (default: all)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per lesson's tests")
    ap.add_argument("--torch-dir", help="a torch package directory (site-packages/torch) whose "
                    "LibTorch to build with; default: the one CMake finds (Debian's)")
    ap.add_argument("--write-points", metavar="BUILD",
                    help="write tests/points.json from BUILD's solution test binaries")
    ap.add_argument("--check-points", metavar="BUILD",
                    help="exit 1 when tests/points.json differs from BUILD's solution tests")
    args = ap.parse_args()
    if args.write_points or args.check_points:
        build = pathlib.Path(args.write_points or args.check_points).resolve()
        points = solution_points(build)
        if not points:
            print(f"grade.py: no solution test binary in {build}/tests", file=sys.stderr)
            return 2
        if args.write_points:
            POINTS.write_text(json.dumps(points, indent=1, sort_keys=True) + "\n")
            print(f"grade.py: wrote {POINTS} ({sum(map(len, points.values()))} points)")
            return 0
        have = json.loads(POINTS.read_text()) if POINTS.exists() else {}
        stale = sorted(nn for nn in points if have.get(nn) != points[nn])
        if stale:
            print(f"grade.py: {POINTS.relative_to(ROOT)} is not current for lesson(s) "
                  f"{' '.join(stale)}\nHINT: scripts/grade.py --write-points {build}", file=sys.stderr)
            return 1
        print(f"grade.py: {POINTS.name} matches the solution tests of {len(points)} lessons")
        return 0
    submission = pathlib.Path(args.submission).resolve()
    if not submission.is_dir():
        print(f"grade.py: {submission} is not a folder\nHINT: pass a copy of lessons/, "
              "e.g. make grade SUBMISSION=~/their-course/lessons", file=sys.stderr)
        return 2
    out, build = pathlib.Path(args.out).resolve(), pathlib.Path(args.build).resolve()
    out.mkdir(parents=True, exist_ok=True)
    notes = {}
    staged = out / "submission"
    stage(submission, staged, notes)
    jobs = str(os.cpu_count() or 2)
    prefix = []
    if args.torch_dir:  # as the Makefile does: CMake files and libraries of that torch
        prefix = [f"-DCMAKE_PREFIX_PATH={args.torch_dir}/share/cmake;{args.torch_dir}"]
    options = [f"-DDTC_SUBMISSION={staged}", *prefix]
    if configured(build, options):
        # A grading before this one configured the same: only what changed since is redone
        # (ninja's check of the CMake files and globs), and ctest's lists are current.
        r = run(["cmake", "--build", str(build), "--target", "build.ninja"])
    else:
        r = run(["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", *options])
    if r.returncode != 0:
        print(f"grade.py: configuring the course failed (not the submission's fault):\n"
              f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}", file=sys.stderr)
        return 1
    wanted = args.lessons or [l[:2] for l in lessons_in_course()]
    results = [grade_lesson(nn, build, out, args.timeout, jobs) for nn in wanted]
    write_summary(out, results, str(submission), notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

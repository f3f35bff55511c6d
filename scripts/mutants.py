#!/usr/bin/env python3
"""Mutation testing: each plausible learner mistake in the catalogue must lose points.

    scripts/mutants.py [--lessons 06 09] [--build build-mutants] [--list] [--only ID ...]
                       [--trust-reference]
    make mutants [LESSON=06]
    scripts/mutants.py --write-mutant NN ID DIR      (the build: DIR/<file>, the mutated file)
    scripts/mutants.py --check-built NN:ID:MUTANT_TESTS:SOLUTION_TESTS ...   (ctest mutants.subset)

The catalogue is tests/mutants/lessonNN.toml, one [[mutant]] table per mistake:

    [[mutant]]
    id = "no-average"                       # short, unique in the lesson
    file = "ddp.cpp"                        # an exercise file (its twin in solutions/NN_topic/)
    why = "sums the gradients and forgets to divide by W"   # the mistake, as a learner makes it
    find = '''grad.div_(world)'''           # text of the reference solution, exactly once,
    replace = '''grad'''                    # inside a BEGIN/END SOLUTION region
    killed_by = "L06Naive.*"                # optional: the test(s) that must catch it (fnmatch)

A mutant is the reference solution with one such edit. It is graded as a learner's submission
would be, by scripts/grade.py's own grade_lesson (the same build of the course's tests with
-DDTC_SUBMISSION, the same points): it is *killed* when it scores less than full marks (a test
fails, the build fails, it crashes or hangs), and *survives* when every scored test passes.
The unmutated solution is graded first and must score full marks. --trust-reference skips
that (for `make test`, whose solution suites grade the same code): each mutant must then name
its `killed_by` and be killed by such a test failing (its lesson built, its tests run to
the end), so that a broken build, a crash or a hang cannot pass for a kill.

The subset that `make test` runs (ctest mutants.subset, the list DTC_MUTANT_SUBSET in the top
CMakeLists.txt) is built inside the course's own build instead: each mutant's file is written by
--write-mutant, compiled into its own copy of the lesson's solution library and linked with the
lesson's test objects (the same objects as the solution suite's), and --check-built runs only
the mutant's killed_by tests: killed when they fail there (a failed test, not a crash or a
hang) and pass on the reference solution's test binary. The reference's results come from that
binary's one run in the same ctest run (tests/support/gtest_once.py's results, when the run
finished and was of this binary; otherwise its killed_by tests run here).

Prints one line per mutant, a table per lesson, and a last line `mutants: K killed of N`.
Exits 0 when every mutant is killed, 1 when one survives (or the catalogue does not apply to
the solution any more: a `find` that is not there exactly once, or outside the regions), 2 on
bad arguments.
"""
import argparse
import fnmatch
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "support"))
import grade  # noqa: E402  (the grader itself: the same build and the same points)
import gtest_once  # noqa: E402  (the results of a test program's one run in this ctest run)

CATALOGUE = ROOT / "tests" / "mutants"
REGION = re.compile(r"// BEGIN SOLUTION.*?// END SOLUTION", re.S)


class CatalogueError(Exception):
    pass


def lesson_dirs():
    return {p.name[:2]: p.name for p in (ROOT / "solutions").iterdir() if re.match(r"\d\d_", p.name)}


def load(nn: str, topic: str):
    path = CATALOGUE / f"lesson{nn}.toml"
    if not path.exists():
        return []
    data = tomllib.loads(path.read_text())
    mutants, seen = [], set()
    for i, m in enumerate(data.get("mutant", [])):
        where = f"{path.relative_to(ROOT)}: mutant {i + 1} ({m.get('id', '?')})"
        for key in ("id", "file", "why", "find", "replace"):
            if not isinstance(m.get(key), str):
                raise CatalogueError(f"{where}: '{key}' is missing or not a string")
        if m["id"] in seen:
            raise CatalogueError(f"{where}: the id '{m['id']}' is used twice")
        seen.add(m["id"])
        src = ROOT / "solutions" / topic / m["file"]
        if not src.is_file():
            raise CatalogueError(f"{where}: solutions/{topic}/{m['file']} does not exist")
        text = src.read_text()
        n = text.count(m["find"])
        if n != 1:
            raise CatalogueError(
                f"{where}: its 'find' text occurs {n} times in solutions/{topic}/{m['file']} "
                "(needs exactly 1)\nHINT: the solution changed: update the mutant's 'find' to "
                "the new code, keeping the mistake it stands for")
        start = text.index(m["find"])
        end = start + len(m["find"])
        if not any(r.start() <= start and end <= r.end() for r in REGION.finditer(text)):
            raise CatalogueError(f"{where}: its 'find' text is outside every BEGIN/END SOLUTION "
                                 "region: a mutant is a mistake in the learner's code")
        if "killed_by" in m and not isinstance(m["killed_by"], str):
            raise CatalogueError(f"{where}: 'killed_by' must be a string (a test name pattern)")
        if m["find"] == m["replace"]:
            raise CatalogueError(f"{where}: 'replace' equals 'find': not a mutant")
        mutants.append({**m, "lesson": nn, "topic": topic, "mutated": text.replace(m["find"], m["replace"])})
    return mutants


def stage_solutions(staged: pathlib.Path, topics):
    """The submission folder: every exercise file replaced by its reference solution."""
    for topic in topics:
        for sol in sorted((ROOT / "solutions" / topic).iterdir()):
            dst = staged / topic / sol.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists() or dst.read_text() != sol.read_text():
                shutil.copyfile(sol, dst)


def find_mutant(nn: str, mid: str):
    topics = lesson_dirs()
    if nn not in topics:
        raise CatalogueError(f"no lesson {nn}")
    for m in load(nn, topics[nn]):
        if m["id"] == mid:
            return m
    raise CatalogueError(f"no mutant '{mid}' in tests/mutants/lesson{nn}.toml\n"
                         "HINT: scripts/mutants.py --list shows the catalogue")


def write_mutant(nn: str, mid: str, out_dir: pathlib.Path) -> int:
    """Writes the mutated file into out_dir (untouched when it is current) and prints its name."""
    m = find_mutant(nn, mid)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / m["file"]
    if not target.exists() or target.read_text() != m["mutated"]:
        target.write_text(m["mutated"])
    print(m["file"])
    return 0


def run_filtered(binary: str, pattern: str, timeout: int):
    """Runs the tests of binary that match pattern; (status, failed test names, ran count)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        try:
            r = subprocess.run([binary, f"--gtest_filter={pattern}", f"--gtest_output=json:{report}"],
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "hang", [], 0
        if r.returncode not in (0, 1) or not report.exists():
            return f"crash (exit {r.returncode})", [], 0
        data = json.loads(report.read_text())
    ran, failed = 0, []
    for suite in data.get("testsuites", []):
        for t in suite.get("testsuite", []):
            if t.get("result") != "COMPLETED" or t.get("status") != "RUN":
                continue
            name = f"{suite['name']}.{t['name']}"
            if not fnmatch.fnmatchcase(name, pattern):
                continue
            ran += 1
            if t.get("failures"):
                failed.append(name)
    return "ok", failed, ran


def results_of_run(binary: str):
    """{case: status} of binary's one run in this ctest run (gtest_once.py, the solution suite's
    run_once entry, which mutants.subset requires), when that run finished and was of this very
    binary; else None."""
    try:
        with open(gtest_once.results_path(os.path.abspath(binary))) as f:
            data = json.load(f)
        if not data.get("complete") or data["binary"] != gtest_once.stamp(binary):
            return None
        return {name: case["status"] for name, case in data["cases"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def reference_filtered(binary: str, pattern: str, timeout: int, runs: dict):
    """run_filtered on the reference's test binary, from its run_once results where it has them
    (the same cases, already run: a test that ran and did not fail passed)."""
    if binary not in runs:
        runs[binary] = results_of_run(binary)
    results = runs[binary]
    if results is None:
        return run_filtered(binary, pattern, timeout)
    matching = [n for n in results if fnmatch.fnmatchcase(n, pattern)]
    return ("ok", [n for n in matching if results[n] == "FAILED"],
            sum(1 for n in matching if results[n] != "SKIPPED"))


def check_built(specs, timeout: int) -> int:
    """ctest mutants.subset: each built mutant's killed_by tests fail, and pass on the reference."""
    killed = 0
    runs = {}
    for spec in specs:
        try:
            nn, mid, mutant_bin, solution_bin = spec.split(":", 3)
            m = find_mutant(nn, mid)
        except (ValueError, CatalogueError) as e:
            print(f"mutants.py: --check-built {spec}: {e}", file=sys.stderr)
            return 2
        pattern = m.get("killed_by")
        if not pattern:
            print(f"mutants.py: {mid} has no killed_by\nHINT: add killed_by = \"Suite.*\" to its "
                  "catalogue entry", file=sys.stderr)
            return 2
        t0 = time.monotonic()
        status, failed, ran = run_filtered(mutant_bin, pattern, timeout)
        ref_status, ref_failed, ref_ran = reference_filtered(solution_bin, pattern, timeout, runs)
        if ref_status != "ok" or ref_failed or ref_ran == 0:
            how = (f"the reference fails its killing tests ({ref_status}, "
                   f"{len(ref_failed)} failed of {ref_ran} matching {pattern})")
            ok = False
        elif status != "ok":
            how, ok = f"not killed by {pattern}: {status}", False
        elif not failed:
            how, ok = f"SURVIVED: {ran} test(s) matching {pattern} pass", False
        else:
            how, ok = f"{len(failed)} of {ran} lost ({failed[0]})", True
        killed += ok
        print(f"  {'killed  ' if ok else 'NOT KILLED'} lesson{nn} {mid:28} {how}  "
              f"[{time.monotonic() - t0:.0f} s]", flush=True)
    print(f"mutants: {killed} killed of {len(specs)}")
    return 0 if killed == len(specs) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lessons", nargs="*", help="lesson numbers (default: every catalogue)")
    ap.add_argument("--build", default=str(ROOT / "build-mutants"))
    ap.add_argument("--timeout", type=int, default=180, help="seconds per mutant's tests")
    ap.add_argument("--torch-dir", help="as scripts/grade.py: the torch package to build with")
    ap.add_argument("--list", action="store_true", help="print the catalogue, grade nothing")
    ap.add_argument("--only", nargs="*", help="mutant ids to grade (default: all)")
    ap.add_argument("--trust-reference", action="store_true",
                    help="do not grade the reference solution first; each mutant must be "
                         "killed by a failing test that matches its killed_by")
    ap.add_argument("--write-mutant", nargs=3, metavar=("NN", "ID", "DIR"),
                    help="write mutant ID's file into DIR and print its name (the build uses it)")
    ap.add_argument("--check-built", nargs="+", metavar="NN:ID:MUTANT_TESTS:SOLUTION_TESTS",
                    help="run the killed_by tests of built mutants (ctest mutants.subset)")
    args = ap.parse_args()
    try:
        if args.write_mutant:
            nn, mid, out_dir = args.write_mutant
            return write_mutant(nn, mid, pathlib.Path(out_dir))
        if args.check_built:
            return check_built(args.check_built, args.timeout)
    except (CatalogueError, tomllib.TOMLDecodeError) as e:
        print(f"mutants.py: {e}", file=sys.stderr)
        return 1

    topics = lesson_dirs()
    wanted = args.lessons or sorted(p.stem[len("lesson"):] for p in CATALOGUE.glob("lesson*.toml"))
    for nn in wanted:
        if nn not in topics:
            print(f"mutants.py: no lesson {nn}\nHINT: lessons are {' '.join(sorted(topics))}",
                  file=sys.stderr)
            return 2
    try:
        catalogue = {nn: load(nn, topics[nn]) for nn in wanted}
    except (CatalogueError, tomllib.TOMLDecodeError) as e:
        print(f"mutants.py: {e}", file=sys.stderr)
        return 1
    if args.only:
        catalogue = {nn: [m for m in ms if m["id"] in args.only] for nn, ms in catalogue.items()}
        unknown = set(args.only) - {m["id"] for ms in catalogue.values() for m in ms}
        if unknown:
            print(f"mutants.py: no mutant {' '.join(sorted(unknown))} in lessons {' '.join(wanted)}"
                  "\nHINT: scripts/mutants.py --list shows the catalogue", file=sys.stderr)
            return 2
    if args.trust_reference:
        vague = [m["id"] for ms in catalogue.values() for m in ms if "killed_by" not in m]
        if vague:
            print(f"mutants.py: --trust-reference needs killed_by on {' '.join(vague)}\nHINT: add "
                  "killed_by = \"Suite.*\" to those catalogue entries, or grade the reference "
                  "(leave --trust-reference out)", file=sys.stderr)
            return 2
    if args.list:
        for nn, ms in catalogue.items():
            print(f"lesson{nn}: {len(ms)} mutants")
            for m in ms:
                print(f"  {m['id']:28} {m['file']:20} {m['why']}")
        print(f"mutants: {sum(len(ms) for ms in catalogue.values())} in the catalogue")
        return 0

    build = pathlib.Path(args.build).resolve()
    staged = build / "submission"
    out = build / "results"
    out.mkdir(parents=True, exist_ok=True)
    stage_solutions(staged, topics.values())
    prefix = []
    if args.torch_dir:
        prefix = [f"-DCMAKE_PREFIX_PATH={args.torch_dir}/share/cmake;{args.torch_dir}"]
    r = grade.run(["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja",
                   f"-DDTC_SUBMISSION={staged}", *prefix])
    if r.returncode != 0:
        print(f"mutants.py: configuring the course failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}",
              file=sys.stderr)
        return 1
    jobs = str(os.cpu_count() or 2)

    killed_total = n_total = 0
    broken = False
    tables = []
    for nn, mutants in catalogue.items():
        if not mutants:
            continue
        topic = topics[nn]
        t0 = time.monotonic()
        if args.trust_reference:
            base = None
            print(f"lesson{nn}: the reference solution is not graded here (--trust-reference)")
        else:
            base = grade.grade_lesson(nn, build, out, args.timeout, jobs)
            print(f"lesson{nn}: the reference solution scores {base['passed']} / {base['total']} "
                  f"({base['status']}, {time.monotonic() - t0:.0f} s)", flush=True)
        if base is not None and (base["status"] != "ok" or base["passed"] != base["total"]
                                 or base["total"] == 0):
            print(f"mutants.py: lesson{nn}'s reference solution does not score full marks: "
                  f"{base['detail'][:500]}\nHINT: make test-lesson{nn}-solution shows why",
                  file=sys.stderr)
            broken = True
            continue
        rows = []
        for m in mutants:
            target = staged / topic / m["file"]
            target.write_text(m["mutated"])
            t0 = time.monotonic()
            try:
                res = grade.grade_lesson(nn, build, out, args.timeout, jobs, fail_fast=True)
            finally:
                shutil.copyfile(ROOT / "solutions" / topic / m["file"], target)
            killed = res["status"] != "ok" or res["passed"] < res["total"]
            how = (res["status"] if res["status"] != "ok" else
                   f"{res['total'] - res['passed']} test(s) lost" if killed else "every test passed")
            first = res.get("first_failure") or ""
            if killed and args.trust_reference and (
                    res["status"] != "ok" or not fnmatch.fnmatchcase(first, m["killed_by"])):
                # Without the reference's grade, only the expected test failing proves the kill.
                killed = False
                how = (f"not killed by {m['killed_by']} ({res['status']}, {res['passed']} passed"
                       f"{', first failure ' + first if first else ''})")
                first = ""
            print(f"  {'killed  ' if killed else 'SURVIVED'} lesson{nn} {m['id']:28} {how}"
                  f"{' (' + first + ')' if first else ''}  [{time.monotonic() - t0:.0f} s]",
                  flush=True)
            rows.append((m, killed, how, first))
        k = sum(1 for r in rows if r[1])
        killed_total += k
        n_total += len(rows)
        tables.append((nn, k, rows))

    print()
    for nn, k, rows in tables:
        print(f"lesson{nn}: {k} killed of {len(rows)}")
        for m, killed, how, first in rows:
            if not killed:
                print(f"  survived: {m['id']}: {m['why']}")
    print(f"mutants: {killed_total} killed of {n_total}")
    return 1 if broken or killed_total < n_total else 0


if __name__ == "__main__":
    sys.exit(main())

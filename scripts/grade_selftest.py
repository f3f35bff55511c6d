#!/usr/bin/env python3
"""Tests scripts/grade.py on lesson 01 (it needs no LibTorch, so it builds in seconds):
   - the untouched exercises score zero on every TODO test;
   - the solutions, copied into a submission, score full marks;
   - a compile error and a hang cost the lesson's points, and grading still finishes.

    scripts/grade_selftest.py SCRATCH_DIR [--torch-dir DIR]
"""
import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSON = "01_memory_ledger"


def grade(scratch, name, submission, extra, timeout=30):
    # One --out for every grading: grade.py stages the submission there (out/submission), and the
    # same staged path configures the build once for all four; each grading's results are read
    # before the next, and removed before it, so that none is taken for another's.
    out = scratch / "out"
    for f in ("summary.json", "lesson01.xml", "summary.md", "summary.html"):
        (out / f).unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "grade.py"), str(submission), "--out", str(out),
           "--build", str(scratch / "build"), "--lessons", "01", "--timeout", str(timeout), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"grade.py failed for {name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    lesson = summary["lessons"][0]
    for f in ("lesson01.xml", "summary.md", "summary.html"):
        if not (out / f).exists():
            raise SystemExit(f"{name}: grade.py wrote no {f}")
    return lesson


def submission(scratch, name, edit=None, from_solutions=False):
    sub = scratch / name
    (sub / LESSON).mkdir(parents=True, exist_ok=True)
    src = ROOT / ("solutions" if from_solutions else "lessons") / LESSON
    for f in (ROOT / "solutions" / LESSON).iterdir():
        shutil.copyfile(src / f.name, sub / LESSON / f.name)
    if edit:
        path = sub / LESSON / "ledger.cpp"
        path.write_text(edit(path.read_text()))
    # A test the learner "fixed" must not count: the course's tests are used, not theirs.
    (sub / "tests_i_edited.cpp").write_text("TEST(Cheat, Passes) {}\n")
    return sub


def main():
    scratch = pathlib.Path(sys.argv[1]).resolve()
    extra = sys.argv[2:]
    scratch.mkdir(parents=True, exist_ok=True)
    failures = []

    untouched = grade(scratch, "untouched", submission(scratch, "untouched"), extra)
    if untouched["total"] == 0 or untouched["passed"] != 0 or untouched["status"] != "ok":
        failures.append(f"untouched exercise: {untouched}, expected 0 of >0 points")

    full = grade(scratch, "solutions", submission(scratch, "solutions", from_solutions=True), extra)
    if full["passed"] != full["total"] or full["total"] == 0:
        failures.append(f"solutions: {full}, expected full marks")

    broken = grade(scratch, "broken", submission(
        scratch, "broken", edit=lambda t: t.replace("int64_t count_params(", "int64_t count_params(oops ", 1)), extra)
    if broken["status"] != "compile error" or broken["passed"] != 0:
        failures.append(f"compile error: {broken}")

    def hang(text):
        return text.replace("int64_t count_params(const ModelConfig& m) {",
                            "int64_t count_params(const ModelConfig& m) {\n  for (volatile int i = 0;; i = 0) {}", 1)
    # Lesson 01's tests take well under a second, and this one never ends: a 2 s limit proves the
    # hang handling as well as the default's 300 s would.
    hung = grade(scratch, "hang", submission(scratch, "hang", edit=hang), extra, timeout=2)
    if hung["status"] != "hang" or hung["passed"] != 0:
        failures.append(f"hang: {hung}")

    for f in failures:
        print(f"grade selftest: FAIL: {f}", file=sys.stderr)
    if not failures:
        print(f"grade selftest: untouched 0/{untouched['total']}, solutions "
              f"{full['passed']}/{full['total']}, compile error and hang cost the lesson and "
              "grading finished")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

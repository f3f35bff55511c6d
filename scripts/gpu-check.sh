#!/usr/bin/env bash
# The course on a GPU machine, in one go (about five minutes on one GPU, 16 cores):
#   configure against the machine's own PyTorch, build what the checks need, run the GPU tests
#   (ctest -L gpu), run lesson 02 on the GPU, measure MFU of a GPT-2-small-sized model in bf16
#   (bench/gpu_mfu.cpp), run the raw NCCL program and lesson 06 on NCCL on every GPU with
#   NCCL_DEBUG=INFO, summarise the NCCL logs (lesson05 nccl-log), and write a summary.
#
#   DTC_SKIP_DEPS=1 scripts/gpu-check.sh                  # on the GPU machine
#   scripts/gpu-check.sh --dry-run                        # print the plan, run nothing
#   BUILD_DIR=build scripts/gpu-check.sh --cpu            # no GPU: use an existing build, run
#                                                         # everything that runs on a CPU
# Environment: TORCH_PYTHON (the python whose torch to build against; default python3),
#   ALL_TESTS (1: also build every lesson's solution tests, for their gpu-labelled cases; 0: not),
#   BUILD_DIR (default build-gpu), OUT (default $BUILD_DIR/gpu-check), JOBS (default: all cores),
#   NGPU (default: every visible GPU), MFU_STEPS (default 10).
# Output: $OUT/logs/*.log, $OUT/summary.md, $OUT/summary.json. Exit 0 when every step that ran
# passed (skipped steps say why), 1 otherwise.
set -uo pipefail

mode=gpu
for arg in "$@"; do
  case "$arg" in
    --dry-run) mode=dry ;;
    --cpu) mode=cpu ;;
    -h|--help) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
PY=${TORCH_PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build-gpu}
OUT=${OUT:-$BUILD_DIR/gpu-check}
JOBS=${JOBS:-$(nproc)}
MFU_STEPS=${MFU_STEPS:-10}
logs="$OUT/logs"
steps_file="$OUT/steps.tsv"   # name <TAB> status (ok|FAILED|skipped) <TAB> seconds <TAB> note
t_start=$(date +%s)

if [ "$mode" != dry ]; then
  mkdir -p "$logs"
  : > "$steps_file"
fi

# run_step NAME TIMEOUT_S LOG COMMAND...: runs the command with a timeout, output to LOG;
# exit 77 means skipped (the program said why on its last line).
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  if [ "$mode" = dry ]; then
    printf '[dry-run] %-12s timeout %4ss > %s:\n    %s\n' "$name" "$limit" "$log" "$*"
    return 0
  fi
  local t0=$(date +%s) rc status note
  echo "== $name: $*" | tee -a "$logs/steps.log"
  timeout --kill-after=10 "$limit" "$@" > "$logs/$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok; note="" ;;
    77) status=skipped; note=$(grep -m1 'SKIP' "$logs/$log" || tail -n 1 "$logs/$log") ;;
    124|137) status=FAILED; note="timed out after ${limit} s" ;;
    *) status=FAILED; note="exit $rc: $(tail -n 2 "$logs/$log" | tr '\n' ' ' | cut -c1-200)" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$note" >> "$steps_file"
  echo "   -> $status ($(( $(date +%s) - t0 )) s) $note"
  return 0
}

skip_step() {  # skip_step NAME REASON
  if [ "$mode" = dry ]; then printf '[dry-run] %-12s skipped: %s\n' "$1" "$2"; return; fi
  printf '%s\tskipped\t0\t%s\n' "$1" "$2" >> "$steps_file"
  echo "== $1: skipped: $2"
}

# --- 0. the machine -------------------------------------------------------------------------
if [ -z "${NGPU:-}" ]; then
  if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
    NGPU=$(nvidia-smi -L | grep -c '^GPU')
  else
    NGPU=0
  fi
fi
if [ "$mode" = gpu ] && [ "$NGPU" -eq 0 ]; then
  echo "gpu-check: no GPU visible (nvidia-smi -L); use --cpu to run the CPU part, or --dry-run" >&2
  exit 2
fi
echo "gpu-check: mode $mode, $NGPU GPU(s), build dir $BUILD_DIR, $JOBS jobs, output $OUT"
if [ "$mode" != dry ]; then
  { nvidia-smi 2>&1 || echo "nvidia-smi: not available"; } > "$logs/nvidia-smi.log"
  { echo "python: $PY"; "$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1; } > "$logs/torch.log"
fi

# --- 1. configure against this machine's PyTorch, build what the checks need -----------------
if [ "$mode" = cpu ]; then
  skip_step configure "--cpu: using the existing build in $BUILD_DIR"
else
  prefix_cmd="$PY -c 'import torch; print(torch.utils.cmake_prefix_path)'"
  prefix=$([ "$mode" = dry ] && echo '<torch cmake prefix>' || eval "$prefix_cmd")
  cuda_root=()
  [ -n "${CUDA_HOME:-}" ] && cuda_root=(-DCUDAToolkit_ROOT="$CUDA_HOME")
  run_step configure 300 configure.log cmake -S . -B "$BUILD_DIR" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" "${cuda_root[@]}"
fi

# Every target this build knows (read once: `ninja ... | grep -q` under pipefail is flaky).
all_targets=$([ "$mode" = dry ] || ninja -C "$BUILD_DIR" -t targets all 2>/dev/null | cut -d: -f1)
has_target() { [ "$mode" = dry ] || grep -qx "$1" <<< "$all_targets"; }

# The targets: the executables of every test labelled gpu, plus the programs run below.
targets=(lesson02_solution lesson05_solution gpu_mfu nccl_raw)
if [ "$mode" = gpu ] && [ -f "$BUILD_DIR/CTestTestfile.cmake" ]; then
  while read -r exe; do targets+=("$(basename "$exe")"); done < <(
    cd "$BUILD_DIR" && ctest -N -L gpu --show-only=json-v1 2>/dev/null |
      "$PY" -c 'import json,sys
for t in json.load(sys.stdin).get("tests", []):
    c = t.get("command") or []
    if c and "/" in c[0] and "python" not in c[0] and "torchrun" not in c[0]: print(c[0])' | sort -u)
fi
# Every lesson's solution test binary too (ALL_TESTS=0 to skip): GoogleTest cases labelled gpu
# are only known to ctest once their binary is built (gtest_discover_tests).
if [ "${ALL_TESTS:-1}" = 1 ] && [ "$mode" = gpu ]; then
  while read -r t; do targets+=("$t"); done < <(
    grep -x 'lesson[0-9]*_solution_tests' <<< "$all_targets" | sort -u)
fi
if has_target lesson06_solution; then
  targets+=(lesson06_solution)
fi
available=()
for t in "${targets[@]}"; do
  if has_target "$t"; then
    available+=("$t")
  fi
done
mapfile -t available < <(printf '%s\n' "${available[@]}" | sort -u)
if [ "$mode" = cpu ]; then
  skip_step build "--cpu: build the targets yourself (${available[*]})"
else
  run_step build 900 build.log cmake --build "$BUILD_DIR" -j "$JOBS" --target "${available[@]}"
fi
bin="$BUILD_DIR/bin"

# --- 2. the GPU tests ---------------------------------------------------------------------------
if [ "$mode" = cpu ]; then
  run_step ctest-gpu 300 ctest-gpu.log ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure
else
  run_step ctest-gpu 300 ctest-gpu.log ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure \
    --timeout 240
fi

# --- 3. lesson 02 on the GPU (the course's device rule: CUDA when available) -----------------
if [ "$mode" != dry ] && [ ! -x "$bin/lesson02_solution" ]; then
  skip_step lesson02 "$bin/lesson02_solution is not built"
else
  run_step lesson02 300 lesson02.log "$bin/lesson02_solution" --steps 20 --json
fi

# --- 4. MFU, GPT-2-small size, bf16 ---------------------------------------------------------------
if [ "$mode" != dry ] && [ ! -x "$bin/gpu_mfu" ]; then
  skip_step gpu_mfu "$bin/gpu_mfu is not built"
elif [ "$mode" != cpu ]; then
  run_step gpu_mfu 300 gpu_mfu.log "$bin/gpu_mfu" --device cuda --steps "$MFU_STEPS" --warmup 3 --json
else
  run_step gpu_mfu 120 gpu_mfu.log "$bin/gpu_mfu" --smoke --device cpu --json
fi

# --- 5. raw NCCL on every GPU, with NCCL_DEBUG=INFO ---------------------------------------------
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,ENV
np=$(( NGPU > 0 ? NGPU : 1 ))
if [ "$mode" != dry ] && [ ! -x "$bin/nccl_raw" ]; then
  skip_step nccl_raw "not built (no CUDA toolkit, MPI or nccl.h at configure time: see configure.log)"
elif command -v mpirun > /dev/null; then
  run_step nccl_raw 120 nccl_raw.log mpirun --allow-run-as-root --oversubscribe -np "$np" \
    -x NCCL_DEBUG -x NCCL_DEBUG_SUBSYS "$bin/nccl_raw" --count 16777216
else
  run_step nccl_raw 120 nccl_raw.log "$bin/nccl_raw" --count 16777216
fi

# --- 6. lesson 06 (DDP) on NCCL, on every GPU -----------------------------------------------------
if [ "$mode" = dry ] || [ -x "$bin/lesson06_solution" ]; then
  backend=$([ "$mode" != cpu ] && echo nccl || echo gloo)
  run_step lesson06 300 lesson06.log "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node="$np" --no_python "$bin/lesson06_solution" --backend "$backend" --steps 20 --json
else
  skip_step lesson06 "$bin/lesson06_solution is not built here (lesson 06 missing?)"
fi
unset NCCL_DEBUG NCCL_DEBUG_SUBSYS

# --- 7. read the NCCL logs (lesson 05's parser) ------------------------------------------------
captured=()
for f in "$logs/nccl_raw.log" "$logs/lesson06.log"; do
  [ -f "$f" ] && grep -q 'NCCL INFO' "$f" && captured+=("$f")
done
if [ "$mode" != dry ] && [ ! -x "$bin/lesson05_solution" ]; then
  skip_step nccl-log "$bin/lesson05_solution is not built"
elif [ "$mode" = dry ]; then
  run_step nccl-log 60 nccl-summary.txt "$bin/lesson05_solution" nccl-log "$logs/nccl_raw.log" "$logs/lesson06.log"
elif [ ${#captured[@]} -gt 0 ]; then
  run_step nccl-log 60 nccl-summary.txt "$bin/lesson05_solution" nccl-log "${captured[@]}"
else
  # Nothing captured (no GPU): exercise the parser on the constructed samples instead.
  run_step nccl-log 60 nccl-summary.txt "$bin/lesson05_solution" nccl-log tests/lesson05/data/*.log
fi

[ "$mode" = dry ] && exit 0

# --- 8. the summary -------------------------------------------------------------------------------
total=$(( $(date +%s) - t_start ))
"$PY" - "$OUT" "$mode" "$NGPU" "$total" <<'PYEOF'
import json, os, sys
out, mode, ngpu, total = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
logs = os.path.join(out, "logs")

def last_json(name):
    try:
        lines = open(os.path.join(logs, name), errors="replace").read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None

def text(name, n=40):
    try:
        return "\n".join(open(os.path.join(logs, name), errors="replace").read().splitlines()[:n])
    except OSError:
        return "(none)"

steps = []
for line in open(os.path.join(out, "steps.tsv")):
    name, status, secs, note = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
    steps.append({"step": name, "status": status, "seconds": int(secs or 0), "note": note})
summary = {"mode": mode, "gpus": ngpu, "total_s": total, "steps": steps,
           "torch": text("torch.log", 5), "gpu_mfu": last_json("gpu_mfu.log"),
           "lesson02": last_json("lesson02.log"), "lesson06": last_json("lesson06.log")}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)

md = [f"# GPU check ({mode}, {ngpu} GPU(s), {total} s)", "", "| step | status | s | note |",
      "|---|---|---|---|"]
md += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['note']} |" for s in steps]
m = summary["gpu_mfu"]
if m:
    mfu = f"{100 * m['mfu']:.1f}% of {m['peak_tflops']:.0f} TFLOP/s" if m.get("mfu") else "not computed"
    md += ["", "## MFU", "",
           f"{m['device']}: GPT L{m['layers']} h{m['hidden']} a{m['heads']} T{m['seq']} "
           f"V{m['vocab']} ({m['params'] / 1e6:.1f} M params), batch {m['batch']}, {m['dtype']}: "
           f"{m['median_step_s'] * 1e3:.1f} ms/step, {m['tokens_per_s']:.0f} tokens/s, "
           f"{m['achieved_tflops']:.1f} TFLOP/s, MFU {mfu}"]
for name, title in (("lesson02", "Lesson 02 on the device"), ("lesson06", "Lesson 06 (DDP)")):
    j = summary[name]
    if j:
        losses = j.get("losses", [])
        md += ["", f"## {title}", "",
               f"tokens/s {j.get('tokens_per_s')}, loss {losses[0] if losses else '?'} -> "
               f"{losses[-1] if losses else '?'} over {len(losses)} steps"]
md += ["", "## NCCL logs (lesson05 nccl-log)", "", "```", text("nccl-summary.txt", 60), "```",
       "", "## Environment", "", "```", summary["torch"], "```"]
open(os.path.join(out, "summary.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
PYEOF
if grep -q $'\tFAILED\t' "$steps_file"; then exit 1; fi
exit 0

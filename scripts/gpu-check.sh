#!/usr/bin/env bash
# The course on a GPU node, in one go, sized for one short attempt (under 8 minutes on a 16-core
# node with one GPU): configure against the node's own PyTorch (with --bundle: nothing else but
# the node's compiler, CMake, ninja and CUDA), build the programs the check runs, run the GPU
# tests (ctest -L gpu), lesson 02 on CUDA against the same run on the CPU, the MFU of a
# GPT-2-small-sized model in bf16 (bench/gpu_mfu.cpp), raw NCCL (nccl_raw), lessons 06 and up
# with --backend nccl, every NCCL run with NCCL_DEBUG=INFO, lesson 10 beside PyTorch's
# context_parallel, the logs summarised by lesson 05's parser, and a one-page summary.
#
#   scripts/gpu-check.sh --bundle build-bundle --out gpu-out   # on the node (scripts/gpu-bundle.sh)
#   scripts/gpu-check.sh --out gpu-out                         # where the -dev packages are installed
#   scripts/gpu-check.sh --cpu --bundle build-bundle           # no GPU: every step that runs on a
#                                                              # CPU (scripts/gpu-rehearsal.sh)
#   scripts/gpu-check.sh --dry-run                             # print the plan, run nothing
#
# Options: --bundle DIR (configure with -DDTC_BUNDLE=DIR), --out DIR (default
#   $BUILD_DIR/gpu-check), --build-dir DIR (default build-gpu), --budget S (default 480: no step
#   runs past it; a step that would start later is skipped, saying so), --cpu, --dry-run.
# Environment: TORCH_PYTHON (the Python whose torch to build against; default python3),
#   JOBS (default: every core), NGPU (default: every visible GPU), MFU_STEPS (default 10),
#   CUDA_HOME (the CUDA toolkit, when nvcc is not on PATH).
# NCCL: one rank per GPU. Several ranks on one GPU is refused by NCCL ("Duplicate GPU detected"),
#   so on one GPU the NCCL runs have world size 1, and one extra step shows the refusal.
# Output: DIR/logs/*.log, DIR/steps.tsv, DIR/summary.md, DIR/summary.json. Every step has its own
# timeout and the check goes on after a failure. Exit 0 when every step that ran passed (skipped
# steps say why), 1 otherwise, 2 on bad arguments.
set -uo pipefail

mode=gpu
bundle=""
OUT=${OUT:-}
BUILD_DIR=${BUILD_DIR:-build-gpu}
budget=480
die() { echo "gpu-check: $1" >&2; [ -n "${2:-}" ] && echo "HINT: $2" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) mode=dry; shift ;;
    --cpu) mode=cpu; shift ;;
    --bundle) [ $# -ge 2 ] || die "--bundle needs a folder"; bundle=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT=$2; shift 2 ;;
    --build-dir) [ $# -ge 2 ] || die "--build-dir needs a folder"; BUILD_DIR=$2; shift 2 ;;
    --budget) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--budget needs seconds"; budget=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) die "unknown argument '$1'" "run '$0 --help' for the options" ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
PY=${TORCH_PYTHON:-python3}
OUT=${OUT:-$BUILD_DIR/gpu-check}
JOBS=${JOBS:-$(nproc)}
MFU_STEPS=${MFU_STEPS:-10}
if [ -n "$bundle" ]; then
  [ -f "$bundle/MANIFEST" ] || die "--bundle $bundle is not a bundle (no MANIFEST)" \
    "make one where the course's packages are installed: scripts/gpu-bundle.sh DIR"
  bundle=$(cd "$bundle" && pwd)
fi
logs="$OUT/logs"
steps_file="$OUT/steps.tsv"   # name <TAB> status (ok|FAILED|skipped) <TAB> seconds <TAB> note
t_start=$SECONDS

if [ "$mode" != dry ]; then
  rm -rf "$logs"
  mkdir -p "$logs"
  OUT=$(cd "$OUT" && pwd)
  logs="$OUT/logs"
  steps_file="$OUT/steps.tsv"
  : > "$steps_file"
fi

# run_step NAME TIMEOUT_S LOG COMMAND...: runs the command with a timeout (never past the budget),
# output to LOG; exit 77 means skipped (the program said why).
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  if [ "$mode" = dry ]; then
    printf '[dry-run] %-16s timeout %4ss > %s:\n    %s\n' "$name" "$limit" "$log" "$*"
    return 0
  fi
  local left=$(( budget - (SECONDS - t_start) ))
  if [ "$left" -lt 10 ]; then
    skip_step "$name" "the ${budget} s budget is spent"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS rc status note
  echo "== $name: $*" | tee -a "$logs/steps.log"
  timeout --kill-after=10 "$limit" "$@" > "$logs/$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok; note="" ;;
    77) status=skipped; note=$(grep -m1 'SKIP' "$logs/$log" || tail -n 1 "$logs/$log") ;;
    124|137) status=FAILED; note="timed out after ${limit} s" ;;
    *) status=FAILED; note="exit $rc: $(grep -v '^\[' "$logs/$log" | tail -n 2 | tr '\n' ' ' | cut -c1-200)" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( SECONDS - t0 ))" "$note" >> "$steps_file"
  echo "   -> $status ($(( SECONDS - t0 )) s) $note"
  return 0
}

skip_step() {  # skip_step NAME REASON
  if [ "$mode" = dry ]; then printf '[dry-run] %-16s skipped: %s\n' "$1" "$2"; return; fi
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
  die "no GPU visible (nvidia-smi -L)" "use --cpu to run the parts that run on a CPU, or --dry-run"
fi
[ "$mode" = cpu ] && NGPU=0
echo "gpu-check: mode $mode, $NGPU GPU(s), build dir $BUILD_DIR, $JOBS jobs, output $OUT," \
     "budget ${budget} s${bundle:+, bundle $bundle}"
if [ "$mode" != dry ]; then
  { nvidia-smi 2>&1 || echo "nvidia-smi: not available"; } > "$logs/nvidia-smi.log"
  {
    echo "python: $PY"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")' 2>&1
    echo "cores: $(nproc)"
    cmake --version | head -n 1
    echo "ninja $(ninja --version 2>&1)"
    { nvcc --version 2>/dev/null || "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>/dev/null || echo "nvcc: not found"; } | tail -n 1
    [ -n "$bundle" ] && cat "$bundle/MANIFEST"
  } > "$logs/machine.log"
fi

# --- 1. configure against this machine's PyTorch, build what the check runs --------------------
# The wheel's CMake config and the wheel itself: TorchConfig's find_library searches the prefix
# path first, and a system LibTorch (Debian's, say) would otherwise win over the wheel's lib/.
prefix=$([ "$mode" = dry ] && echo '<torch cmake prefix>;<torch>' ||
  "$PY" -c 'import os, torch; print(torch.utils.cmake_prefix_path + ";" + os.path.dirname(torch.__file__))' 2>/dev/null)
configure=(cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
  "-DCMAKE_PREFIX_PATH=$prefix" "-DPython3_EXECUTABLE=$(command -v "$PY" || echo "$PY")")
[ -n "${CUDA_HOME:-}" ] && configure+=("-DCUDAToolkit_ROOT=$CUDA_HOME")
[ -n "$bundle" ] && configure+=("-DDTC_BUNDLE=$bundle")
run_step configure 240 configure.log "${configure[@]}"

# Every target this build knows (read once: `ninja ... | grep -q` under pipefail is flaky).
all_targets=$([ "$mode" = dry ] || ninja -C "$BUILD_DIR" -t targets all 2>/dev/null | cut -d: -f1)
has_target() { [ "$mode" = dry ] || grep -qx "$1" <<< "$all_targets"; }
# The programs: lesson 02, lesson 05 (its log parser), the NCCL lessons (06 and up), gpu_mfu and
# nccl_raw. No test binary: no GoogleTest case needs a GPU (the gpu label is on gpu_mfu and
# nccl_raw, which ctest runs directly).
nccl_lessons=()
if [ "$mode" = dry ]; then
  nccl_lessons=(lesson06_solution lesson07_solution lesson08_solution lesson09_solution
                lesson10_solution)
else
  mapfile -t nccl_lessons < <(grep -E -x 'lesson(0[6-9]|[1-9][0-9])_solution' <<< "$all_targets" | sort)
fi
available=()
for t in lesson02_solution lesson05_solution gpu_mfu nccl_raw "${nccl_lessons[@]}"; do
  has_target "$t" && available+=("$t")
done
run_step build 420 build.log cmake --build "$BUILD_DIR" -j "$JOBS" --target "${available[@]}"
bin="$BUILD_DIR/bin"
built() { [ "$mode" = dry ] || [ -x "$bin/$1" ]; }

# --- 2. the GPU tests (gpu_mfu, nccl_raw: each skips, saying so, without a GPU) -----------------
run_step ctest-gpu 240 ctest-gpu.log ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure \
  --timeout 200

# --- 3. lesson 02 on the CPU and on CUDA: the same losses, the allocator against the ledger -----
if built lesson02_solution; then
  DTC_DEVICE=cpu run_step lesson02-cpu 120 lesson02-cpu.log "$bin/lesson02_solution" --steps 20 --json
  if [ "$mode" = cpu ]; then
    skip_step lesson02-cuda "--cpu: no GPU"
  else
    DTC_DEVICE=cuda run_step lesson02-cuda 120 lesson02-cuda.log "$bin/lesson02_solution" --steps 20 --json
    # mixed precision and recomputation on the GPU: the caching allocator against the ledger
    for numerics in "bf16 selective" "fp16 full"; do
      read -r prec rec <<< "$numerics"
      DTC_DEVICE=cuda run_step "lesson02-cuda-$prec-$rec" 120 "lesson02-cuda-$prec-$rec.log" \
        "$bin/lesson02_solution" --steps 20 --json --precision "$prec" --recompute "$rec"
    done
  fi
else
  skip_step lesson02 "$bin/lesson02_solution is not built (see build.log)"
fi

# --- 4. MFU, GPT-2-small size, bf16 ---------------------------------------------------------------
if ! built gpu_mfu; then
  skip_step gpu_mfu "$bin/gpu_mfu is not built (see build.log)"
elif [ "$mode" != cpu ]; then
  run_step gpu_mfu 240 gpu_mfu.log "$bin/gpu_mfu" --device cuda --steps "$MFU_STEPS" --warmup 3 --json
else
  run_step gpu_mfu 120 gpu_mfu.log "$bin/gpu_mfu" --smoke --device cpu --json
fi

# --- 5. NCCL: raw, then the lessons, one rank per GPU, NCCL_DEBUG=INFO ---------------------------
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,ENV,COLL
np=$(( NGPU > 0 ? NGPU : 2 ))   # --cpu: two CPU ranks on gloo
backend=$([ "$mode" = cpu ] && echo gloo || echo nccl)
torchrun=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$np" --no_python)
if ! built nccl_raw; then
  skip_step nccl_raw "not built (needs the CUDA toolkit and NCCL at configure time: configure.log)"
elif [ "$mode" = cpu ]; then
  run_step nccl_raw 60 nccl_raw.log "$bin/nccl_raw" --count 1024
else
  # The unique id through a file (no MPI needed); mpirun works too where OpenMPI is installed.
  run_step nccl_raw 120 nccl_raw.log "${torchrun[@]}" "$bin/nccl_raw" --count 16777216
  if [ "$NGPU" -eq 1 ]; then
    # Two ranks on the one GPU: NCCL refuses. Capture its words; this step passes when it does.
    run_step nccl-2-on-1 60 nccl-2-on-1.log bash -c '
      "$@"; rc=$?
      echo "exit $rc"
      [ $rc -ne 0 ] && echo "expected: NCCL does not put two ranks of one communicator on one GPU"
      exit 0' _ "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 --no_python \
      "$bin/nccl_raw" --count 1024
  fi
fi
for prog in "${nccl_lessons[@]}"; do
  name=${prog%_solution}
  if ! built "$prog"; then skip_step "$name" "$bin/$prog is not built (see build.log)"; continue; fi
  extra=()
  [ "$name" = lesson09 ] && extra=(--no-sweep)
  [ "$name" = lesson10 ] && extra=(--zigzag)
  # --trace: every rank's timeline (CUDA events on the compute stream, NCCL completions seen by
  # the tracer's watcher), drawn below
  run_step "$name" 150 "$name.log" "${torchrun[@]}" "$bin/$prog" --backend "$backend" --steps 10 \
    --json --trace "$OUT/traces/$name" "${extra[@]}"
done
unset NCCL_DEBUG NCCL_DEBUG_SUBSYS
# --- 5a. the timelines of those runs, step 1 of each (scripts/trace_svg.py) --------------------
for prog in "${nccl_lessons[@]}"; do
  name=${prog%_solution}
  if [ "$mode" != dry ] && [ ! -f "$OUT/traces/$name/trace.json" ]; then
    skip_step "$name-timeline" "no trace (see $name.log)"
    continue
  fi
  # the trace's own checks (tests/support/e2e_run.py, as the e2e tests run them on the CPU):
  # files, nesting, causality across ranks; on the GPU also CUDA events and NCCL's watcher
  cuda_flag=()
  [ "$backend" = nccl ] && cuda_flag=(--expect-cuda)
  run_step "$name-trace-check" 60 "$name-trace-check.log" python3 tests/support/e2e_run.py \
    --nproc "$np" --program "$bin/$prog" --trace-check step,optimizer \
    --existing-trace "$OUT/traces/$name" "${cuda_flag[@]}"
  run_step "$name-timeline" 60 "$name-timeline.log" python3 scripts/trace_svg.py \
    "$OUT/traces/$name/trace.json" "$OUT/traces/$name.svg" --step 1 \
    --title "$name, --backend $backend, step 1 (gpu-check)"
done

# --- 5b. lesson 10 beside PyTorch's context_parallel (ring attention under SDPA), on the GPUs ----
# (on the CPU PyTorch 2.15's context_parallel does not run: the script says so and times ours)
if ! built lesson10_solution; then
  skip_step lesson10-vs-pytorch "$bin/lesson10_solution is not built (see build.log)"
else
  run_step lesson10-vs-pytorch 180 lesson10-vs-pytorch.log "$PY" bench/lesson10_vs_pytorch.py \
    --binary "$bin/lesson10_solution" --nproc "$np" --device "$([ "$mode" = cpu ] && echo cpu || echo cuda)" \
    --steps 10 --repeats 2 --seq 4096 --hidden 256 --heads 8 --layers 2 --batch 1
fi

# --- 6. read the NCCL logs (lesson 05's parser) ------------------------------------------------
captured=()
if [ "$mode" != dry ]; then
  for f in "$logs"/*.log; do grep -q 'NCCL INFO' "$f" && captured+=("$f"); done
fi
if ! built lesson05_solution; then
  skip_step nccl-log "$bin/lesson05_solution is not built"
elif [ "$mode" = dry ] || [ ${#captured[@]} -gt 0 ]; then
  run_step nccl-log 60 nccl-summary.txt "$bin/lesson05_solution" nccl-log ${captured[@]+"${captured[@]}"}
else
  # Nothing captured (no GPU): exercise the parser on the course's sample logs instead.
  run_step nccl-log 60 nccl-summary.txt "$bin/lesson05_solution" nccl-log tests/lesson05/data/*.log
fi

[ "$mode" = dry ] && exit 0

# --- 7. the summary -------------------------------------------------------------------------------
total=$(( SECONDS - t_start ))
"$PY" - "$OUT" "$mode" "$NGPU" "$total" "$budget" <<'PYEOF'
import json, os, sys
out, mode, ngpu, total, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
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
runs = {n[:-4]: last_json(n) for n in sorted(os.listdir(logs)) if n.endswith(".log")}
runs = {k: v for k, v in runs.items() if v is not None}
summary = {"mode": mode, "gpus": ngpu, "total_s": total, "budget_s": budget, "steps": steps,
           "machine": text("machine.log", 20), "runs": runs}

md = [f"# GPU check ({mode}, {ngpu} GPU(s), {total} s of a {budget} s budget)", "",
      "| step | status | s | note |", "|---|---|---|---|"]
md += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['note'].replace('|', '/')} |"
       for s in steps]
cpu, cuda = runs.get("lesson02-cpu"), runs.get("lesson02-cuda")
if cpu or cuda:
    md += ["", "## Lesson 02: CPU and CUDA", ""]
    for name, j in (("cpu", cpu), ("cuda", cuda)):
        if j:
            l, mem = j.get("losses", []), j.get("memory", {})
            md.append(f"- {name}: {j.get('device')}, loss {l[0]:.4f} -> {l[-1]:.4f} over {len(l)} "
                      f"steps, {j.get('tokens_per_s', 0):.0f} tokens/s; memory measured "
                      f"{json.dumps(mem.get('measured'))}, predicted {json.dumps(mem.get('predicted'))}")
    if cpu and cuda:
        a, b = cpu.get("losses", []), cuda.get("losses", [])
        diff = max((abs(x - y) for x, y in zip(a, b)), default=float("nan"))
        summary["lesson02_loss_max_abs_diff"] = diff
        md.append(f"- largest loss difference, CUDA vs CPU, over {min(len(a), len(b))} steps: {diff:.2e}")
m = runs.get("gpu_mfu")
if m:
    mfu = f"{100 * m['mfu']:.1f}% of {m['peak_tflops']:.0f} TFLOP/s" if m.get("mfu") else "not computed"
    md += ["", "## MFU", "",
           f"{m['device']}: GPT L{m['layers']} h{m['hidden']} a{m['heads']} T{m['seq']} "
           f"V{m['vocab']} ({m['params'] / 1e6:.1f} M params), batch {m['batch']}, {m['dtype']}: "
           f"{m['median_step_s'] * 1e3:.1f} ms/step, {m['tokens_per_s']:.0f} tokens/s, "
           f"{m['achieved_tflops']:.1f} TFLOP/s, MFU {mfu}"]
lessons = [k for k in runs if k.startswith("lesson") and not k.startswith("lesson02")]
if lessons:
    md += ["", "## Lessons on " + ("gloo (CPU)" if mode == "cpu" else "NCCL"), ""]
    for k in lessons:
        j = runs[k]
        l = j.get("losses", [])
        world = j.get("world", j.get("world_size", j.get("stages", "?")))
        md.append(f"- {k}: world {world}, loss {l[0] if l else '?'} -> "
                  f"{l[-1] if l else '?'} over {len(l)} steps")
md += ["", "## NCCL logs (lesson05 nccl-log)", "", "```", text("nccl-summary.txt", 60), "```",
       "", "## Machine", "", "```", summary["machine"], "```"]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
open(os.path.join(out, "summary.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
PYEOF
if grep -q $'\tFAILED\t' "$steps_file"; then exit 1; fi
exit 0

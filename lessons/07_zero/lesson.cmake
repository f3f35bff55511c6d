# Lesson 07: ZeRO stages 1-3 (and stage 0, DDP). Links dtc::dist (LibTorch's c10d, gloo).
dtc_add_lesson(07 DIR 07_zero SOURCES zero.cpp DRIVER zero_given.cpp program.cpp
               TESTS tests/lesson07/zero_test.cpp tests/lesson07/engine_test.cpp
                     tests/lesson07/program_test.cpp tests/lesson07/timeline_test.cpp
               LIBS dtc::dist TORCH)

# End-to-end: the program (the reference's and the learner's) on real processes through torchrun: memory
# against the ledger (within padding), the ranking DDP > 1 > 2 > 3, bytes against the ZeRO
# paper, losses against PyTorch's (tests/reference/lesson02_reference.json), checkpoints.
if(DTC_TORCHRUN)
  string(JOIN " " l07_flags ${DTC_TORCHRUN_FLAGS})
  # bf16 needs LibTorch 2.x's gloo (1.13's has no bf16 collectives).
  if(DTC_TORCH_VERSION VERSION_LESS 2.0)
    set(l07_bf16 --no-bf16)
  else()
    set(l07_bf16 --bf16)
  endif()
  dtc_add_e2e(07 NAME program TIMEOUT 300
    COMMAND Python3::Interpreter "${PROJECT_SOURCE_DIR}/tests/lesson07/e2e.py"
            --program @PROGRAM@ --torchrun "${DTC_TORCHRUN}" "--torchrun-flags=${l07_flags}"
            ${l07_bf16})
  # --trace DIR, stage 3 with prefetch on 2 ranks: traces, spans, drawing; lesson 02's losses.
  dtc_add_e2e(07 NAME torchrun_trace TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ --trace-check "step,fwd block,bwd block,optimizer"
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=--steps 3"
    -- --stage 3 --prefetch --steps 3 --json)
  # A smoke run of the benchmark against PyTorch (primary path only: it needs the venv's torch).
  get_filename_component(l07_bin "${DTC_TORCHRUN}" DIRECTORY)
  if(NOT DTC_TORCHRUN_FLAGS AND EXISTS "${l07_bin}/python")
    add_test(NAME lesson07.solution.bench_smoke
      COMMAND "${l07_bin}/python" "${PROJECT_SOURCE_DIR}/bench/lesson07_vs_pytorch.py"
              --program $<TARGET_FILE:lesson07_solution> --torchrun "${DTC_TORCHRUN}" --smoke)
    set_tests_properties(lesson07.solution.bench_smoke PROPERTIES
      ENVIRONMENT DTC_ZYGOTE_WORKERS=1
      LABELS "lesson07;solution;lesson07-solution" TIMEOUT 240)
  endif()
endif()

# Lesson 02: the single-device baseline. Trains the course's GPT (common/: dtc::dist) on one
# device; the program runs as one process.
dtc_add_lesson(02 DIR 02_baseline SOURCES baseline.cpp mixed.cpp DRIVER program.cpp
               TESTS tests/lesson02/model_test.cpp tests/lesson02/baseline_test.cpp
                     tests/lesson02/program_test.cpp tests/lesson02/mixed_test.cpp
               LIBS dtc::dist TORCH)

# The numerics benchmark (README section 11) at a smoke size: every precision and recompute mode
# runs, and the allocator's state bytes equal the ledger's (exit 1 otherwise).
add_test(NAME lesson02.solution.bench_smoke
         COMMAND Python3::Interpreter "${PROJECT_SOURCE_DIR}/bench/lesson02_numerics.py"
                 --binary $<TARGET_FILE:lesson02_solution> --steps 3 --layers 1 --hidden 32
                 --seq 16)
set_tests_properties(lesson02.solution.bench_smoke PROPERTIES
                     LABELS "lesson02;solution;lesson02-solution" TIMEOUT 120)

# --trace DIR on one process: the trace, its spans and the drawing, and training unchanged (the
# losses and digest of the same run without --trace).
dtc_add_e2e(02 NAME trace TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 0 --program @PROGRAM@
  --trace-check "step,fwd block,bwd block,fwd head,bwd head,optimizer"
  --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=--steps 3"
  -- --steps 3 --json)

# Lesson 06: your first DDP, built by hand. The exercise is ddp.cpp (broadcast, gradient
# averaging naive / flat / bucketed, the sampler, the rank-0 checkpoint); ddp_given.cpp holds
# the Reducer's given parts; the program (given) trains the course's GPT on several ranks.
dtc_add_lesson(06 DIR 06_ddp SOURCES ddp.cpp GIVEN ddp_given.cpp DRIVER program.cpp
               TESTS tests/lesson06/ddp_test.cpp tests/lesson06/sampler_test.cpp
                     tests/lesson06/program_test.cpp tests/lesson06/timeline_test.cpp
               LIBS dtc::dist TORCH)

# End-to-end: the program (the reference's and the learner's) on 2 ranks under real launchers, against lesson 02's
# single-process losses (tests/lesson06/e2e.py; tolerance written there). Debian's torchrun gets
# an explicit c10d endpoint on a free port; the venv's --standalone picks its own.
if(DTC_FLAVOR STREQUAL "primary" AND DTC_TORCHRUN)
  set(l06_kind venv)
else()
  set(l06_kind debian)
endif()
set(l06_e2e Python3::Interpreter "${PROJECT_SOURCE_DIR}/tests/lesson06/e2e.py")
set(l06_args --program @PROGRAM@ --baseline $<TARGET_FILE:lesson02_solution>
             --torchrun-kind ${l06_kind} --venv-torchrun "${DTC_TORCHRUN}")
foreach(mode torchrun mpirun srun resume uneven-steps)
  # resume and uneven-steps run the same program and collectives as torchrun, and mpirun and srun
  # the same code under another launcher's variables (read by the course's own code, the same on
  # both paths; lessons 04 and 10 run mpirun on the light path too): primary path only.
  set(l06_where "")
  if(mode MATCHES "^(resume|uneven-steps|mpirun|srun)$")
    set(l06_where PRIMARY)
  endif()
  dtc_add_e2e(06 NAME ${mode} TIMEOUT 300 RESOURCE_LOCK "${DTC_TORCHRUN_LOCK}" ${l06_where}
              COMMAND ${l06_e2e} ${mode} ${l06_args})
endforeach()
# --trace DIR on 2 ranks: the per-rank and merged traces with the spans the README's timeline
# shows, drawn by scripts/trace_svg.py, and training unchanged (lesson 02's losses and digest).
if(DTC_TORCHRUN)
  dtc_add_e2e(06 NAME torchrun_trace TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ --trace-check "step,forward,backward,bwd block,sync gradients,optimizer"
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=--steps 3"
    -- --steps 3 --json)
endif()

# The benchmark against PyTorch's DistributedDataParallel, at a smoke size (a few seconds);
# run it at its default size by hand: bench/lesson06_vs_pytorch.py --help. On the primary path
# only, as lessons 07-09's: the script is the same on both, and the light path's program is
# tested under its own torchrun by the end-to-end runs above (it still runs by hand there:
# --cpp-torchrun debian).
if(DTC_FLAVOR STREQUAL "primary")
  add_test(NAME lesson06.solution.bench_smoke
           COMMAND Python3::Interpreter "${PROJECT_SOURCE_DIR}/bench/lesson06_vs_pytorch.py"
                   --program $<TARGET_FILE:lesson06_solution> --smoke --cpp-torchrun ${l06_kind})
  set_tests_properties(lesson06.solution.bench_smoke PROPERTIES
                       ENVIRONMENT DTC_ZYGOTE_WORKERS=1
                       LABELS "lesson06;solution;lesson06-solution" TIMEOUT 300
                       RESOURCE_LOCK "${DTC_TORCHRUN_LOCK}")
endif()

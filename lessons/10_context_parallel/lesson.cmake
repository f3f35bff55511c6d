# Lesson 10: context parallelism. Links dtc::dist (LibTorch's c10d, gloo; NCCL on CUDA builds).
# Part 5 (sequence parallelism) builds on lesson 08's reference modules: lesson08_solution_lib.
# The given code (the CP and TP x CP models, the mesh, the training loop) is in the lesson's
# libraries, so that lesson 11 composes it from lesson10_solution_lib.
dtc_add_lesson(10 DIR 10_context_parallel SOURCES context_parallel.cpp sequence_parallel.cpp
               GIVEN context_attention_given.cpp context_parallel_given.cpp sequence_parallel_given.cpp
               DRIVER program.cpp
               TESTS tests/lesson10/attention_test.cpp tests/lesson10/training_test.cpp
                     tests/lesson10/memory_test.cpp tests/lesson10/sequence_parallel_test.cpp
                     tests/lesson10/timeline_test.cpp
               LIBS dtc::dist lesson08_solution_lib TORCH)

# End-to-end: the real program on real processes, each on a free port of its own, against the
# losses and parameter digest of lesson 02's single-process run of the same model (the course's
# baseline). A small model; every attention, contiguous and zig-zag, cp 2 and 4, dp x cp.
set(l10_model --steps 3 --layers 1 --hidden 32 --seq 16)
string(JOIN " " l10_model_args ${l10_model})
if(DTC_TORCHRUN)
  # the ring on a contiguous split: primary path only (the light path runs the ring zig-zag
  # through torchrun with tp 2 and sequence parallelism, and through mpirun, below)
  dtc_add_e2e(10 NAME torchrun_ring_cp2 TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ --json-equals cp=2 "--json-equals=attention=\"ring\""
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l10_model_args}"
    -- ${l10_model} --json)
  dtc_add_e2e(10 NAME torchrun_ring_zigzag_cp4 TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --json-equals cp=4 --json-equals zigzag=true
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l10_model_args}"
    -- ${l10_model} --zigzag --json)
  # --trace DIR, ring zig-zag cp 2: attention blocks (forward, and backward from the custom
  # Function's backward) and the ring's sends and receives traced, each send and receive of the
  # cp group and each allreduce of the replicas on one clock with its peers'.
  dtc_add_e2e(10 NAME torchrun_trace TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ --trace-check "step,fwd block,bwd block,attn,attn bwd,optimizer"
    --trace-groups cp,replicas
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l10_model_args}"
    -- ${l10_model} --zigzag --json)
  dtc_add_e2e(10 NAME torchrun_ulysses_cp2 TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ "--json-equals=attention=\"ulysses\""
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l10_model_args}"
    -- ${l10_model} --attention ulysses --json)
  dtc_add_e2e(10 NAME torchrun_allgather_dp2_cp2 TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --json-equals dp=2 --json-equals cp=2
    "--json-equals=attention=\"allgather\""
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l10_model_args}"
    -- ${l10_model} --dp 2 --attention allgather --zigzag --json)
  # Megatron's sequence parallelism on lesson 08's tensor parallelism (tp 2), and with cp 2 beside
  # it (4 ranks: TP groups [0,1] [2,3], CP groups [0,2] [1,3]).
  dtc_add_e2e(10 NAME torchrun_tp2_sp TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ --json-equals tp=2 --json-equals sequence_parallel=true
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l10_model_args}"
    -- ${l10_model} --tp 2 --sequence-parallel --json)
  dtc_add_e2e(10 NAME torchrun_tp2_cp2_sp TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --json-equals tp=2 --json-equals cp=2
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l10_model_args}"
    -- ${l10_model} --tp 2 --sequence-parallel --zigzag --json)
  # Bad input: every rank exits 2 before touching the network (torchrun then exits 1), the flag
  # to fix named: Ulysses on 3 ranks with 4 heads.
  dtc_add_e2e(10 NAME torchrun_ulysses_heads TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 3
    --program @PROGRAM@ --exit 1 --output "exitcode *: 2"
    --output "--heads: 4 heads do not split over cp 3"
    -- --steps 3 --layers 1 --hidden 32 --seq 18 --attention ulysses)
  # bf16 (LibTorch 2.x: 1.13's gloo has no bf16 collectives): lesson 02's bf16 run's losses
  # within e2e_run's 1e-3, each parameter's digest within 0.1 (as lessons 08 and 09).
  if(DTC_TORCH_VERSION VERSION_GREATER_EQUAL 2.0)
    dtc_add_e2e(10 NAME torchrun_ring_bf16 TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 2
      --program @PROGRAM@ "--json-equals=precision=\"bf16\""
      --losses-like $<TARGET_FILE:lesson02_solution>
      "--losses-like-args=${l10_model_args} --precision bf16" --digest-rtol 0.1
      -- ${l10_model} --precision bf16 --zigzag --json)
  endif()
endif()
# Through OpenMPI's mpirun (lesson 04's launcher detection), where the machine has it.
find_program(DTC_MPIRUN mpirun)
if(DTC_MPIRUN)
  dtc_add_e2e(10 NAME mpirun_ring_cp2 TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --launcher mpirun
    --nproc 2 --program @PROGRAM@ --json-equals cp=2 "--json-equals=launcher=\"mpirun\""
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l10_model_args}"
    -- ${l10_model} --zigzag --json)
endif()

# A smoke run of bench/lesson10_vs_pytorch.py (the overlap, the three attentions, and PyTorch's
# context_parallel, which on the CPU reports that it does not run): tiny sizes, one run each.
# Primary path only: the script needs the venv's PyTorch 2.x.
if(DTC_TORCHRUN AND DTC_FLAVOR STREQUAL "primary")
  get_filename_component(_l10_bin "${DTC_TORCHRUN}" DIRECTORY)
  add_test(NAME lesson10.solution.bench_smoke
    COMMAND "${_l10_bin}/python" "${PROJECT_SOURCE_DIR}/bench/lesson10_vs_pytorch.py"
            --binary $<TARGET_FILE:lesson10_solution> --nproc 2 --steps 2 --hidden 32
            --layers 1 --seq 32 --repeats 1)
  set_tests_properties(lesson10.solution.bench_smoke PROPERTIES
    ENVIRONMENT DTC_ZYGOTE_WORKERS=1
    LABELS "lesson10;solution;lesson10-solution" TIMEOUT 240)
endif()

# Lesson 01's planner against this lesson's measured traffic (tests/lesson10/planner_agreement_test.cpp):
# both reference solutions, where lesson 01 is built (the light path leaves it out).
if(TARGET lesson01_solution_lib)
  add_executable(lesson10_planner_tests tests/lesson10/planner_agreement_test.cpp
                 $<TARGET_OBJECTS:lesson10_driver>)
  target_link_libraries(lesson10_planner_tests PRIVATE lesson10_solution_lib lesson01_solution_lib
                        dtc_test_support dtc_test_main)
  dtc_use_torch_pch(lesson10_planner_tests GLUE)  # a test file: the -O0 header, as the lessons' tests
  set_target_properties(lesson10_planner_tests PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/tests")
  dtc_discover_tests(lesson10_planner_tests PREFIX "course.planner_vs_lesson10."
                     LABELS "lesson10;solution;lesson10-solution")
endif()

# Lesson 09: pipeline parallelism. Links dtc::dist (LibTorch's c10d, gloo; NCCL on CUDA builds).
dtc_add_lesson(09 DIR 09_pipeline_parallel SOURCES pipeline.cpp GIVEN pipeline_given.cpp DRIVER program.cpp
               TESTS tests/lesson09/schedule_test.cpp tests/lesson09/pipeline_test.cpp
                     tests/lesson09/program_test.cpp tests/lesson09/timeline_test.cpp
               LIBS dtc::dist TORCH)

# End-to-end: the real program on 4 processes through this path's torchrun, tiny sizes.
# Exit 0, 4 stages, and the losses of lesson 02's single-process run of the same (untied) model.
if(DTC_TORCHRUN)
  dtc_add_e2e(09 NAME torchrun TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 4 --program @PROGRAM@
    --json-equals stages=4 --losses-like $<TARGET_FILE:lesson02_solution>
    "--losses-like-args=--steps 3 --untied" -- --steps 3 --micro-batches 4 --sweep 1 4
    --sweep-steps 1 --json)
  # bf16 (both paths: the messages between stages are fp32): the real program on 2 stages exits
  # 0, reports "precision": "bf16" (its own report, not a measurement), has lesson 02's bf16
  # run's losses within e2e_run's rtol 1e-3, and each parameter's digest within 0.1
  # (micro-batches accumulate bf16 gradients). That catches a crash, a stage count other than
  # 2, parameters whose names or sizes differ from the baseline's, and training that goes
  # astray. It can hardly tell a bf16 run from an fp32 one: rtol 1e-3 of a loss near
  # ln 256 = 5.55 is 5.5e-3, wider than the 1.6e-3 at most that lesson 02 measured between bf16
  # and fp32 losses (its README, section 11), and the digest's 0.1 is there to let bf16's
  # rounding through. The guarantee is in-process:
  # L09Bf16.PipelineMatchesTheBf16BaselineWithinThePolicy (pipeline_test.cpp) holds the stages'
  # master weights within 1.5 noise floors of lesson 02's bf16 run and at least 0.25 of a floor
  # from its fp32 run, so that an fp32 run fails.
  dtc_add_e2e(09 NAME torchrun_bf16 TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 2 --program @PROGRAM@
    --json-equals stages=2 "--json-equals=precision=\"bf16\"" --losses-like $<TARGET_FILE:lesson02_solution>
    "--losses-like-args=--steps 3 --untied --precision bf16" --digest-rtol 0.1
    -- --steps 3 --micro-batches 4 --precision bf16 --no-sweep --json)
  # dp x pp: --stages 2 on 4 processes, 2 replicas of a 2-stage pipeline, each on half the batch
  # and averaging its gradients with the other: exit 0, the report's stages and replicas, and
  # lesson 02's losses and parameter digest (the whole batch's mean gradient).
  dtc_add_e2e(09 NAME torchrun_replicas TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --json-equals stages=2 --json-equals replicas=2 --losses-like
    $<TARGET_FILE:lesson02_solution> "--losses-like-args=--steps 3 --untied"
    -- --steps 3 --stages 2 --micro-batches 2 --no-sweep --json)
  # --trace DIR on 4 stages: the micro-batch spans F<i>/B<i> on every stage, the drawing.
  dtc_add_e2e(09 NAME torchrun_trace TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --trace-check "step,F0,F3,B0,B3,fwd block,optimizer" --losses-like
    $<TARGET_FILE:lesson02_solution> "--losses-like-args=--steps 3 --untied"
    -- --steps 3 --micro-batches 4 --no-sweep --json)
endif()

# A smoke run (not the benchmark itself) of bench/lesson09_vs_pytorch.py: tiny sizes, 2 ranks.
# Primary path only: it needs PyTorch's torch.distributed.pipelining (the venv's 2.x; Debian's
# 1.13 has no such module). The real run: see the lesson README, section 10.
if(DTC_TORCHRUN AND DTC_FLAVOR STREQUAL "primary")
  get_filename_component(_l09_bin "${DTC_TORCHRUN}" DIRECTORY)
  add_test(NAME lesson09.solution.bench_smoke
    COMMAND "${_l09_bin}/python" "${PROJECT_SOURCE_DIR}/bench/lesson09_vs_pytorch.py"
            --binary $<TARGET_FILE:lesson09_solution> --torchrun "${DTC_TORCHRUN}" --nproc 2
            --steps 2 --layers 2 --hidden 32 --heads 2 --seq 16 --schedule 1f1b)
  set_tests_properties(lesson09.solution.bench_smoke PROPERTIES
    ENVIRONMENT DTC_ZYGOTE_WORKERS=1
    LABELS "lesson09;solution;lesson09-solution" TIMEOUT 120)
endif()

# Composition (tests/composition/pp_tp_test.cpp): lesson 08's tensor-parallel blocks inside this
# lesson's stages, pp 2 x tp 2, one step of 1F1B, interleaved and ZB-H1 against one process's
# gradients. Both reference solutions; lesson 11 builds on it.
if(TARGET lesson08_solution_lib)
  add_executable(composition_tests tests/composition/pp_tp_test.cpp)
  target_include_directories(composition_tests PRIVATE
    "${PROJECT_SOURCE_DIR}/lessons/08_tensor_parallel" "${PROJECT_SOURCE_DIR}/lessons/09_pipeline_parallel")
  target_link_libraries(composition_tests PRIVATE lesson09_solution_lib lesson08_solution_lib
                        dtc_test_support dtc_test_main)
  dtc_use_torch_pch(composition_tests GLUE)  # a test file: the -O0 header, as the lessons' tests
  set_target_properties(composition_tests PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/tests")
  dtc_discover_tests(composition_tests PREFIX "course.composition." LABELS "course;lesson08;lesson08-solution;lesson09;lesson09-solution")
endif()

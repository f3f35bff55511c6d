# Lesson 08: tensor parallelism (Megatron-LM style). Links dtc::dist (LibTorch's c10d, gloo).
dtc_add_lesson(08 DIR 08_tensor_parallel SOURCES tensor_parallel.cpp DRIVER program.cpp
               TESTS tests/lesson08/ops_test.cpp tests/lesson08/modules_test.cpp
                     tests/lesson08/training_test.cpp tests/lesson08/given_test.cpp
               LIBS dtc::dist TORCH)

# End-to-end: the real program on real processes, through the torchrun of this build's path
# (DTC_TORCHRUN, DtcTorch.cmake). --standalone's port is fixed on 1.13: one at a time.
if(DTC_TORCHRUN)
  # tp 2 on 2 ranks, a small model, with --json.
  add_test(NAME lesson08.solution.torchrun_tp2
    COMMAND "${DTC_TORCHRUN}" --standalone --nproc_per_node=2 ${DTC_TORCHRUN_FLAGS}
            --no_python $<TARGET_FILE:lesson08_solution> --steps 3 --layers 1 --hidden 32
            --seq 16 --json)
  set_tests_properties(lesson08.solution.torchrun_tp2 PROPERTIES
    PASS_REGULAR_EXPRESSION "\"tp\":2" RESOURCE_LOCK "${DTC_TORCHRUN_LOCK}"
    LABELS "lesson08;solution;lesson08-solution" TIMEOUT 120)
  # dp 2 x tp 2 on 4 ranks (the rank grid: TP groups [0,1] [2,3], DP groups [0,2] [1,3]).
  add_test(NAME lesson08.solution.torchrun_dp2_tp2
    COMMAND "${DTC_TORCHRUN}" --standalone --nproc_per_node=4 ${DTC_TORCHRUN_FLAGS}
            --no_python $<TARGET_FILE:lesson08_solution> --dp 2 --tp 2 --steps 3 --layers 1
            --hidden 32 --seq 16 --json)
  set_tests_properties(lesson08.solution.torchrun_dp2_tp2 PROPERTIES
    PASS_REGULAR_EXPRESSION "\"dp\":2" RESOURCE_LOCK "${DTC_TORCHRUN_LOCK}"
    LABELS "lesson08;solution;lesson08-solution" TIMEOUT 120)
endif()

# A smoke run of the benchmark against PyTorch's DTensor tensor parallelism (primary path only:
# DTensor needs the venv's PyTorch 2.x). Tiny sizes, 3 steps; the script picks its own ports.
if(DTC_TORCHRUN AND DTC_FLAVOR STREQUAL "primary")
  get_filename_component(dtc_l08_bin "${DTC_TORCHRUN}" DIRECTORY)
  add_test(NAME lesson08.solution.bench_smoke
    COMMAND "${dtc_l08_bin}/python" "${PROJECT_SOURCE_DIR}/bench/lesson08_vs_pytorch.py"
            --binary $<TARGET_FILE:lesson08_solution> --nproc 2 --steps 3 --hidden 32
            --layers 1 --seq 16 --batch 4)
  set_tests_properties(lesson08.solution.bench_smoke PROPERTIES
    LABELS "lesson08;solution;lesson08-solution" TIMEOUT 180)
endif()

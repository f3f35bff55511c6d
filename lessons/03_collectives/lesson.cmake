# Lesson 03: process groups and collectives. Links dtc::dist (LibTorch's c10d, gloo).
dtc_add_lesson(03 DIR 03_collectives SOURCES collectives.cpp DRIVER program.cpp
               TESTS tests/lesson03/tour_test.cpp tests/lesson03/grid_test.cpp
                     tests/lesson03/ring_test.cpp tests/lesson03/program_test.cpp
               LIBS dtc::dist TORCH)

# The collectives benchmark (nccl-tests style), on the reference solution's ring allreduce:
#   torchrun --standalone --nproc_per_node=2 --no_python build/bin/bench_collectives
add_executable(bench_collectives "${PROJECT_SOURCE_DIR}/bench/collectives.cpp")
target_link_libraries(bench_collectives PRIVATE lesson03_solution_lib dtc::dist)
target_compile_options(bench_collectives PRIVATE ${DTC_WARNINGS})
dtc_use_torch_pch(bench_collectives)

# End-to-end: the real programs on real processes, through the torchrun of this build's path
# (DTC_TORCHRUN, DtcTorch.cmake). The benchmark uses --standalone, whose port is fixed on 1.13.
if(DTC_TORCHRUN)
  # The program on 3 ranks (an odd world: uneven ring chunks), with --json: exit 0, and every
  # part's own check true (the tour's closed forms, the grid, the ring against gloo).
  dtc_add_e2e(03 NAME torchrun TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 3 --program @PROGRAM@
    --json-true ok --json-true ring.ok --json-true grid.ok --json-true tour.broadcast
    --json-true tour.allreduce --json-true tour.allgather --json-true tour.reduce
    --json-true tour.alltoall --json-true tour.send/recv --json-true tour.barrier
    --json-equals ring.max_abs_diff=0 -- --numel 1001 --json)
  # A smoke run of the benchmark (not the benchmark itself): small sizes, 2 iterations.
  add_test(NAME lesson03.solution.bench_smoke
    COMMAND "${DTC_TORCHRUN}" --standalone --nproc_per_node=2 ${DTC_TORCHRUN_FLAGS}
            --no_python $<TARGET_FILE:bench_collectives> --max-bytes 64K --iters 2 --warmup 1)
  set_tests_properties(lesson03.solution.bench_smoke PROPERTIES RESOURCE_LOCK "${DTC_TORCHRUN_LOCK}"
    LABELS "lesson03;solution;lesson03-solution" TIMEOUT 120)
endif()

# Lesson 08: tensor parallelism (Megatron-LM style). Links dtc::dist (LibTorch's c10d, gloo).
dtc_add_lesson(08 DIR 08_tensor_parallel SOURCES tensor_parallel.cpp GIVEN tensor_parallel_given.cpp
               DRIVER program.cpp
               TESTS tests/lesson08/ops_test.cpp tests/lesson08/modules_test.cpp
                     tests/lesson08/training_test.cpp tests/lesson08/given_test.cpp
                     tests/lesson08/timeline_test.cpp
               LIBS dtc::dist TORCH)

# End-to-end: the real program on real processes, through the torchrun of this build's path
# (DTC_TORCHRUN, DtcTorch.cmake), each on a free port of its own.
if(DTC_TORCHRUN)
  # tp 2 on 2 ranks, and dp 2 x tp 2 on 4 (the rank grid: TP groups [0,1] [2,3], DP groups
  # [0,2] [1,3]), a small model: exit 0, the grid, and the losses of lesson 02's single-process
  # run of the same model (the course's baseline).
  set(l08_model --steps 3 --layers 1 --hidden 32 --seq 16)
  string(JOIN " " l08_model_args ${l08_model})
  # tp 2 alone: primary path only (dp 2 x tp 2 below runs the same blocks on both paths)
  dtc_add_e2e(08 NAME torchrun_tp2 TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ --json-equals tp=2 --json-equals dp=1
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l08_model_args}"
    -- ${l08_model} --json)
  dtc_add_e2e(08 NAME torchrun_dp2_tp2 TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --json-equals tp=2 --json-equals dp=2
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l08_model_args}"
    -- --dp 2 --tp 2 ${l08_model} --json)
  # --trace DIR, tp 2: the blocks' spans, the optimizer's, and the tp group's allreduces, on
  # one clock across the group.
  dtc_add_e2e(08 NAME torchrun_trace TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ --trace-check "step,fwd block,bwd block,optimizer" --trace-groups tp
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l08_model_args}"
    -- ${l08_model} --json)
  # bf16 (LibTorch 2.x: 1.13's gloo has no bf16 collectives): the real program under torchrun
  # exits 0, reports "precision": "bf16" (its own report, not a measurement), has the losses of
  # lesson 02's bf16 run (fp32 master weights) within e2e_run's rtol 1e-3, and each parameter's
  # digest within 0.1 (TP rounds its partial sums to bf16). That catches a crash, a tp other
  # than 2, parameters whose names or sizes differ from the baseline's, and training that goes
  # astray. It can hardly tell a bf16 run from an fp32 one: rtol 1e-3 of a loss near
  # ln 256 = 5.55 is 5.5e-3, wider than the 1.6e-3 at most that lesson 02 measured between bf16
  # and fp32 losses (its README, section 11), and the digest's 0.1 is there to let bf16's
  # rounding through. The guarantee is in-process:
  # L08Bf16.TpMatchesTheBf16BaselineWithinThePolicy (training_test.cpp) holds the master
  # weights within 1.5 noise floors of lesson 02's bf16 run and at least 0.25 of a floor from
  # its fp32 run, so that an fp32 run fails.
  if(DTC_TORCH_VERSION VERSION_GREATER_EQUAL 2.0)
    dtc_add_e2e(08 NAME torchrun_tp2_bf16 TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 2
      --program @PROGRAM@ --json-equals tp=2 "--json-equals=precision=\"bf16\""
      --losses-like $<TARGET_FILE:lesson02_solution>
      "--losses-like-args=${l08_model_args} --precision bf16" --digest-rtol 0.1
      -- ${l08_model} --precision bf16 --json)
  endif()
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
    ENVIRONMENT DTC_ZYGOTE_WORKERS=1
    LABELS "lesson08;solution;lesson08-solution" TIMEOUT 180)
endif()

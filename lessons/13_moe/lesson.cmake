# Lesson 13: mixture of experts and expert parallelism. The MoE layer in the course's GPT (its
# router, experts and single-device computation given, moe_given.cpp), the all-to-all dispatch
# and combine, the losses, the gradient reduction and the bias step yours (moe.cpp).
dtc_add_lesson(13 DIR 13_moe SOURCES moe.cpp GIVEN moe_given.cpp DRIVER program.cpp
               TESTS tests/lesson13/moe_test.cpp
               LIBS dtc::dist TORCH)

# End-to-end: the real program on real processes against its own single-process run (the
# single-device MoE, itself checked against PyTorch in tests/lesson13): the losses, the parameter
# digest, and the router's choices per step, layer and expert, identical.
set(l13_model --steps 3 --layers 2 --hidden 32 --heads 2 --seq 16)
string(JOIN " " l13_model_args ${l13_model})
if(DTC_TORCHRUN)
  dtc_add_e2e(13 NAME torchrun_ep2 TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ --json-equals ep=2 --json-equals edp=1 --json-same router_counts
    --losses-like $<TARGET_FILE:lesson13_solution> "--losses-like-args=${l13_model_args}"
    -- ${l13_model} --ep 2 --json)
  # 4 ranks, ep 2 x edp 2: expert gradients reduced over their replicas; sigmoid scores, the
  # auxiliary-loss-free bias, a shared expert and the z-loss
  set(l13_bias --score-func sigmoid --route-norm --balance bias --bias-rate 0.01
      --shared-experts 1 --z-loss-coef 0.001)
  string(JOIN " " l13_bias_args ${l13_bias})
  dtc_add_e2e(13 NAME torchrun_ep2_edp2_bias TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN}
    --nproc 4 --program @PROGRAM@ --json-equals ep=2 --json-equals edp=2
    --json-same router_counts --losses-like $<TARGET_FILE:lesson13_solution>
    "--losses-like-args=${l13_model_args} ${l13_bias_args}"
    -- ${l13_model} ${l13_bias} --ep 2 --json)
  dtc_add_e2e(13 NAME torchrun_ep4_e8 TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --json-equals ep=4 --json-same router_counts
    --losses-like $<TARGET_FILE:lesson13_solution>
    "--losses-like-args=${l13_model_args} --experts 8"
    -- ${l13_model} --experts 8 --ep 4 --json)
  # --trace DIR: every rank's timeline (blocks forward and backward, AdamW's step), checked as
  # lesson 10's are; what gpu-check runs on NCCL.
  dtc_add_e2e(13 NAME torchrun_trace TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 2
    --program @PROGRAM@ --trace-check "step,fwd block,bwd block,optimizer"
    --losses-like $<TARGET_FILE:lesson13_solution> "--losses-like-args=${l13_model_args}"
    -- ${l13_model} --ep 2 --json)
  # Bad input: every rank exits 2 before touching the network, the flag to fix named (the
  # course's own check, before LibTorch is called: primary path only).
  dtc_add_e2e(13 NAME torchrun_ep_not_dividing TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 3
    --program @PROGRAM@ --exit 1 --output "exitcode *: 2"
    --output "--ep: 4 experts do not split evenly over ep 3"
    -- ${l13_model})
endif()
find_program(DTC_MPIRUN mpirun)
if(DTC_MPIRUN)
  dtc_add_e2e(13 NAME mpirun_ep2 TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --launcher mpirun
    --nproc 2 --program @PROGRAM@ --json-equals ep=2 "--json-equals=launcher=\"mpirun\""
    --json-same router_counts --losses-like $<TARGET_FILE:lesson13_solution>
    "--losses-like-args=${l13_model_args}" -- ${l13_model} --ep 2 --json)
endif()

# Lesson 01's ledger against this lesson's model and memory (tests/lesson13/ledger_agreement_test.cpp):
# both reference solutions, where lesson 01 is built (the light path leaves it out).
if(TARGET lesson01_solution_lib)
  add_executable(lesson13_ledger_tests tests/lesson13/ledger_agreement_test.cpp)
  target_link_libraries(lesson13_ledger_tests PRIVATE lesson13_solution_lib lesson01_solution_lib
                        dtc_test_support dtc_test_main)
  dtc_use_torch_pch(lesson13_ledger_tests GLUE)  # a test file: the -O0 header, as the lessons' tests
  set_target_properties(lesson13_ledger_tests PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/tests")
  dtc_discover_tests(lesson13_ledger_tests PREFIX "course.ledger_vs_lesson13."
                     LABELS "lesson13;solution;lesson13-solution")
endif()

# A smoke run of bench/lesson13_vs_pytorch.py (one process and ep 2 against PyTorch, the same
# losses and router counts, the all-to-all bytes and PyTorch's dispatch time): tiny sizes, one run
# each. Primary path only: the script needs the venv's PyTorch 2.x.
if(DTC_TORCHRUN AND DTC_FLAVOR STREQUAL "primary")
  get_filename_component(_l13_bin "${DTC_TORCHRUN}" DIRECTORY)
  add_test(NAME lesson13.solution.bench_smoke
    COMMAND "${_l13_bin}/python" "${PROJECT_SOURCE_DIR}/bench/lesson13_vs_pytorch.py"
            --binary $<TARGET_FILE:lesson13_solution> --nproc 2 --steps 3 --layers 2
            --hidden 32 --heads 2 --seq 16 --repeats 1)
  set_tests_properties(lesson13.solution.bench_smoke PROPERTIES
    ENVIRONMENT DTC_ZYGOTE_WORKERS=1
    LABELS "lesson13;solution;lesson13-solution" TIMEOUT 240)
endif()

# Lesson 02: the single-device baseline. Trains the course's GPT (common/: dtc::dist) on one
# device; the program runs as one process.
dtc_add_lesson(02 DIR 02_baseline SOURCES baseline.cpp mixed.cpp GIVEN mixed_given.cpp DRIVER program.cpp
               TESTS tests/lesson02/model_test.cpp tests/lesson02/baseline_test.cpp
                     tests/lesson02/program_test.cpp tests/lesson02/mixed_test.cpp
               LIBS dtc::dist TORCH)

# PyTorch's 16-bit CPU kernels differ between CPUs (with AVX-512 or without, for one), and so do
# the weights of the reference's bf16 and fp16 runs, by more than the tests' policy allows
# between two machines. So the reference is computed again here, once per build folder (about
# 10 s), by the PyTorch whose LibTorch the lesson links: LibTorch against PyTorch on the same
# kernels, as the policy means. tests/lesson02/reference.h reads BUILD/reference/ first. The
# interpreters tried, in order: the one the Makefile passes (DTC_TORCH_PYTHON, the venv's), the
# venv's beside the LibTorch, Debian's /usr/bin/python3 (python3-torch, the build of the light
# path's libtorch-dev). The first that imports the linked LibTorch's version is used; PyTorch 1.13
# cannot run the fp16 cases on the CPU, which it takes from the committed file (--base). With none
# (a bundle build on a GPU node, say), the committed file is read.
get_filename_component(_l02_venv_python "${DTC_TORCH_ROOT}/../../../../bin/python" ABSOLUTE)
set(_l02_python "")
foreach(_candidate IN ITEMS "${DTC_TORCH_PYTHON}" "${_l02_venv_python}" /usr/bin/python3)
  if(_l02_python OR NOT _candidate OR NOT EXISTS "${_candidate}")
    continue()
  endif()
  execute_process(COMMAND "${_candidate}" -c "import torch; print(torch.__version__.split('+')[0])"
                  OUTPUT_VARIABLE _l02_version RESULT_VARIABLE _l02_rc
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_l02_rc EQUAL 0 AND _l02_version VERSION_EQUAL DTC_TORCH_VERSION)
    set(_l02_python "${_candidate}")
  endif()
endforeach()
if(_l02_python)
  set(_l02_mixed "${CMAKE_BINARY_DIR}/reference/lesson02_mixed.json")
  set(_l02_committed "${PROJECT_SOURCE_DIR}/tests/reference/lesson02_mixed.json")
  # computed again when the LibTorch changes (its version file, where it has one)
  set(_l02_torch_stamp "")
  if(EXISTS "${DTC_TORCH_ROOT}/version.py")
    set(_l02_torch_stamp "${DTC_TORCH_ROOT}/version.py")
  endif()
  add_custom_command(
    OUTPUT "${_l02_mixed}"
    COMMAND "${_l02_python}" "${PROJECT_SOURCE_DIR}/tests/reference/lesson02_mixed.py"
            --out "${_l02_mixed}" --base "${_l02_committed}"
    DEPENDS "${PROJECT_SOURCE_DIR}/tests/reference/lesson02_mixed.py"
            "${PROJECT_SOURCE_DIR}/tests/reference/lesson02_reference.py" "${_l02_committed}"
            ${_l02_torch_stamp}
    COMMENT "PyTorch ${DTC_TORCH_VERSION} computes lesson 02's 16-bit reference on this machine"
    VERBATIM)
  file(MAKE_DIRECTORY "${CMAKE_BINARY_DIR}/reference")
  add_custom_target(lesson02_machine_reference DEPENDS "${_l02_mixed}")
  add_dependencies(lesson02_testobj lesson02_machine_reference)
else()
  message(STATUS "dtc: lesson 02 reads the committed 16-bit reference (no PyTorch "
                 "${DTC_TORCH_VERSION} found to compute it on this machine)")
endif()

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

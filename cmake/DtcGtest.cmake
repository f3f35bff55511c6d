# dtc_discover_tests(<target> PREFIX <prefix> LABELS <labels> [WORKING_DIRECTORY <dir>])
# The GoogleTest cases of <target> as ctest entries <prefix><Suite>.<Test>, one each, with the
# labels LABELS, as gtest_discover_tests registers them, but the program runs once per ctest run
# instead of once per case (tests/support/gtest_once.py): one more entry, <prefix>run_once, runs
# every case and keeps each one's result and output, and each case's entry reports its own (a
# case without a result, after a crash or a hang, runs by itself). A LibTorch program's start
# costs about 0.6 s, most of a unit test's time; DTC_GTEST_ISOLATE=1 in the environment runs
# each case in its own process again.
set(DTC_GTEST_ONCE "${PROJECT_SOURCE_DIR}/tests/support/gtest_once.py")
# The interpreter itself, not a wrapper that finds it (pyenv's shim costs 0.1 s a start), without
# site-packages (-S): the script needs only the standard library, and a case's entry starts in
# about 25 ms.
execute_process(COMMAND "${Python3_EXECUTABLE}" -c "import sys; print(sys.executable)"
  OUTPUT_VARIABLE DTC_GTEST_PYTHON OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0 OR NOT EXISTS "${DTC_GTEST_PYTHON}")
  set(DTC_GTEST_PYTHON "${Python3_EXECUTABLE}")
endif()
function(dtc_discover_tests target)
  cmake_parse_arguments(D "" "PREFIX;WORKING_DIRECTORY" "LABELS" ${ARGN})
  if(NOT D_WORKING_DIRECTORY)
    set(D_WORKING_DIRECTORY "${CMAKE_CURRENT_BINARY_DIR}")
  endif()
  set(fixture ${D_PREFIX}run_once)
  add_test(NAME ${fixture}
    COMMAND "${DTC_GTEST_PYTHON}" -S "${DTC_GTEST_ONCE}" run $<TARGET_FILE:${target}> --timeout 600
    WORKING_DIRECTORY "${D_WORKING_DIRECTORY}")
  # COST: a program's run comes before the entries that wait for it, and early in the run.
  set_tests_properties(${fixture} PROPERTIES FIXTURES_SETUP ${fixture} TIMEOUT 700 COST 1000
                       LABELS "${D_LABELS}")
  set_target_properties(${target} PROPERTIES
    CROSSCOMPILING_EMULATOR "${DTC_GTEST_PYTHON};-S;${DTC_GTEST_ONCE}")
  string(MAKE_C_IDENTIFIER "${target}" list_var)
  gtest_discover_tests(${target}
    TEST_PREFIX "${D_PREFIX}"
    TEST_LIST ${list_var}_TESTS
    WORKING_DIRECTORY "${D_WORKING_DIRECTORY}"
    PROPERTIES TIMEOUT 120 FIXTURES_REQUIRED ${fixture}
    DISCOVERY_TIMEOUT 60)
  # Several labels per discovered test: gtest_discover_tests cannot pass a list, so set them
  # from the discovered names, in a file that ctest reads after the discovery's own.
  set(labels_file "${PROJECT_BINARY_DIR}/${target}_labels.cmake")
  file(WRITE "${labels_file}"
    "if(${list_var}_TESTS)\n"
    "  set_tests_properties(\${${list_var}_TESTS} PROPERTIES LABELS \"${D_LABELS}\")\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${labels_file}")
endfunction()

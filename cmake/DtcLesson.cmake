# dtc_add_lesson(NN DIR <NN_topic> SOURCES <files> [DRIVER <files>] TESTS <files> LIBS <libs>
#                [TORCH])
# TORCH: the lesson includes LibTorch (LIBS has dtc::dist): reuse the precompiled header, and
# the test programs' main() makes CPU math reproducible (tests/support/test_main.cpp).
# With -DDTC_SUBMISSION=<dir> (a copy of lessons/), the learner flavour compiles the exercise
# files from <dir>/<NN_topic>/ instead; headers, drivers and tests stay the course's own.
#
# Builds one lesson twice, from the same contract header (lessons/<NN_topic>/*.h):
#   learner:  the exercise files lessons/<NN_topic>/<SOURCES>
#   solution: the reference    solutions/<NN_topic>/<SOURCES>
# into
#   lessonNN, lessonNN_solution              programs in build/bin/ (main.cpp + DRIVER)
#   lessonNN_tests, lessonNN_solution_tests  GoogleTest binaries in build/tests/
# The driver and the test files do not depend on the flavour: they are compiled once.
# ctest names are lessonNN.<flavour>.<Suite>.<Test>; labels lessonNN, <flavour>,
# lessonNN-<flavour>. One more test, lessonNN.bite, checks that the learner suite fails on
# every TODO of the untouched exercise (scripts/check_bite.py).
#
# The light path (LibTorch 1.13) tests what differs between LibTorch generations, and skips what
# cannot differ (DTC_LIGHT_FULL=ON builds it all): a lesson without LibTorch (lesson 01) is not
# added at all, and the learner flavour (exercise = solution with its regions replaced by
# DTC_TODO stubs) is built only on request (`cmake --build build-light --target lesson06`), with
# no ctest entries and no bite check.
function(dtc_add_lesson num)
  cmake_parse_arguments(L "TORCH" "DIR" "SOURCES;DRIVER;TESTS;LIBS" ${ARGN})
  set(name lesson${num})
  # main() of the test programs: with LibTorch, one that makes CPU math reproducible
  # (tests/support/test_main.cpp); without, Google Test's own.
  set(test_main GTest::gtest_main)
  if(L_TORCH)
    set(test_main dtc_test_main)
  endif()
  set(light_trim OFF)
  if(DTC_FLAVOR STREQUAL "light" AND NOT DTC_LIGHT_FULL AND NOT DTC_SUBMISSION)
    if(NOT L_TORCH)
      return()
    endif()
    set(light_trim ON)
  endif()
  set(ldir "${PROJECT_SOURCE_DIR}/lessons/${L_DIR}")
  set(sdir "${PROJECT_SOURCE_DIR}/solutions/${L_DIR}")

  # Flavour-independent objects: the lesson's given driver code, and the tests.
  set(driver_objs)
  if(L_DRIVER)
    list(TRANSFORM L_DRIVER PREPEND "${ldir}/")
    add_library(${name}_driver OBJECT ${L_DRIVER})
    target_include_directories(${name}_driver PUBLIC "${ldir}")
    target_link_libraries(${name}_driver PUBLIC ${L_LIBS})
    target_compile_options(${name}_driver PRIVATE ${DTC_WARNINGS})
    set(driver_objs $<TARGET_OBJECTS:${name}_driver>)
  endif()

  # The tests: one unity translation unit per lesson (DTC_UNITY_TESTS), so that LibTorch's
  # precompiled header is loaded, and GoogleTest's and LibTorch's templates instantiated, once
  # per lesson instead of once per test file.
  add_library(${name}_testobj OBJECT ${L_TESTS})
  target_link_libraries(${name}_testobj PUBLIC ${L_LIBS} dtc_test_support GTest::gtest)
  target_include_directories(${name}_testobj PUBLIC "${ldir}")
  if(DTC_UNITY_TESTS)
    set_target_properties(${name}_testobj PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)
  endif()
  # main.cpp is the same for both flavours: compiled once.
  add_library(${name}_main OBJECT "${ldir}/main.cpp")
  target_link_libraries(${name}_main PUBLIC ${L_LIBS})
  target_include_directories(${name}_main PUBLIC "${ldir}")
  set(pch_targets ${name}_testobj ${name}_main)
  if(L_DRIVER)
    list(APPEND pch_targets ${name}_driver)
  endif()

  foreach(flavour learner solution)
    if(flavour STREQUAL "learner")
      set(src "${ldir}")
      if(DTC_SUBMISSION)  # grading: the learner's files from a submission (scripts/grade.py)
        set(src "${DTC_SUBMISSION}/${L_DIR}")
      endif()
      set(suffix "")
    else()
      set(src "${sdir}")
      set(suffix "_solution")
    endif()
    set(lib ${name}${suffix}_lib)
    set(files)
    foreach(f IN LISTS L_SOURCES)
      list(APPEND files "${src}/${f}")
    endforeach()
    add_library(${lib} STATIC ${files})
    target_include_directories(${lib} PUBLIC "${ldir}")
    target_link_libraries(${lib} PUBLIC ${L_LIBS})
    target_compile_options(${lib} PRIVATE ${DTC_WARNINGS})
    list(APPEND pch_targets ${lib})

    add_executable(${name}${suffix} $<TARGET_OBJECTS:${name}_main> ${driver_objs})
    target_link_libraries(${name}${suffix} PRIVATE ${lib})

    add_executable(${name}${suffix}_tests $<TARGET_OBJECTS:${name}_testobj> ${driver_objs})
    target_link_libraries(${name}${suffix}_tests PRIVATE ${lib} dtc_test_support ${test_main})
    set_target_properties(${name}${suffix}_tests PROPERTIES
      RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/tests")
    if(light_trim AND flavour STREQUAL "learner")
      set_target_properties(${lib} ${name}${suffix} ${name}${suffix}_tests PROPERTIES
        EXCLUDE_FROM_ALL ON)
      continue()
    endif()
    gtest_discover_tests(${name}${suffix}_tests
      TEST_PREFIX "${name}.${flavour}."
      TEST_LIST ${name}${suffix}_TESTS
      PROPERTIES TIMEOUT 120
      DISCOVERY_TIMEOUT 60)
    # Several labels per discovered test: gtest_discover_tests cannot pass a list, so set them
    # from the discovered names, in a file that ctest reads after the discovery's own.
    set(labels_file "${PROJECT_BINARY_DIR}/${name}${suffix}_labels.cmake")
    file(WRITE "${labels_file}"
      "if(${name}${suffix}_TESTS)\n"
      "  set_tests_properties(\${${name}${suffix}_TESTS} PROPERTIES LABELS "
      "\"${name};${flavour};${name}-${flavour}\")\n"
      "endif()\n")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${labels_file}")
  endforeach()

  if(L_TORCH)
    foreach(t IN LISTS pch_targets)
      dtc_use_torch_pch(${t})
    endforeach()
  endif()

  if(light_trim)
    return()
  endif()
  add_test(NAME ${name}.bite
    COMMAND Python3::Interpreter "${PROJECT_SOURCE_DIR}/scripts/check_bite.py"
            --lesson L${num} "$<TARGET_FILE:${name}_tests>")
  set_tests_properties(${name}.bite PROPERTIES LABELS "${name};bite" TIMEOUT 300)
endfunction()

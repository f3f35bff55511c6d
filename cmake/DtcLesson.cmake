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
  # Given code around LibTorch's calls, at -O0 (DtcTorch.cmake); the solution at -O1.
  set(glue_targets ${name}_testobj ${name}_main)
  if(L_DRIVER)
    list(APPEND glue_targets ${name}_driver)
  endif()
  set(pch_targets)

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
    if(flavour STREQUAL "learner" AND CMAKE_CXX_COMPILER_ID MATCHES "Clang")
      # An untouched exercise leaves unused the fields and constants that its TODOs will use.
      target_compile_options(${lib} PRIVATE -Wno-unused-private-field -Wno-unused-const-variable)
    endif()
    if(flavour STREQUAL "learner")
      set(exercise_lib ${lib})  # compiled at -O0: the learner's edit-build-test loop
    else()
      list(APPEND pch_targets ${lib})
    endif()

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
    dtc_discover_tests(${name}${suffix}_tests PREFIX "${name}.${flavour}."
                       LABELS "${name};${flavour};${name}-${flavour}")
  endforeach()

  # The mutants of this lesson in DTC_MUTANT_SUBSET (top CMakeLists.txt): the solution library
  # with the mutated file (scripts/mutants.py --write-mutant), linked with the same test objects.
  foreach(entry IN LISTS DTC_MUTANT_SUBSET)
    if(NOT entry MATCHES "^${num}/(.+)$")
      continue()
    endif()
    set(mid "${CMAKE_MATCH_1}")
    string(MAKE_C_IDENTIFIER "${mid}" mtarget)
    set(mtarget ${name}_mutant_${mtarget})
    set(mdir "${PROJECT_BINARY_DIR}/mutants/${num}_${mid}")
    set(mutants_py "${PROJECT_SOURCE_DIR}/scripts/mutants.py")
    execute_process(COMMAND "${Python3_EXECUTABLE}" "${mutants_py}" --write-mutant ${num} ${mid} "${mdir}"
      OUTPUT_VARIABLE mfile OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "mutant ${num}/${mid} of DTC_MUTANT_SUBSET: ${err}")
    endif()
    set(catalogue "${PROJECT_SOURCE_DIR}/tests/mutants/lesson${num}.toml")
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${catalogue}")
    add_custom_command(OUTPUT "${mdir}/${mfile}"
      COMMAND "${Python3_EXECUTABLE}" "${mutants_py}" --write-mutant ${num} ${mid} "${mdir}"
      DEPENDS "${sdir}/${mfile}" "${catalogue}" "${mutants_py}"
      COMMENT "Mutant ${num}/${mid}: ${mfile}" VERBATIM)
    set(files)
    foreach(f IN LISTS L_SOURCES)
      if(f STREQUAL mfile)
        list(APPEND files "${mdir}/${f}")
      else()
        list(APPEND files "${sdir}/${f}")
      endif()
    endforeach()
    add_library(${mtarget}_lib STATIC ${files})
    target_include_directories(${mtarget}_lib PUBLIC "${ldir}" PRIVATE "${sdir}")
    target_link_libraries(${mtarget}_lib PUBLIC ${L_LIBS})
    add_executable(${mtarget}_tests $<TARGET_OBJECTS:${name}_testobj> ${driver_objs})
    target_link_libraries(${mtarget}_tests PRIVATE ${mtarget}_lib dtc_test_support ${test_main})
    set_target_properties(${mtarget}_tests PROPERTIES
      RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/tests/mutants")
    list(APPEND pch_targets ${mtarget}_lib)
  endforeach()

  if(L_TORCH)
    foreach(t IN LISTS pch_targets)
      dtc_use_torch_pch(${t})
    endforeach()
    foreach(t IN LISTS glue_targets)
      dtc_use_torch_pch(${t} GLUE)
    endforeach()
    dtc_use_torch_pch(${exercise_lib} EXERCISE)
  else()
    foreach(t IN LISTS glue_targets)
      target_compile_options(${t} PRIVATE -O0)
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

# dtc_add_e2e(NN NAME <name> [TIMEOUT <s>] [SKIP_RETURN_CODE <c>] [RESOURCE_LOCK <lock>]
#             COMMAND <args...>)
# An end-to-end test of lesson NN's program on real processes, registered twice: for the
# reference solution (lessonNN.solution.e2e.<name>) and for the learner's own program
# (lessonNN.learner.e2e.<name>, where the learner flavour is built: not on the trimmed light
# path), so that `make test-lessonNN` and the grader run the learner's launch and training code
# under a real launcher. In COMMAND, @PROGRAM@ stands for the flavour's program. Labels: lessonNN,
# <flavour>, lessonNN-<flavour>, e2e (`make test-lessonNN` runs these after the unit tests pass).
function(dtc_add_e2e num)
  cmake_parse_arguments(E "" "NAME;TIMEOUT;SKIP_RETURN_CODE;RESOURCE_LOCK" "COMMAND" ${ARGN})
  if(NOT E_TIMEOUT)
    set(E_TIMEOUT 180)
  endif()
  set(flavours solution)
  if(NOT (DTC_FLAVOR STREQUAL "light" AND NOT DTC_LIGHT_FULL AND NOT DTC_SUBMISSION))
    list(APPEND flavours learner)
  endif()
  # The programs the run names besides the lesson's own (lesson 02's reference, for the losses
  # to compare with): built with the lesson's tests, so that `make test-lessonNN` has them.
  string(REGEX MATCHALL "\\$<TARGET_FILE:[A-Za-z0-9_]+>" used "${E_COMMAND}")
  foreach(u IN LISTS used)
    string(REGEX REPLACE "^\\$<TARGET_FILE:([A-Za-z0-9_]+)>$" "\\1" dep "${u}")
    foreach(tests_target lesson${num}_tests lesson${num}_solution_tests)
      if(TARGET ${tests_target} AND NOT dep STREQUAL tests_target)
        add_dependencies(${tests_target} ${dep})
      endif()
    endforeach()
  endforeach()
  foreach(flavour IN LISTS flavours)
    set(target lesson${num})
    if(flavour STREQUAL "solution")
      set(target lesson${num}_solution)
    endif()
    string(REPLACE "@PROGRAM@" "$<TARGET_FILE:${target}>" cmd "${E_COMMAND}")
    set(t lesson${num}.${flavour}.e2e.${E_NAME})
    add_test(NAME ${t} COMMAND ${cmd})
    set_tests_properties(${t} PROPERTIES TIMEOUT ${E_TIMEOUT}
      LABELS "lesson${num};${flavour};lesson${num}-${flavour};e2e")
    if(E_SKIP_RETURN_CODE)
      set_tests_properties(${t} PROPERTIES SKIP_RETURN_CODE ${E_SKIP_RETURN_CODE})
    endif()
    if(E_RESOURCE_LOCK)
      set_tests_properties(${t} PROPERTIES RESOURCE_LOCK ${E_RESOURCE_LOCK})
    endif()
  endforeach()
endfunction()

# The runner of dtc_add_e2e's usual check (tests/support/e2e_run.py): this build's torchrun,
# a rendezvous of its own per run (2.x: port 0, the store binds a free port itself, as
# --standalone does; 1.13: a free port picked just before), the exit code and the numbers of the
# program's JSON line.
string(JOIN " " _dtc_e2e_flags ${DTC_TORCHRUN_FLAGS})
set(_dtc_e2e_port0 "")
if(DTC_FLAVOR STREQUAL "primary")
  set(_dtc_e2e_port0 --rdzv-port0)
endif()
set(DTC_E2E_RUN Python3::Interpreter "${PROJECT_SOURCE_DIR}/tests/support/e2e_run.py"
    --torchrun "${DTC_TORCHRUN}" "--torchrun-flags=${_dtc_e2e_flags}" ${_dtc_e2e_port0})

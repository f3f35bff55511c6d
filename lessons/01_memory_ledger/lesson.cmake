# Lesson 01: the training memory ledger. No LibTorch: it links dtc::core only.
dtc_add_lesson(01 DIR 01_memory_ledger SOURCES ledger.cpp strategy.cpp
               GIVEN ledger_given.cpp strategy_given.cpp DRIVER program.cpp
               TESTS tests/lesson01/ledger_test.cpp tests/lesson01/program_test.cpp
                     tests/lesson01/strategy_test.cpp
               LIBS dtc::core)

# Every run the README quotes ("$ build/bin/lesson01 ..." in a fenced block) reproduces: each
# quoted line appears in the program's output (tests/support/readme_excerpts.py).
if(TARGET lesson01_solution)
  dtc_add_e2e(01 NAME readme_excerpts TIMEOUT 120 COMMAND Python3::Interpreter
    "${PROJECT_SOURCE_DIR}/tests/support/readme_excerpts.py"
    "${PROJECT_SOURCE_DIR}/lessons/01_memory_ledger/README.md" --program @PROGRAM@
    --as build/bin/lesson01)
endif()

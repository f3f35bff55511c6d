# Lesson 01: the training memory ledger. No LibTorch: it links dtc::core only.
dtc_add_lesson(01 DIR 01_memory_ledger SOURCES ledger.cpp strategy.cpp DRIVER program.cpp
               TESTS tests/lesson01/ledger_test.cpp tests/lesson01/program_test.cpp
                     tests/lesson01/strategy_test.cpp
               LIBS dtc::core)

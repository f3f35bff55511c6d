# Lesson 02: the single-device baseline. Trains the course's GPT (common/: dtc::dist) on one
# device; the program runs as one process.
dtc_add_lesson(02 DIR 02_baseline SOURCES baseline.cpp DRIVER program.cpp
               TESTS tests/lesson02/model_test.cpp tests/lesson02/baseline_test.cpp
                     tests/lesson02/program_test.cpp
               LIBS dtc::dist TORCH)

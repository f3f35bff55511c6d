# Lesson 13: mixture of experts and expert parallelism. The MoE layer in the course's GPT (its
# router, experts and single-device computation given, moe_given.cpp), the all-to-all dispatch
# and combine, the losses, the gradient reduction and the bias step yours (moe.cpp).
dtc_add_lesson(13 DIR 13_moe SOURCES moe.cpp GIVEN moe_given.cpp DRIVER program.cpp
               TESTS tests/lesson13/moe_test.cpp
               LIBS dtc::dist TORCH)

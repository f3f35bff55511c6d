// lesson08: tensor parallelism. Trains the course's GPT with every layer split over --tp ranks.
//
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson08
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson08 --dp 2 --tp 2 --json
//   build/bin/lesson08 --help
#include <iostream>

#include "program.h"

int main(int argc, char** argv) { return dtc::l08::run_program(argc, argv, std::cout, std::cerr); }

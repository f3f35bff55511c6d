// lesson10: context parallelism. Trains the course's GPT with each sequence split over --cp
// ranks, attention through ring, Ulysses or all-gather KV.
//
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson10
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson10 --cp 4 --zigzag --json
//   build/bin/lesson10 --help
#include <iostream>

#include "program.h"

int main(int argc, char** argv) { return dtc::l10::run_program(argc, argv, std::cout, std::cerr); }

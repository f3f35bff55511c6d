// lesson09: pipeline parallelism, one stage per rank, started by torchrun (the venv's:
// ~/.cache/dtc-course/venv/bin/torchrun; on the light path add --redirects 2 --tee 2).
//
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson09 --micro-batches 4
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson09 --schedule gpipe
//   make run-lesson09 NPROC=4 ARGS="--json"
#include <iostream>

#include "program.h"

int main(int argc, char** argv) { return dtc::l09::run_program(argc, argv, std::cout, std::cerr); }

// lesson01: the training memory ledger of a model, per device.
//
//   build/bin/lesson01                         # 7B vs 70B vs 405B: won't fit, won't finish
//   build/bin/lesson01 --model llama-7b        # the worked 7B example
//   build/bin/lesson01 --params 7e9            # 16 bytes per parameter: 112 GB
//   build/bin/lesson01 --model llama3-70b --zero 3 --dp 64 --tp 8 --json
//   build/bin/lesson01 --help
#include <iostream>

#include "program.h"

int main(int argc, char** argv) { return dtc::l01::run_program(argc, argv, std::cout, std::cerr); }

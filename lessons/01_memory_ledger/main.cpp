// lesson01: the training memory ledger of a model, per device.
//
//   build/bin/lesson01                         # 7B vs 70B vs 405B: won't fit, won't finish
//   build/bin/lesson01 --model llama-7b        # the worked 7B example
//   build/bin/lesson01 --params 7e9            # 16 bytes per parameter: 112 GB
//   build/bin/lesson01 --model llama3-70b --zero 3 --dp 64 --tp 8 --json
//   build/bin/lesson01 --help
namespace dtc::l01 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l01

int main(int argc, char** argv) { return dtc::l01::run_main(argc, argv); }

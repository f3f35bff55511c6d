// lesson02: the single-device baseline. Trains the course's GPT and measures its memory.
//
//   build/bin/lesson02                              # 500 steps, the memory table at the end
//   build/bin/lesson02 --steps 20 --json            # one JSON line: losses, tokens_per_s, memory
//   build/bin/lesson02 --steps 250 --save ck.pt     # then: --steps 500 --resume ck.pt
//   build/bin/lesson02 --help
namespace dtc::l02 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l02

int main(int argc, char** argv) { return dtc::l02::run_main(argc, argv); }

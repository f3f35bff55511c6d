// lesson08: tensor parallelism. Trains the course's GPT with every layer split over --tp ranks.
//
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson08
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson08 --dp 2 --tp 2 --json
//   build/bin/lesson08 --help
namespace dtc::l08 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l08

int main(int argc, char** argv) { return dtc::l08::run_main(argc, argv); }

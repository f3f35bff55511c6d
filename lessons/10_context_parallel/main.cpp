// lesson10: context parallelism. Trains the course's GPT with each sequence split over --cp
// ranks, attention through ring, Ulysses or all-gather KV.
//
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson10
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson10 --cp 4 --zigzag --json
//   build/bin/lesson10 --help
namespace dtc::l10 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l10

int main(int argc, char** argv) { return dtc::l10::run_main(argc, argv); }

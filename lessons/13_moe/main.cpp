// lesson13: mixture of experts. Trains the course's GPT with an MoE layer in every block, its
// experts split over the ranks of an ep group (expert parallelism), and compares with the
// single-device MoE.
//
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson13 --experts 4 --ep 2
//   build/bin/lesson13 --help
namespace dtc::l13 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers.
int run_main(int argc, char** argv);
}  // namespace dtc::l13

int main(int argc, char** argv) { return dtc::l13::run_main(argc, argv); }

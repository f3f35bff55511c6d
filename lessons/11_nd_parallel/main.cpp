// lesson11: N-D parallelism. Trains the course's GPT on a mesh of dp replicas x tp ranks x pp
// stages, the mix written as the planner writes it (lesson 01's --compare and plan.mix).
//
//   torchrun --standalone --nproc_per_node=8 --no_python build/bin/lesson11 --mix 2x2x2x1
//   torchrun --standalone --nproc_per_node=8 --no_python build/bin/lesson11 \
//       --mix 2x1x4x1:0:none:1:2 --layers 8
//   build/bin/lesson11 --help
namespace dtc::l11 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l11

int main(int argc, char** argv) { return dtc::l11::run_main(argc, argv); }

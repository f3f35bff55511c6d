// lesson03: process groups and collectives, on 2 or more ranks started by torchrun (the venv's:
// ~/.cache/dtc-course/venv/bin/torchrun; on the light path add --redirects 2 --tee 2).
//
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson03 --tp 2
//                                            # the tour, a dp 2 x tp 2 grid, the ring allreduce
//   make run-lesson03 NPROC=4 ARGS="--tp 2 --json"
//   build/bin/lesson03                       # no launcher: says which command to run
namespace dtc::l03 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l03

int main(int argc, char** argv) { return dtc::l03::run_main(argc, argv); }

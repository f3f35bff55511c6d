// lesson09: pipeline parallelism, one stage per rank, started by torchrun (the venv's:
// ~/.cache/dtc-course/venv/bin/torchrun; on the light path add --redirects 2 --tee 2).
//
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson09 --micro-batches 4
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson09 --schedule gpipe
//   make run-lesson09 NPROC=4 ARGS="--json"
namespace dtc::l09 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l09

int main(int argc, char** argv) { return dtc::l09::run_main(argc, argv); }

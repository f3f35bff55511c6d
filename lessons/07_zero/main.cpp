// lesson07: ZeRO stages 0 (DDP) to 3 on the course's GPT, with each rank's memory measured next
// to the ledger and the bytes sent per step next to the ZeRO paper's count. Several ranks run
// under torchrun (the venv's: ~/.cache/dtc-course/venv/bin/torchrun; on the light path add
// --redirects 2 --tee 2):
//
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson07 --stage 3
//   make run-lesson07 ARGS="--stage 2 --steps 50"
//   build/bin/lesson07 --help
namespace dtc::l07 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l07

int main(int argc, char** argv) { return dtc::l07::run_main(argc, argv); }

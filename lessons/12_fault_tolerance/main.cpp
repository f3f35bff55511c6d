// lesson12: failures at scale. Trains lesson 11's N-D model with distributed checkpoints, and
// survives a rank killed mid-run: torchrun restarts the job, which resumes from the newest
// complete checkpoint and ends with the parameters of a run that never failed.
//
//   torchrun --standalone --nproc_per_node=4 --max-restarts=1 --no_python build/bin/lesson12 \
//       --mix 2x1x2x1 --checkpoint-dir /tmp/ckpt --checkpoint-every 2 --fail-at-step 5
//   build/bin/lesson12 --help
namespace dtc::l12 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers.
int run_main(int argc, char** argv);
}  // namespace dtc::l12

int main(int argc, char** argv) { return dtc::l12::run_main(argc, argv); }

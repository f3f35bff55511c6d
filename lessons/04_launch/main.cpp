// lesson04: who am I in the job? Reads the launch environment, joins the job, and checks it
// with one allreduce whose sum is known in closed form.
//
//   ~/.cache/dtc-course/venv/bin/torchrun --standalone --nproc_per_node=2 --no_python \
//       build/bin/lesson04 --show-env
//   mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 \
//       -x MASTER_PORT=29511 build/bin/lesson04
//   sudo scripts/two-nodes.sh build/bin/lesson04            # 2 nodes x 2 ranks, c10d rendezvous
//   build/bin/lesson04                                      # no launcher: says what to run
namespace dtc::l04 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l04

int main(int argc, char** argv) { return dtc::l04::run_main(argc, argv); }

// lesson05: when communication breaks. A doctor for launch environments, a fault lab that breaks
// runs on purpose and diagnoses them (your barrier and fingerprints, debug_aids.cpp), and a
// reader for NCCL_DEBUG=INFO logs.
//
//   build/bin/lesson05 doctor
//   ~/.cache/dtc-course/venv/bin/torchrun --standalone --nproc_per_node=2 --no_python \
//       build/bin/lesson05 fault --case shape-mismatch
//   build/bin/lesson05 nccl-log tests/lesson05/data/nccl_1node_2gpu_p2p.log
namespace dtc::l05 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l05

int main(int argc, char** argv) { return dtc::l05::run_main(argc, argv); }

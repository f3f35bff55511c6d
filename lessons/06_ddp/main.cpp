// lesson06: data-parallel training (DDP) of the course's GPT, with the DDP you built in ddp.cpp.
//
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson06 --steps 20 --seed 1
//       --json                                   # same losses as lesson02 (the venv's torchrun)
//   ... build/bin/lesson06 --sync naive|flat|bucketed --bucket-kb 256 --accum 2
//   ... build/bin/lesson06 --data epochs                  # DistributedSampler + set_epoch
//   ... build/bin/lesson06 --pitfall uneven-steps --timeout-s 5
//   build/bin/lesson06 --help
namespace dtc::l06 {
// program.h: run_program on std::cout and std::cerr. Declared here so that this file compiles
// without LibTorch's headers (a second or two fewer for every build of the lesson).
int run_main(int argc, char** argv);
}  // namespace dtc::l06

int main(int argc, char** argv) { return dtc::l06::run_main(argc, argv); }

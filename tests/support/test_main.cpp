// The main() of every test program: Google Test's, after one intra-op thread.
//
// Several tests compare two runs of the same computation bit for bit (a resumed checkpoint,
// replicas after the same steps). CPU math is reproducible from run to run only with a fixed
// thread count and no dynamic threading: oneMKL's "Reproducibility Conditions" ask for both,
// and MKL_DYNAMIC is on by default, so oneMKL may pick fewer threads for one call than for the
// next and sum in another order. at::set_num_threads fixes OpenMP's count, oneMKL's count and
// turns MKL_DYNAMIC off. One thread per test process: ctest runs the tests side by side instead.
// The thread-ranks' math measured more than that without OMP_NUM_THREADS=1 (idle workers
// spinning: 11 s of system CPU in the light path's lesson 09 suite, 0.5 s with it), which
// ctest's runner (gtest_once.py) and scripts/run-unit-tests.sh therefore set.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

// Lesson 07 tests of the program, run in-process as a single rank: its flags and its errors.
// Multi-rank runs of the real program through torchrun are in tests/lesson07/e2e.py.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtc/compat.h"
#include "program.h"
#include "program_run.h"

namespace dtc::l07 {
namespace {

using ::dtc::test::BadInput;

TEST(L07ProgramGiven, BadInputExitsTwoNamingTheFlag) {
  ::dtc::test::clear_launch_env();
  const std::vector<BadInput> cases = {
      {{"--stage", "4"}, "--stage"},
      {{"--stage", "2", "--recompute"}, "--recompute"},
      {{"--stage", "all", "--no-reshard-after-forward"}, "--no-reshard-after-forward"},
      {{"--clip-grad-norm", "-1"}, "--clip-grad-norm"},
      {{"--stage", "all", "--save-sharded", "/tmp/l07-never"}, "--stage"},
      {{"--stage", "all", "--consolidate", "/tmp/l07-never.pt"}, "--stage"},
      {{"--stage", "3", "--load-sharded", "/nonexistent/dir"}, "--load-sharded"},
      {{"--global-batch", "0"}, "--global-batch"},
      {{"--steps", "0"}, "--steps"},
      {{"--heads", "3"}, "--heads"},
      {{"--lr", "-1"}, "--lr"},
      {{"--timeout-s", "0"}, "--timeout-s"},
      {{"--backend", "mpi"}, "--backend"},
      {{"--precision", "fp16"}, "--precision"},
      {{"--reduce-dtype", "fp32"}, "--reduce-dtype"}};
  ::dtc::test::expect_usage_errors("lesson07", cases, run_program);
  // On 1.13 bf16 itself is refused before training, checkpoint or not.
  if (!kGlooBf16) {
    const std::vector<BadInput> bf16 = {
        {{"--precision", "bf16", "--stage", "1", "--save-sharded", "/tmp/l07-never"},
         "--precision"}};
    ::dtc::test::expect_usage_errors("lesson07", bf16, run_program);
  }
}

}  // namespace
}  // namespace dtc::l07

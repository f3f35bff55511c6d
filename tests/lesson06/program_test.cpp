// Lesson 06 tests of the program, run in-process as a single rank (no launcher variables):
// its flags, its errors and its JSON line. Multi-rank runs of the real program through torchrun
// and mpirun are in tests/lesson06/e2e.py (ctest -L lesson06 -R e2e).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "dtc/compat.h"
#include "dtc/errors.h"
#include "dtc/program.h"
#include "program.h"
#include "program_run.h"

namespace dtc::l06 {
namespace {

using ::dtc::test::last_json_line;
using ::dtc::test::ProgramRun;

ProgramRun run(std::vector<std::string> args) {
  ::dtc::test::clear_launch_env();  // one rank, whatever launched the test binary
  return ::dtc::test::run_in_process("lesson06", std::move(args), run_program);
}

std::vector<std::string> tiny(std::vector<std::string> more) {
  std::vector<std::string> args = {"--layers", "1",  "--hidden",       "32", "--heads", "2",
                                   "--seq",    "16", "--global-batch", "4"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(L06ProgramGiven, BadInputExitsTwoNamingTheFlag) {
  ::dtc::test::clear_launch_env();
  const std::vector<::dtc::test::BadInput> cases = {
      {{"--sync", "fast"}, "--sync"},
      {{"--heads", "3"}, "--heads"},
      {{"--bucket-kb", "0"}, "--bucket-kb"},
      {{"--accum", "0"}, "--accum"},
      {{"--accum", "3"}, "--global-batch"},  // 8 rows do not split into 3 micro-steps
      {{"--global-batch", "0"}, "--global-batch"},
      {{"--data", "random"}, "--data"},
      {{"--pitfall", "oops"}, "--pitfall"},
      {{"--timeout-s", "0"}, "--timeout-s"},
      {{"--epoch-windows", "-1"}, "--epoch-windows"},
      {{"--resume", "/nonexistent/ck.pt"}, "--resume"},
      {{"--backend", "mpi"}, "--backend"}};
  ::dtc::test::expect_usage_errors("lesson06", cases, run_program);
}

TEST(L06ProgramGiven, HelpExitsZero) {
  const ProgramRun r = run({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.err.find("--sync"), std::string::npos);
}

TEST(L06ProgramGiven, BatchSplitErrorNamesTheSizes) {
  try {
    check_batch_split(8, 3, 1);
    FAIL() << "8 rows on 3 ranks must throw";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.subject(), "--global-batch");
    EXPECT_NE(std::string(e.what()).find("multiple of 3"), std::string::npos) << e.what();
  }
}

TEST(L06Program, ReduceDtypeHalvesTheBytesOnTheWire) {
  // One rank: the Reducer still allreduces its buckets (a group of one), through the recorder
  // the program wraps around the communicator. fp32: 4 bytes per parameter and the 4-byte
  // loss; a compression hook: 2 bytes per parameter.
  int64_t params = 0;
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    SCOPED_TRACE(dtype);
    const ProgramRun r = run(tiny({"--steps", "2", "--json", "--reduce-dtype", dtype}));
    if (std::string(dtype) == "bf16" && !kGlooBf16) {  // 1.13's gloo: no bf16, said up front
      EXPECT_EQ(r.code, 2);
      EXPECT_NE(r.err.find("no bf16 allreduce"), std::string::npos) << r.err;
      continue;
    }
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = last_json_line(r.out);
    params = j.at("params").get<int64_t>();
    EXPECT_EQ(j.at("reduce_dtype"), dtype);
    EXPECT_EQ(j.at("allreduce_bytes_per_step").get<int64_t>(),
              (std::string(dtype) == "fp32" ? 4 : 2) * params + 4);
  }
  // With accumulation (one reduction per step, the micro-steps before it under no_sync), a
  // bucket rebuild after the first step and Join: the hook's 2 bytes per parameter, the loss and
  // Join's 4-byte announcement, every step.
  const ProgramRun all = run(tiny({"--steps", "2", "--json", "--reduce-dtype", "fp16", "--accum",
                                   "2", "--rebuild-buckets", "--join"}));
  ASSERT_EQ(all.code, 0) << all.err;
  const auto j = last_json_line(all.out);
  EXPECT_TRUE(j.at("buckets_rebuilt").get<bool>());
  EXPECT_EQ(j.at("allreduce_bytes_per_step").get<int64_t>(), 2 * params + 4 + 4);
  const ProgramRun bad = run(tiny({"--steps", "2", "--sync", "naive", "--reduce-dtype", "bf16"}));
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("--reduce-dtype"), std::string::npos) << bad.err;
}

TEST(L06Program, JsonLineHasLossesStepTimeAndInSyncReplicas) {
  for (const char* sync : {"naive", "flat", "bucketed"}) {
    SCOPED_TRACE(sync);
    const ProgramRun r = run(tiny({"--steps", "3", "--json", "--sync", sync}));
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = last_json_line(r.out);
    EXPECT_EQ(j.at("losses").size(), 3u);
    EXPECT_GT(j.at("tokens_per_s").get<double>(), 0);
    EXPECT_GT(j.at("step_time_s").get<double>(), 0);
    EXPECT_EQ(j.at("world_size"), 1);
    EXPECT_EQ(j.at("replica_divergence").get<double>(), 0.0);
  }
}

TEST(L06Program, EpochsReshuffleOnlyWithSetEpoch) {
  // --data epochs over 8 windows, 4 per step: 2 steps per epoch, 4 steps = 2 epochs.
  const std::vector<std::string> args =
      tiny({"--steps", "4", "--json", "--data", "epochs", "--epoch-windows", "8"});
  const ProgramRun with = run(args);
  ASSERT_EQ(with.code, 0) << with.err;
  EXPECT_EQ(last_json_line(with.out).at("same_order_in_epochs_0_and_1"), false)
      << "set_epoch(1) must give epoch 1 another order";
  std::vector<std::string> pitfall = args;
  pitfall.insert(pitfall.end(), {"--pitfall", "no-set-epoch"});
  const ProgramRun without = run(pitfall);
  ASSERT_EQ(without.code, 0) << without.err;
  EXPECT_EQ(last_json_line(without.out).at("same_order_in_epochs_0_and_1"), true)
      << "without set_epoch every epoch repeats the same order";
}

}  // namespace
}  // namespace dtc::l06

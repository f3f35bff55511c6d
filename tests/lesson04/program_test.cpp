// Lesson 04 tests: the lesson04 program, run in-process with a made-up environment (one rank:
// no network). The multi-rank runs under real launchers are in e2e.py (ctest -R e2e).
//   build/tests/lesson04_tests --gtest_filter='L04Program.*'
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "env_vars.h"
#include "program.h"
#include "program_run.h"

namespace dtc::l04 {
namespace {

using Result = ::dtc::test::ProgramRun;

Result run_lesson04(std::vector<std::string> args, const EnvMap& env) {
  return ::dtc::test::run_in_process(
      "build/bin/lesson04", std::move(args),
      [&](int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
        return run_program(argc, argv, out, err, lookup_in(env));
      });
}

using ::dtc::test::last_json_line;

TEST(L04Program, NoLauncherSaysWhatToRun) {
  const Result r = run_lesson04({"--json"}, {});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("needs at least 2 ranks, but it was started as 1 (launcher: none)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("--standalone --nproc_per_node=2 --no_python build/bin/lesson04 --json"),
            std::string::npos)
      << r.err;
}

TEST(L04Program, OneRankUnderTorchrunRuns) {
  // What `torchrun --nproc_per_node=1` sets (1.13 style: rank 0 hosts the store; a single rank
  // needs none anyway).
  const EnvMap env = {{"RANK", "0"},
                      {"WORLD_SIZE", "1"},
                      {"LOCAL_RANK", "0"},
                      {"LOCAL_WORLD_SIZE", "1"},
                      {"MASTER_ADDR", "localhost"},
                      {"MASTER_PORT", "29500"},
                      {"TORCHELASTIC_RUN_ID", "test"},
                      {"TORCHELASTIC_USE_AGENT_STORE", "False"}};
  const Result r = run_lesson04({"--min-ranks", "1", "--json"}, env);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json_line(r.out);
  EXPECT_EQ(j.at("launcher"), "torchrun");
  EXPECT_EQ(j.at("world_size"), 1);
  EXPECT_EQ(j.at("allreduce_sum"), 1) << "closed form: N(N+1)/2 for N = 1";
  EXPECT_EQ(j.at("run_id"), "test");
  ASSERT_EQ(j.at("ranks").size(), 1u);
  EXPECT_EQ(j.at("ranks")[0].at("rank"), 0);
}

TEST(L04Program, ShowEnvListsTheVariables) {
  const EnvMap env = {{"RANK", "0"},
                      {"WORLD_SIZE", "1"},
                      {"LOCAL_RANK", "0"},
                      {"LOCAL_WORLD_SIZE", "1"},
                      {"MASTER_ADDR", "localhost"},
                      {"MASTER_PORT", "29500"},
                      {"OMP_NUM_THREADS", "1"}};
  const Result r = run_lesson04({"--min-ranks", "1", "--show-env"}, env);
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* name : {"RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS"}) {
    EXPECT_NE(r.out.find(name), std::string::npos) << name << " missing from:\n" << r.out;
  }
  EXPECT_NE(r.out.find("allreduce(SUM) of rank+1 over 1 ranks: 1"), std::string::npos) << r.out;
}

TEST(L04Program, BadEnvironmentIsAUsageError) {
  const Result r = run_lesson04({"--min-ranks", "1"}, {{"WORLD_SIZE", "2"}});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("WORLD_SIZE: is set but RANK is not"), std::string::npos) << r.err;
  const Result bad = run_lesson04({}, {{"RANK", "2"},
                                       {"WORLD_SIZE", "2"},
                                       {"LOCAL_RANK", "0"},
                                       {"LOCAL_WORLD_SIZE", "2"},
                                       {"MASTER_ADDR", "localhost"},
                                       {"MASTER_PORT", "29500"}});
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_NE(bad.err.find("RANK: 2 is outside 0..1 (WORLD_SIZE is 2)"), std::string::npos)
      << bad.err;
}

}  // namespace
}  // namespace dtc::l04

// Lesson 03 tests: the lesson03 program. run_demo() on thread-ranks (what every process does
// under torchrun), and run_program()'s checks of the launch environment and flags.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "collectives.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "program.h"
#include "program_run.h"

namespace dtc::l03 {
namespace {

using ::dtc::test::last_json_line;

// Runs the demo on `world` thread-ranks; returns rank 0's JSON.
nlohmann::json demo_json(int world, int tp, int64_t numel) {
  nlohmann::json result;
  run_ranks(
      world,
      [&](RankContext& ctx) {
        DemoOptions o;
        o.tp = tp;
        o.numel = numel;
        o.json = true;
        o.timeout = std::chrono::milliseconds(3000);
        LaunchEnv env;
        env.rank = ctx.rank;
        env.local_rank = ctx.rank;
        env.world_size = world;
        env.local_world_size = world;
        std::ostringstream out;
        const int code = run_demo(o, env, ctx.store, *ctx.comm, out);
        EXPECT_EQ(code, 0) << "rank " << ctx.rank << ": a result was wrong\n" << out.str();
        if (ctx.rank == 0) result = last_json_line(out.str());
      },
      std::chrono::milliseconds(3000));
  return result;
}

TEST(L03Program, DemoOnThreeRanks) {
  const auto j = demo_json(3, 1, 1001);
  EXPECT_EQ(j.at("world").get<int>(), 3);
  EXPECT_TRUE(j.at("ok").get<bool>()) << j.dump(2);
  for (const char* name :
       {"broadcast", "allreduce", "allgather", "reduce", "alltoall", "send/recv", "barrier"}) {
    EXPECT_TRUE(j.at("tour").at(name).get<bool>()) << name;
  }
  EXPECT_EQ(j.at("processes").size(), 3u);
  // numpy.array_split(numpy.arange(1001), 3): 334, 334, 333
  EXPECT_EQ(j.at("ring").at("chunks"), (nlohmann::json{334, 334, 333}));
  EXPECT_TRUE(j.at("ring").at("ok").get<bool>());
  EXPECT_EQ(j.at("grid").at("dp").get<int>(), 3);
}

TEST(L03Program, DemoOnFourRanksWithTp2) {
  const auto j = demo_json(4, 2, 10);
  EXPECT_TRUE(j.at("ok").get<bool>()) << j.dump(2);
  // dp 2 x tp 2, Megatron order: tp groups [0,1] [2,3]; dp groups [0,2] [1,3]
  EXPECT_EQ(j.at("grid").at("groups").at("tp"), (nlohmann::json{{0, 1}, {2, 3}}));
  EXPECT_EQ(j.at("grid").at("groups").at("dp"), (nlohmann::json{{0, 2}, {1, 3}}));
  EXPECT_EQ(j.at("ring").at("chunks"), (nlohmann::json{3, 3, 2, 2}));
}

using Result = ::dtc::test::ProgramRun;

Result run_lesson03(std::vector<std::string> args, std::map<std::string, std::string> vars) {
  const EnvLookup env = [&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
  return ::dtc::test::run_in_process(
      "lesson03", std::move(args),
      [&](int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
        return run_program(argc, argv, out, err, env);
      });
}

const std::map<std::string, std::string> kFourRanks = {
    {"RANK", "0"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};

// The launch checks happen before any TODO: they pass on the untouched exercise.
TEST(L03ProgramGiven, WithoutALauncherItShowsTheCommand) {
  const Result r = run_lesson03({}, {});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("torchrun --nproc_per_node=2 --no_python lesson03"), std::string::npos)
      << r.err;
}

TEST(L03ProgramGiven, AGridThatDoesNotFitIsAUsageError) {
  const Result r = run_lesson03({"--tp", "3"}, kFourRanks);  // 3 does not divide 4
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--tp"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("HINT"), std::string::npos) << r.err;
}

TEST(L03ProgramGiven, NcclIsExplained) {
  const Result r = run_lesson03({"--backend", "nccl"}, kFourRanks);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--backend"), std::string::npos) << r.err;
}

TEST(L03ProgramGiven, BadFlagsAreUsageErrors) {
  EXPECT_EQ(run_lesson03({"--tp", "0"}, kFourRanks).code, 2);
  EXPECT_EQ(run_lesson03({"--numel", "-5"}, kFourRanks).code, 2);
  EXPECT_EQ(run_lesson03({"--help"}, {}).code, 0);
}

}  // namespace
}  // namespace dtc::l03

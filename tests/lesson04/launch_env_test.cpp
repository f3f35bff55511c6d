// Lesson 04 tests: parsing and validating the launch environment, in-process, on made-up
// environments (EnvMap). The expected values are the closed-form rules of launch_env.h.
//   build/tests/lesson04_tests --gtest_filter='L04*'
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "dtc/errors.h"
#include "env_vars.h"
#include "launch_env.h"
#include "usage_error.h"

namespace dtc::l04 {
namespace {

// What torchrun 2.15 set for rank 3 of `--nnodes=2 --nproc_per_node=2` (the second rank of the
// second node), on the third attempt of a job allowed 3 restarts.
EnvMap torchrun_rank3() {
  return {{"RANK", "3"},
          {"LOCAL_RANK", "1"},
          {"WORLD_SIZE", "4"},
          {"LOCAL_WORLD_SIZE", "2"},
          {"GROUP_RANK", "1"},
          {"GROUP_WORLD_SIZE", "2"},
          {"ROLE_NAME", "default"},
          {"ROLE_RANK", "3"},
          {"ROLE_WORLD_SIZE", "4"},
          {"MASTER_ADDR", "node0"},
          {"MASTER_PORT", "29400"},
          {"TORCHELASTIC_RESTART_COUNT", "2"},
          {"TORCHELASTIC_MAX_RESTARTS", "3"},
          {"TORCHELASTIC_RUN_ID", "job7"},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},
          {"OMP_NUM_THREADS", "1"}};
}

// What OpenMPI 4.1's `mpirun -np 2 -x MASTER_ADDR=127.0.0.1` set for rank 1 (observed).
EnvMap mpi_rank1() {
  return {{"OMPI_COMM_WORLD_RANK", "1"},       {"OMPI_COMM_WORLD_SIZE", "2"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
          {"OMPI_COMM_WORLD_NODE_RANK", "1"},  {"MASTER_ADDR", "127.0.0.1"}};
}

EnvMap with(EnvMap vars, const std::string& name, const std::string& value) {
  vars[name] = value;
  return vars;
}

EnvMap without(EnvMap vars, const std::string& name) {
  vars.erase(name);
  return vars;
}

// A valid single-node torchrun rank to mutate: rank 1 of 2.
LaunchInfo valid_info(Launcher launcher = Launcher::kTorchrun) {
  LaunchInfo info;
  info.launcher = launcher;
  info.rank = 1;
  info.world_size = 2;
  info.local_rank = 1;
  info.local_world_size = 2;
  info.group_rank = 0;
  info.group_world_size = 1;
  info.role_rank = 1;
  info.role_world_size = 2;
  info.master_addr = "localhost";
  info.master_port = 29500;
  return info;
}

// ---------------------------------------------------------------------------------------------
// detect_launcher
// ---------------------------------------------------------------------------------------------

TEST(L04Detect, WhichLauncher) {
  EXPECT_EQ(detect_launcher(lookup_in({})), Launcher::kNone);
  EXPECT_EQ(detect_launcher(lookup_in({{"HOME", "/root"}, {"MASTER_PORT", "29500"}})),
            Launcher::kNone);
  EXPECT_EQ(detect_launcher(lookup_in(torchrun_rank3())), Launcher::kTorchrun);
  EXPECT_EQ(detect_launcher(lookup_in(mpi_rank1())), Launcher::kMpi);
  // `mpirun -np 2 torchrun ...`: each torchrun worker sees both sets; torchrun's wins.
  EnvMap both = mpi_rank1();
  for (const auto& [k, v] : torchrun_rank3()) both[k] = v;
  EXPECT_EQ(detect_launcher(lookup_in(both)), Launcher::kTorchrun);
}

TEST(L04Detect, StrayVariablesAreErrors) {
  for (const char* stray : {"WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}) {
    SCOPED_TRACE(stray);
    expect_usage(
        [&] {
          detect_launcher(lookup_in({{stray, "2"}}));
        },
        stray, "is set but RANK is not");
  }
}

// ---------------------------------------------------------------------------------------------
// parse_torchrun
// ---------------------------------------------------------------------------------------------

TEST(L04ParseTorchrun, EveryVariable) {
  const LaunchInfo i = parse_torchrun(lookup_in(torchrun_rank3()));
  EXPECT_EQ(i.launcher, Launcher::kTorchrun);
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 2);
  EXPECT_EQ(i.group_rank, 1);
  EXPECT_EQ(i.group_world_size, 2);
  EXPECT_EQ(i.role_rank, 3);
  EXPECT_EQ(i.role_world_size, 4);
  EXPECT_EQ(i.master_addr, "node0");
  EXPECT_EQ(i.master_port, 29400);
  EXPECT_EQ(i.restart_count, 2);
  EXPECT_EQ(i.max_restarts, 3);
  EXPECT_EQ(i.run_id, "job7");
  EXPECT_TRUE(i.use_agent_store);
  EXPECT_FALSE(i.hosts_store()) << "the agent hosts the store: every rank is a client";
  EXPECT_EQ(i.store_prefix(), "attempt2/") << "keys of attempt 2 never meet attempt 1's";
}

TEST(L04ParseTorchrun, DefaultsOfOptionalVariables) {
  // A hand-made launch: only the six required variables, rank 5 of 8 with 4 per node.
  const LaunchInfo i = parse_torchrun(lookup_in({{"RANK", "5"},
                                                 {"WORLD_SIZE", "8"},
                                                 {"LOCAL_RANK", "1"},
                                                 {"LOCAL_WORLD_SIZE", "4"},
                                                 {"MASTER_ADDR", "10.0.0.1"},
                                                 {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(i.group_rank, 1) << "5 / 4";
  EXPECT_EQ(i.group_world_size, 2) << "8 / 4";
  EXPECT_EQ(i.role_rank, 5);
  EXPECT_EQ(i.role_world_size, 8);
  EXPECT_EQ(i.restart_count, 0);
  EXPECT_EQ(i.max_restarts, 0);
  EXPECT_EQ(i.run_id, "");
  EXPECT_FALSE(i.use_agent_store);
  EXPECT_TRUE(parse_torchrun(lookup_in(with(torchrun_rank3(), "RANK", "0")))
                  .use_agent_store);  // agent store: even rank 0 is a client
  EXPECT_FALSE(
      parse_torchrun(lookup_in(with(torchrun_rank3(), "TORCHELASTIC_USE_AGENT_STORE", "False")))
          .use_agent_store);
}

TEST(L04ParseTorchrun, MissingRequiredVariable) {
  for (const char* name :
       {"WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    SCOPED_TRACE(name);
    expect_usage([&] { parse_torchrun(lookup_in(without(torchrun_rank3(), name))); }, name,
                 "is not set");
  }
}

TEST(L04ParseTorchrun, BadValues) {
  expect_usage([] { parse_torchrun(lookup_in(with(torchrun_rank3(), "WORLD_SIZE", "four"))); },
               "WORLD_SIZE", "'four' is not an integer");
  expect_usage([] { parse_torchrun(lookup_in(with(torchrun_rank3(), "MASTER_PORT", "29o0"))); },
               "MASTER_PORT", "not an integer");
  expect_usage(
      [] {
        parse_torchrun(lookup_in(with(torchrun_rank3(), "TORCHELASTIC_RESTART_COUNT", "second")));
      },
      "TORCHELASTIC_RESTART_COUNT", "not an integer");
  expect_usage(
      [] {
        parse_torchrun(lookup_in(with(torchrun_rank3(), "TORCHELASTIC_USE_AGENT_STORE", "maybe")));
      },
      "TORCHELASTIC_USE_AGENT_STORE", "not a boolean");
}

// ---------------------------------------------------------------------------------------------
// parse_mpi
// ---------------------------------------------------------------------------------------------

TEST(L04ParseMpi, ObservedEnvironment) {
  const LaunchInfo i = parse_mpi(lookup_in(mpi_rank1()));
  EXPECT_EQ(i.launcher, Launcher::kMpi);
  EXPECT_EQ(i.rank, 1);
  EXPECT_EQ(i.world_size, 2);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 2);
  EXPECT_EQ(i.group_rank, 0) << "one node: OMPI_COMM_WORLD_NODE_RANK=1 is not a node index";
  EXPECT_EQ(i.group_world_size, 1);
  EXPECT_EQ(i.role_rank, 1);
  EXPECT_EQ(i.role_world_size, 2);
  EXPECT_EQ(i.master_addr, "127.0.0.1");
  EXPECT_EQ(i.master_port, 29500) << "MASTER_PORT unset: the default";
  EXPECT_EQ(i.restart_count, 0);
}

TEST(L04ParseMpi, NodesAndStore) {
  // Rank 4 of 5 with 2 per node: node 2 of 3 (the last node holds one rank).
  const LaunchInfo i = parse_mpi(lookup_in({{"OMPI_COMM_WORLD_RANK", "4"},
                                            {"OMPI_COMM_WORLD_SIZE", "5"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                            {"MASTER_ADDR", "node0"},
                                            {"MASTER_PORT", "29511"}}));
  EXPECT_EQ(i.group_rank, 2) << "4 / 2";
  EXPECT_EQ(i.group_world_size, 3) << "ceil(5 / 2)";
  EXPECT_EQ(i.master_addr, "node0");
  EXPECT_EQ(i.master_port, 29511);
  const LaunchInfo none = parse_mpi(lookup_in(without(mpi_rank1(), "MASTER_ADDR")));
  EXPECT_EQ(none.master_addr, "127.0.0.1");
}

TEST(L04ParseMpi, MissingOrBad) {
  for (const char* name :
       {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
    SCOPED_TRACE(name);
    expect_usage([&] { parse_mpi(lookup_in(without(mpi_rank1(), name))); }, name, "is not set");
  }
  expect_usage([] { parse_mpi(lookup_in(with(mpi_rank1(), "MASTER_PORT", "port"))); },
               "MASTER_PORT", "not an integer");
}

// ---------------------------------------------------------------------------------------------
// validate
// ---------------------------------------------------------------------------------------------

TEST(L04Validate, ValidRanksPass) {
  validate(valid_info());
  validate(valid_info(Launcher::kMpi));
  validate(parse_torchrun(lookup_in(torchrun_rank3())));
  LaunchInfo one;  // the defaults: rank 0 of 1
  validate(one);
}

TEST(L04Validate, EachRuleNamesItsVariable) {
  struct Case {
    std::function<void(LaunchInfo&)> change;
    std::string subject;
    std::string text;
  };
  const std::vector<Case> cases = {
      {[](LaunchInfo& i) { i.world_size = 0; }, "WORLD_SIZE", "0 is not a positive"},
      {[](LaunchInfo& i) { i.rank = 2; }, "RANK", "2 is outside 0..1 (WORLD_SIZE is 2)"},
      {[](LaunchInfo& i) { i.rank = -1; }, "RANK", "-1 is outside 0..1"},
      {[](LaunchInfo& i) { i.local_world_size = 3; }, "LOCAL_WORLD_SIZE", "3"},
      {[](LaunchInfo& i) { i.local_world_size = 0; }, "LOCAL_WORLD_SIZE", "0"},
      {[](LaunchInfo& i) { i.local_rank = 2; }, "LOCAL_RANK",
       "2 is outside 0..1 (LOCAL_WORLD_SIZE is 2)"},
      {[](LaunchInfo& i) { i.group_rank = 1; }, "GROUP_RANK",
       "1 is outside 0..0 (GROUP_WORLD_SIZE is 1)"},
      {[](LaunchInfo& i) { i.group_world_size = 0; }, "GROUP_RANK", "GROUP_WORLD_SIZE"},
      {[](LaunchInfo& i) { i.role_rank = 2; }, "ROLE_RANK", "(ROLE_WORLD_SIZE is 2)"},
      {[](LaunchInfo& i) { i.master_addr = ""; }, "MASTER_ADDR", "empty"},
      {[](LaunchInfo& i) { i.master_port = 0; }, "MASTER_PORT", "0 is not a TCP port"},
      {[](LaunchInfo& i) { i.master_port = 65536; }, "MASTER_PORT", "65536"},
      {[](LaunchInfo& i) { i.restart_count = -1; }, "TORCHELASTIC_RESTART_COUNT", "-1"},
      {[](LaunchInfo& i) {
         i.restart_count = 2;
         i.max_restarts = 1;
       },
       "TORCHELASTIC_RESTART_COUNT", "(TORCHELASTIC_MAX_RESTARTS is 1)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.subject + ": " + c.text);
    LaunchInfo info = valid_info();
    c.change(info);
    expect_usage([&] { validate(info); }, c.subject, c.text);
  }
}

TEST(L04Validate, RulesInOrder) {
  // Rank and local rank both wrong: the rank (rule 2) is reported first.
  LaunchInfo info = valid_info();
  info.rank = 7;
  info.local_rank = 7;
  expect_usage([&] { validate(info); }, "RANK");
}

TEST(L04Validate, MpiNamesItsOwnVariables) {
  LaunchInfo info = valid_info(Launcher::kMpi);
  info.rank = 2;
  expect_usage([&] { validate(info); }, "OMPI_COMM_WORLD_RANK",
               "2 is outside 0..1 (OMPI_COMM_WORLD_SIZE is 2)");
  info = valid_info(Launcher::kMpi);
  info.local_rank = 5;
  expect_usage([&] { validate(info); }, "OMPI_COMM_WORLD_LOCAL_RANK",
               "(OMPI_COMM_WORLD_LOCAL_SIZE is 2)");
}

// ---------------------------------------------------------------------------------------------
// read_launch
// ---------------------------------------------------------------------------------------------

TEST(L04ReadLaunch, NoLauncherIsOneRank) {
  const LaunchInfo i = read_launch(lookup_in({}));
  EXPECT_EQ(i.launcher, Launcher::kNone);
  EXPECT_EQ(i.rank, 0);
  EXPECT_EQ(i.world_size, 1);
  EXPECT_EQ(i.local_world_size, 1);
  EXPECT_EQ(i.group_world_size, 1);
  EXPECT_EQ(i.master_addr, "127.0.0.1");
  EXPECT_EQ(i.master_port, 29500);
  const LaunchInfo j =
      read_launch(lookup_in({{"MASTER_ADDR", "10.0.0.9"}, {"MASTER_PORT", "29600"}}));
  EXPECT_EQ(j.master_addr, "10.0.0.9");
  EXPECT_EQ(j.master_port, 29600);
  expect_usage([] { read_launch(lookup_in({{"MASTER_PORT", "70000"}})); }, "MASTER_PORT");
}

TEST(L04ReadLaunch, TorchrunAndMpiAreValidated) {
  EXPECT_EQ(read_launch(lookup_in(torchrun_rank3())).rank, 3);
  EXPECT_EQ(read_launch(lookup_in(mpi_rank1())).launcher, Launcher::kMpi);
  // The header's example message, exactly.
  expect_usage([] { read_launch(lookup_in(with(torchrun_rank3(), "RANK", "4"))); }, "RANK",
               "RANK: 4 is outside 0..3 (WORLD_SIZE is 4)");
  expect_usage([] { read_launch(lookup_in(with(torchrun_rank3(), "LOCAL_RANK", "2"))); },
               "LOCAL_RANK", "(LOCAL_WORLD_SIZE is 2)");
  expect_usage([] { read_launch(lookup_in(with(mpi_rank1(), "OMPI_COMM_WORLD_SIZE", "1"))); },
               "OMPI_COMM_WORLD_RANK", "1 is outside 0..0");
  expect_usage([] { read_launch(lookup_in({{"LOCAL_RANK", "0"}})); }, "LOCAL_RANK");
  // LOCAL_WORLD_SIZE 0 must be an error, not a division by zero.
  expect_usage([] { read_launch(lookup_in(with(torchrun_rank3(), "LOCAL_WORLD_SIZE", "0"))); },
               "LOCAL_WORLD_SIZE");
}

// ---------------------------------------------------------------------------------------------
// pick_device and require_ranks
// ---------------------------------------------------------------------------------------------

TEST(L04PickDevice, CpuOrTheLocalRanksGpu) {
  LaunchInfo info = valid_info();  // local rank 1
  EXPECT_EQ(pick_device(info, 0), torch::Device(torch::kCPU));
  EXPECT_EQ(pick_device(info, 8), torch::Device(torch::kCUDA, 1));
  info.local_rank = 3;
  info.local_world_size = 4;
  info.world_size = 4;
  EXPECT_EQ(pick_device(info, 4), torch::Device(torch::kCUDA, 3));
  EXPECT_EQ(pick_device(info, 0), torch::Device(torch::kCPU)) << "no CUDA: CPU, any local rank";
  expect_usage([&] { pick_device(info, 2); }, "LOCAL_RANK", "--nproc_per_node=2");
}

TEST(L04PickDevice, OneVisibleGpuIsThisTasksOwn) {
  // srun --gpus-per-task=1 (or one CUDA_VISIBLE_DEVICES entry per process): every task sees
  // exactly its own GPU, as cuda:0, whatever its local rank.
  LaunchInfo info = valid_info();
  info.local_rank = 3;
  info.local_world_size = 4;
  info.world_size = 4;
  EXPECT_EQ(pick_device(info, 1), torch::Device(torch::kCUDA, 0));
  info.local_rank = 0;
  EXPECT_EQ(pick_device(info, 1), torch::Device(torch::kCUDA, 0));
}

TEST(L04RequireRanks, ShowsTheExactCommand) {
  LaunchInfo one;  // no launcher: 1 rank
  try {
    require_ranks(one, 2, {"build/bin/lesson04", "--json", "--timeout-s", "20"},
                  "torchrun --redirects 2 --tee 2");
    FAIL() << "no error for 1 rank where 2 are needed";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.subject(), "WORLD_SIZE");
    EXPECT_NE(what.find("build/bin/lesson04 needs at least 2 ranks, but it was started as 1 "
                        "(launcher: none)"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("\n  torchrun --redirects 2 --tee 2 --standalone --nproc_per_node=2 "
                        "--no_python build/bin/lesson04 --json --timeout-s 20"),
              std::string::npos)
        << what;
  }
  LaunchInfo two = valid_info();
  require_ranks(two, 2, {"lesson04"}, "torchrun");  // enough ranks: no error
  require_ranks(one, 1, {"lesson04"}, "torchrun");
  expect_usage([&] { require_ranks(two, 4, {"./a b"}, "torchrun"); }, "WORLD_SIZE",
               "torchrun --standalone --nproc_per_node=4 --no_python './a b'");
}

}  // namespace
}  // namespace dtc::l04

// The launch environment: torchrun's, OpenMPI's, or none, validated with clear errors.
#include <gtest/gtest.h>

#include <map>

#include "dtc/errors.h"
#include "dtc/launch.h"

namespace dtc {
namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::map<std::string, std::string> torchrun_vars() {
  // What torchrun --nnodes=2 --nproc_per_node=2 sets for the second rank of the second node.
  return {{"RANK", "3"},
          {"LOCAL_RANK", "1"},
          {"WORLD_SIZE", "4"},
          {"LOCAL_WORLD_SIZE", "2"},
          {"GROUP_RANK", "1"},
          {"MASTER_ADDR", "node0"},
          {"MASTER_PORT", "29400"},
          {"TORCHELASTIC_RESTART_COUNT", "2"},
          {"TORCHELASTIC_MAX_RESTARTS", "3"},
          {"TORCHELASTIC_RUN_ID", "job7"},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
}

std::string subject_of(std::map<std::string, std::string> vars) {
  try {
    read_launch_env(env_of(vars));
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("HINT:"), std::string::npos) << e.what();
    return e.subject();
  }
  return "(no error)";
}

TEST(LaunchEnv, NoLauncherIsOneRank) {
  const LaunchEnv env = read_launch_env(env_of({}));
  EXPECT_EQ(env.launcher, Launcher::kNone);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_TRUE(env.hosts_store());
}

TEST(LaunchEnv, Torchrun) {
  const LaunchEnv env = read_launch_env(env_of(torchrun_vars()));
  EXPECT_EQ(env.launcher, Launcher::kTorchrun);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.group_rank, 1);
  EXPECT_EQ(env.master_addr, "node0");
  EXPECT_EQ(env.master_port, 29400);
  EXPECT_EQ(env.restart_count, 2);
  EXPECT_EQ(env.run_id, "job7");
  EXPECT_TRUE(env.use_agent_store);
  EXPECT_FALSE(env.hosts_store());
  EXPECT_EQ(env.store_prefix(), "attempt2/") << "keys are scoped by the restart count";
}

TEST(LaunchEnv, AgentStoreRule) {
  auto vars = torchrun_vars();
  vars["RANK"] = "0";
  vars["LOCAL_RANK"] = "0";
  EXPECT_FALSE(read_launch_env(env_of(vars)).hosts_store()) << "the agent hosts the store";
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_TRUE(read_launch_env(env_of(vars)).hosts_store()) << "rank 0 hosts the store";
}

TEST(LaunchEnv, OpenMpi) {
  const LaunchEnv env = read_launch_env(env_of({{"OMPI_COMM_WORLD_RANK", "1"},
                                                {"OMPI_COMM_WORLD_SIZE", "2"},
                                                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  EXPECT_EQ(env.launcher, Launcher::kMpi);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.group_rank, 0) << "one node: rank / local size";
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(LaunchEnv, SrunTasks) {
  // srun -N2 --ntasks-per-node=4 on 3 nodes of 4, 4, 3 tasks: task 9 is the second task of the
  // third node (srun(1), OUTPUT ENVIRONMENT VARIABLES).
  std::map<std::string, std::string> v = {
      {"SLURM_PROCID", "9"},         {"SLURM_STEP_NUM_TASKS", "11"},
      {"SLURM_STEP_NUM_NODES", "3"}, {"SLURM_NODEID", "2"},
      {"SLURM_LOCALID", "1"},        {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"},
      {"SLURM_JOB_ID", "4242"},      {"MASTER_ADDR", "node0"},
      {"MASTER_PORT", "29511"}};
  LaunchEnv env = read_launch_env(env_of(v));
  EXPECT_EQ(env.launcher, Launcher::kSlurm);
  EXPECT_STREQ(launcher_name(env.launcher), "srun");
  EXPECT_EQ(env.rank, 9);
  EXPECT_EQ(env.world_size, 11);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 3) << "the third node runs 3 tasks";
  EXPECT_EQ(env.group_rank, 2);
  EXPECT_EQ(env.master_addr, "node0");
  EXPECT_EQ(env.master_port, 29511);
  v["SLURM_NODEID"] = "1";
  v["SLURM_PROCID"] = "5";
  EXPECT_EQ(read_launch_env(env_of(v)).local_world_size, 4) << "node 1: 4(x2) covers it";

  // Several nodes and no store address: say so, never guess 127.0.0.1.
  v.erase("MASTER_ADDR");
  EXPECT_EQ(subject_of(v), "MASTER_ADDR");
  // The batch script itself: SLURM_PROCID=0 of a job of 11 tasks, but no step: one rank.
  const LaunchEnv batch = read_launch_env(
      env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "11"}, {"SLURM_JOB_ID", "4242"}}));
  EXPECT_EQ(batch.launcher, Launcher::kNone);
  EXPECT_EQ(batch.world_size, 1);
  // torchrun started by srun: the workers' RANK wins.
  auto t = torchrun_vars();
  t["SLURM_PROCID"] = "0";
  t["SLURM_STEP_NUM_TASKS"] = "2";
  EXPECT_EQ(read_launch_env(env_of(t)).launcher, Launcher::kTorchrun);
  EXPECT_EQ(subject_of({{"SLURM_PROCID", "0"},
                        {"SLURM_STEP_NUM_TASKS", "2"},
                        {"SLURM_STEP_TASKS_PER_NODE", "two"}}),
            "SLURM_STEP_TASKS_PER_NODE");
  EXPECT_EQ(subject_of({{"SLURM_PROCID", "2"}, {"SLURM_STEP_NUM_TASKS", "2"}}), "SLURM_PROCID");
}

TEST(LaunchEnv, ClearErrors) {
  auto v = torchrun_vars();
  v["RANK"] = "three";
  EXPECT_EQ(subject_of(v), "RANK");
  v = torchrun_vars();
  v["RANK"] = "4";
  EXPECT_EQ(subject_of(v), "RANK") << "rank outside the world";
  v = torchrun_vars();
  v.erase("WORLD_SIZE");
  EXPECT_EQ(subject_of(v), "WORLD_SIZE");
  v = torchrun_vars();
  v.erase("MASTER_ADDR");
  EXPECT_EQ(subject_of(v), "MASTER_ADDR");
  v = torchrun_vars();
  v["MASTER_PORT"] = "70000";
  EXPECT_EQ(subject_of(v), "MASTER_PORT");
  v = torchrun_vars();
  v["LOCAL_RANK"] = "2";
  EXPECT_EQ(subject_of(v), "LOCAL_RANK");
  v = torchrun_vars();
  v["LOCAL_WORLD_SIZE"] = "8";
  EXPECT_EQ(subject_of(v), "LOCAL_WORLD_SIZE");
  EXPECT_EQ(subject_of({{"WORLD_SIZE", "2"}}), "WORLD_SIZE") << "WORLD_SIZE without RANK";
  EXPECT_EQ(subject_of({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
            "OMPI_COMM_WORLD_RANK");
}

TEST(LaunchEnv, NeedsSeveralRanksShowsTheCommand) {
  const LaunchEnv single = read_launch_env(env_of({}));
  try {
    require_world_size(single, 2, "build/bin/lesson06");
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("torchrun --nproc_per_node=2 --no_python "
                                         "build/bin/lesson06"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(require_world_size(read_launch_env(env_of(torchrun_vars())), 2, "x"));
}

// The variables each torchrun generation sets, as printed by `torchrun --no_python env` of
// PyTorch 2.15 and of Debian's 1.13 (besides RANK, WORLD_SIZE, MASTER_* and the like). 1.13's
// agent does not share its store (rank 0 hosts one), 2.x's does.
std::map<std::string, std::string> agent_vars(int generation) {
  std::map<std::string, std::string> v = torchrun_vars();
  v["TORCHELASTIC_RUN_ID"] = "none";
  v["TORCHELASTIC_USE_AGENT_STORE"] = generation >= 2 ? "True" : "False";
  if (generation >= 2) {
    v["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";
    v["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1";
  } else {
    v["NCCL_ASYNC_ERROR_HANDLING"] = "1";
  }
  return v;
}

TEST(LaunchEnv, TorchrunGenerationFromItsVariables) {
  EXPECT_EQ(torchrun_generation(env_of(agent_vars(2))), 2);
  auto shared_1x = agent_vars(1);
  shared_1x["TORCHELASTIC_USE_AGENT_STORE"] = "True";  // a 1.x that shares its store
  EXPECT_EQ(torchrun_generation(env_of(shared_1x)), 1);
  EXPECT_EQ(torchrun_generation(env_of(agent_vars(1))), std::nullopt)
      << "1.13's torchrun: rank 0 hosts the store, any LibTorch can";
  EXPECT_EQ(torchrun_generation(env_of({})), std::nullopt) << "not under torchrun";
  auto own_store = agent_vars(2);
  own_store["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_EQ(torchrun_generation(env_of(own_store)), std::nullopt)
      << "no agent store: the program hosts its own, of its own generation";
}

TEST(LaunchEnv, MismatchedTorchrunIsNamedBeforeTheStoreTimesOut) {
  // Same generation, or no shared store: nothing to say. (A primary-path program under
  // Debian's torchrun 1.13 runs: that agent leaves the store to rank 0.)
  EXPECT_NO_THROW(check_torchrun_generation(2, "venv/bin/torchrun", env_of(agent_vars(2))));
  EXPECT_NO_THROW(check_torchrun_generation(1, "/usr/bin/torchrun", env_of(agent_vars(1))));
  EXPECT_NO_THROW(check_torchrun_generation(2, "venv/bin/torchrun", env_of(agent_vars(1))));
  EXPECT_NO_THROW(check_torchrun_generation(1, "/usr/bin/torchrun", env_of({})));
  // A light-path (1.13) program under the venv's torchrun 2.x, whose agent hosts a 2.x store;
  // and a 2.x program under a 1.x agent that shares its store.
  auto shared_1x = agent_vars(1);
  shared_1x["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  for (auto [torch_major, vars] : {std::pair{1, agent_vars(2)}, std::pair{2, shared_1x}}) {
    const int launcher = torchrun_generation(env_of(vars)).value_or(0);
    try {
      check_torchrun_generation(torch_major, "THE-RIGHT-TORCHRUN", env_of(vars));
      FAIL() << "expected UsageError for LibTorch " << torch_major << " under torchrun "
             << launcher;
    } catch (const UsageError& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.subject(), "torchrun");
      EXPECT_NE(what.find("THE-RIGHT-TORCHRUN"), std::string::npos) << what;
      EXPECT_NE(what.find(std::to_string(launcher) + ".x"), std::string::npos) << what;
    }
  }
}

}  // namespace
}  // namespace dtc

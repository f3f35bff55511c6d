// Lesson 04 tests of the given helpers (env_vars.h): they pass before you start.
//   build/tests/lesson04_tests --gtest_filter='L04EnvVarsGiven.*'
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "dtc/errors.h"
#include "env_vars.h"

namespace dtc::l04 {
namespace {

// The subject of the UsageError that env_int throws for @p value, or "(no error)".
std::string int_error(const std::string& value) {
  try {
    env_int(lookup_in({{"RANK", value}}), "RANK");
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("HINT:"), std::string::npos) << e.what();
    return e.subject();
  }
  return "(no error)";
}

TEST(L04EnvVarsGiven, IntegersParse) {
  const auto env = lookup_in({{"A", "0"}, {"B", "17"}, {"C", "-3"}, {"D", "2147483647"}});
  EXPECT_EQ(env_int(env, "A"), 0);
  EXPECT_EQ(env_int(env, "B"), 17);
  EXPECT_EQ(env_int(env, "C"), -3);
  EXPECT_EQ(env_int(env, "D"), 2147483647);
  EXPECT_EQ(env_int(env, "UNSET"), std::nullopt);
}

TEST(L04EnvVarsGiven, NonIntegersAreErrors) {
  for (const char* bad : {"", "2x", " 2", "2 ", "1e3", "0x10", "-", "99999999999", "two"}) {
    SCOPED_TRACE(bad);
    EXPECT_EQ(int_error(bad), "RANK");
  }
}

TEST(L04EnvVarsGiven, RequiredIntSaysWhy) {
  try {
    env_required_int(lookup_in({}), "WORLD_SIZE", "RANK is set");
    FAIL() << "no error for an unset required variable";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.subject(), "WORLD_SIZE");
    EXPECT_NE(std::string(e.what()).find("is not set, but RANK is set"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(env_required_int(lookup_in({{"WORLD_SIZE", "4"}}), "WORLD_SIZE", "x"), 4);
}

TEST(L04EnvVarsGiven, Booleans) {
  const auto env = lookup_in({{"T1", "True"},
                              {"T2", "true"},
                              {"T3", "1"},
                              {"F1", "False"},
                              {"F2", "false"},
                              {"F3", "0"},
                              {"X", "yes"}});
  for (const char* t : {"T1", "T2", "T3"}) EXPECT_EQ(env_bool(env, t), true) << t;
  for (const char* f : {"F1", "F2", "F3"}) EXPECT_EQ(env_bool(env, f), false) << f;
  EXPECT_EQ(env_bool(env, "UNSET"), std::nullopt);
  EXPECT_THROW(env_bool(env, "X"), UsageError);
}

TEST(L04EnvVarsGiven, VariableNamesPerLauncher) {
  EXPECT_EQ(var_name(Launcher::kTorchrun, Var::kRank), "RANK");
  EXPECT_EQ(var_name(Launcher::kNone, Var::kWorldSize), "WORLD_SIZE");
  EXPECT_EQ(var_name(Launcher::kTorchrun, Var::kLocalWorldSize), "LOCAL_WORLD_SIZE");
  EXPECT_EQ(var_name(Launcher::kMpi, Var::kRank), "OMPI_COMM_WORLD_RANK");
  EXPECT_EQ(var_name(Launcher::kMpi, Var::kWorldSize), "OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(var_name(Launcher::kMpi, Var::kLocalRank), "OMPI_COMM_WORLD_LOCAL_RANK");
  EXPECT_EQ(var_name(Launcher::kMpi, Var::kLocalWorldSize), "OMPI_COMM_WORLD_LOCAL_SIZE");
}

TEST(L04EnvVarsGiven, ShellJoinQuotesOnlyWhatNeedsIt) {
  EXPECT_EQ(shell_join({"build/bin/lesson04", "--json", "--min-ranks=2"}),
            "build/bin/lesson04 --json --min-ranks=2");
  EXPECT_EQ(shell_join({"prog", "two words", ""}), "prog 'two words' ''");
  EXPECT_EQ(shell_join({"it's"}), "'it'\\''s'");
  EXPECT_EQ(shell_join({"$HOME", "a;b"}), "'$HOME' 'a;b'");
}

TEST(L04EnvVarsGiven, TableCoversEveryTaughtVariable) {
  std::set<std::string> names;
  for (const auto& v : launch_variables()) {
    EXPECT_TRUE(names.insert(v.name).second) << v.name << " is listed twice";
    EXPECT_FALSE(v.meaning.empty()) << v.name;
  }
  // The variables torchrun 2.15 and 1.13 set, as observed with `torchrun --no_python env`.
  for (const char* name : {"RANK",
                           "LOCAL_RANK",
                           "WORLD_SIZE",
                           "LOCAL_WORLD_SIZE",
                           "GROUP_RANK",
                           "GROUP_WORLD_SIZE",
                           "ROLE_NAME",
                           "ROLE_RANK",
                           "ROLE_WORLD_SIZE",
                           "MASTER_ADDR",
                           "MASTER_PORT",
                           "TORCHELASTIC_RESTART_COUNT",
                           "TORCHELASTIC_MAX_RESTARTS",
                           "TORCHELASTIC_RUN_ID",
                           "TORCHELASTIC_USE_AGENT_STORE",
                           "TORCHELASTIC_ERROR_FILE",
                           "OMP_NUM_THREADS",
                           "OMPI_COMM_WORLD_RANK",
                           "OMPI_COMM_WORLD_SIZE",
                           "OMPI_COMM_WORLD_LOCAL_RANK",
                           "OMPI_COMM_WORLD_LOCAL_SIZE",
                           "GLOO_SOCKET_IFNAME"}) {
    EXPECT_EQ(names.count(name), 1u) << name << " is missing from launch_variables()";
  }
}

}  // namespace
}  // namespace dtc::l04

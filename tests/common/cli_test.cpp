// The common command line and exit codes.
#include <gtest/gtest.h>

#include <sstream>

#include "dtc/cli.h"
#include "dtc/errors.h"
#include "dtc/log.h"
#include "dtc/todo.h"

namespace dtc {
namespace {

int parse(
    std::vector<const char*> argv, TrainFlags& flags, std::string* err_text = nullptr,
    const std::function<int()>& body = [] { return 0; }) {
  CLI::App app{"test", "prog"};
  add_train_flags(app, flags);
  argv.insert(argv.begin(), "prog");
  std::ostringstream err;
  const int code = run_cli(app, static_cast<int>(argv.size()), argv.data(), body, err);
  if (err_text) *err_text = err.str();
  return code;
}

TEST(Cli, TrainFlags) {
  TrainFlags f;
  ASSERT_EQ(parse({"--steps", "5", "--seed", "7", "--global-batch", "16", "--json"}, f), 0);
  EXPECT_EQ(f.steps, 5);
  EXPECT_EQ(f.seed, 7u);
  EXPECT_EQ(f.global_batch, 16);
  EXPECT_TRUE(f.json);
  EXPECT_EQ(f.backend, "gloo") << "the default backend";
  ASSERT_EQ(parse({"--backend", "nccl"}, f), 0);
  EXPECT_EQ(f.backend, "nccl");
  EXPECT_EQ(parse({"--backend", "mpi"}, f), kExitUsage);
}

TEST(Cli, ExitCodes) {
  TrainFlags f;
  std::string err;
  EXPECT_EQ(parse({"--steps", "0"}, f, &err), kExitUsage) << err;
  EXPECT_NE(err.find("--steps"), std::string::npos) << err;
  EXPECT_EQ(parse({"--nonsense"}, f, &err), kExitUsage);
  EXPECT_EQ(parse({}, f, &err, []() -> int { throw UsageError("--x", "bad", "fix"); }), kExitUsage);
  EXPECT_NE(err.find("HINT: fix"), std::string::npos) << err;
  EXPECT_EQ(parse({}, f, &err, []() -> int { DTC_TODO("L99", "do the thing"); }), kExitTodo);
  EXPECT_NE(err.find("TODO(L99)"), std::string::npos) << err;
  EXPECT_NE(err.find("HINT: do the thing"), std::string::npos) << err;
  EXPECT_EQ(parse({}, f, &err, []() -> int { throw std::runtime_error("disk full"); }),
            kExitFailure);
  EXPECT_EQ(parse({"--help"}, f, &err), kExitOk);
}

TEST(Cli, TodoNamesLessonFunctionAndPlace) {
  try {
    DTC_TODO("L42", "average the bucket");
  } catch (const TodoError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.lesson(), "L42");
    EXPECT_NE(what.find("TODO(L42)"), std::string::npos) << what;
    EXPECT_NE(what.find("TestBody"), std::string::npos) << "names the function: " << what;
    EXPECT_NE(what.find("cli_test.cpp:"), std::string::npos) << "names file:line: " << what;
  }
}

std::string logged(int rank) {
  std::FILE* f = std::tmpfile();
  RankLog log(rank, f);
  log("step {} loss {:.2f}", 3, 1.5);
  log.all("mine");
  std::rewind(f);
  char buf[256] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  return std::string(buf, n);
}

TEST(RankLog, OnlyRankZeroDoesSideWork) {
  EXPECT_EQ(logged(0), "[rank 0] step 3 loss 1.50\n[rank 0] mine\n");
  EXPECT_EQ(logged(1), "[rank 1] mine\n") << "rank 1 prints only what differs per rank";
}

TEST(Cli, JsonIsOneLine) {
  std::ostringstream out;
  print_json_line(out, {{"losses", {1.0, 0.5}}, {"tokens_per_s", 10}});
  EXPECT_EQ(out.str(), "{\"losses\":[1.0,0.5],\"tokens_per_s\":10}\n");
}

}  // namespace
}  // namespace dtc

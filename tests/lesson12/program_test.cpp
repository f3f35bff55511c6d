// Lesson 12's program on one rank: bad input is exit 2 naming the flag, and a run that resumes
// from its --checkpoint-dir prints the losses and the parameter digest of a run that never
// stopped.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "dtc_test.h"
#include "program.h"
#include "program_run.h"

namespace dtc::l12 {
namespace {

using test::clear_launch_env;
using test::last_json_line;
using test::run_in_process;

const std::vector<std::string> kModel{"--layers", "2",  "--hidden",       "32", "--heads", "2",
                                      "--seq",    "16", "--global-batch", "4",  "--json"};

std::vector<std::string> with(std::vector<std::string> args) {
  args.insert(args.end(), kModel.begin(), kModel.end());
  return args;
}

TEST(L12ProgramGiven, BadFlagsNameThemselves) {
  clear_launch_env();
  test::expect_usage_errors(
      "lesson12",
      {{{"--checkpoint-every", "2"}, "--checkpoint-every"},
       {{"--checkpoint-every", "-1", "--checkpoint-dir", "x"}, "--checkpoint-every"},
       {{"--steps", "4", "--fail-at-step", "4"}, "--fail-at-step"},
       {{"--fail-rank", "1", "--fail-at-step", "1"}, "--fail-rank"},
       {{"--hang-at-step", "20"}, "--hang-at-step"},
       {{"--fail-every", "5", "--fail-at-step", "2"}, "--fail-every"},
       {{"--backend", "nccl"}, "--backend"},
       {{"--mix", "2x1x1x1"}, "--mix"}},
      run_program);
}

// A temporary directory, removed at the end.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& name) {
    path = (std::filesystem::temp_directory_path() /
            ("dtc-l12-" + std::to_string(::getpid()) + "-" + name))
               .string();
    std::filesystem::remove_all(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

// Four steps saving every two, then a run of six from the same directory: it resumes from step 4
// and ends with the losses and digest of six steps that never stopped; --no-resume starts again.
TEST(L12Program, AResumedRunPrintsTheUninterruptedRunsNumbers) {
  clear_launch_env();
  TempDir dir("sync");
  const auto straight = run_in_process("lesson12", with({"--steps", "6"}), run_program);
  ASSERT_EQ(straight.code, 0) << straight.err;
  const auto first = run_in_process(
      "lesson12", with({"--steps", "4", "--checkpoint-dir", dir.path, "--checkpoint-every", "2"}),
      run_program);
  ASSERT_EQ(first.code, 0) << first.err;
  const auto j1 = last_json_line(first.out);
  EXPECT_EQ(j1["checkpoints"], nlohmann::json({2, 4}));
  EXPECT_TRUE(j1["resumed_from_step"].is_null());
  EXPECT_EQ(j1["restarts"], 0);
  EXPECT_TRUE(std::filesystem::exists(dir.path + "/step_00000004/metadata.json"));
  const auto second =
      run_in_process("lesson12", with({"--steps", "6", "--checkpoint-dir", dir.path}), run_program);
  ASSERT_EQ(second.code, 0) << second.err;
  const auto j2 = last_json_line(second.out);
  const auto js = last_json_line(straight.out);
  EXPECT_EQ(j2["resumed_from_step"], 4);
  EXPECT_EQ(j2["losses"], js["losses"]);
  EXPECT_EQ(j2["param_digest"], js["param_digest"]);
  const auto fresh = run_in_process(
      "lesson12", with({"--steps", "3", "--checkpoint-dir", dir.path, "--no-resume"}), run_program);
  ASSERT_EQ(fresh.code, 0) << fresh.err;
  EXPECT_TRUE(last_json_line(fresh.out)["resumed_from_step"].is_null());
  // The same saves in the background (--async-save): every file byte for byte the same.
  TempDir async("async");
  const auto in_background = run_in_process("lesson12",
                                            with({"--steps", "4", "--checkpoint-dir", async.path,
                                                  "--checkpoint-every", "2", "--async-save"}),
                                            run_program);
  ASSERT_EQ(in_background.code, 0) << in_background.err;
  EXPECT_EQ(last_json_line(in_background.out)["checkpoint"]["async"], true);
  int compared = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir.path)) {
    if (!entry.is_regular_file()) continue;
    const auto relative = std::filesystem::relative(entry.path(), dir.path);
    SCOPED_TRACE(relative.string());
    const auto other = std::filesystem::path(async.path) / relative;
    ASSERT_TRUE(std::filesystem::exists(other));
    std::ifstream a(entry.path(), std::ios::binary), b(other, std::ios::binary);
    const std::string ba((std::istreambuf_iterator<char>(a)), std::istreambuf_iterator<char>());
    const std::string bb((std::istreambuf_iterator<char>(b)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(ba == bb) << "differs";
    ++compared;
  }
  EXPECT_EQ(compared, 2 * 2) << "two steps of a shard and a metadata file";
  // A run whose steps the newest checkpoint already passed: a usage error, not a silent no-op.
  const auto done =
      run_in_process("lesson12", with({"--steps", "3", "--checkpoint-dir", dir.path}), run_program);
  EXPECT_EQ(done.code, 2) << done.err;
}

}  // namespace
}  // namespace dtc::l12

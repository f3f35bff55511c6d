// The training programs' skeleton (dtc/program.h): the shared flags and their validators, the
// step log, the helpers every program's report uses.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>

#include "dtc/errors.h"
#include "dtc/program.h"

namespace dtc {
namespace {

struct Parsed {
  int code = 0;
  std::string err;
};

// Runs a TrainCli on @p args with a body that only succeeds.
Parsed parse(std::vector<const char*> args, TrainOptions* seen = nullptr) {
  TrainCli cli("prog", "a test program", 7);
  args.insert(args.begin(), "prog");
  std::ostringstream err;
  Parsed p;
  p.code = cli.run(static_cast<int>(args.size()), args.data(), err, [&] {
    if (seen) *seen = cli.options();
    cli.options().model_config();  // the shape check every program makes
    return kExitOk;
  });
  p.err = err.str();
  return p;
}

TEST(Skeleton, DefaultsAndSharedFlags) {
  TrainOptions o;
  ASSERT_EQ(parse({}, &o).code, 0);
  EXPECT_EQ(o.train.steps, 7) << "the program's own default";
  EXPECT_EQ(o.model.layers, GptConfig{}.layers);
  EXPECT_DOUBLE_EQ(o.lr, 3e-3);
  ASSERT_EQ(parse({"--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--lr", "1e-2",
                   "--untied", "--steps", "3"},
                  &o)
                .code,
            0);
  const GptConfig m = o.model_config();
  EXPECT_EQ(m.layers, 2);
  EXPECT_EQ(m.hidden, 32);
  EXPECT_EQ(m.heads, 2);
  EXPECT_EQ(m.ctx, 16);
  EXPECT_FALSE(m.tied);
  EXPECT_DOUBLE_EQ(o.lr, 1e-2);
  EXPECT_EQ(o.train.steps, 3);
}

// Every bad value of a shared flag exits 2, names the flag and says what to pass instead.
TEST(Skeleton, BadSharedFlagsExitTwoWithTheFix) {
  const std::pair<std::vector<const char*>, const char*> cases[] = {
      {{"--layers", "0"}, "--layers"},
      {{"--hidden", "-4"}, "--hidden"},
      {{"--heads", "x"}, "--heads"},
      {{"--seq", "0"}, "--seq"},
      {{"--lr", "-1"}, "--lr"},
      {{"--lr", "inf"}, "--lr"},
      {{"--lr", "nan"}, "--lr"},
      {{"--lr", "0"}, "--lr"},
      {{"--steps", "0"}, "--steps"},
      {{"--global-batch", "0"}, "--global-batch"},
      {{"--backend", "mpi"}, "--backend"},
      {{"--heads", "3"}, "--heads"},  // 3 does not divide 128
      {{"--bogus"}, "--bogus"}};
  for (const auto& [args, flag] : cases) {
    SCOPED_TRACE(flag);
    const Parsed p = parse(args);
    EXPECT_EQ(p.code, kExitUsage) << p.err;
    EXPECT_NE(p.err.find(flag), std::string::npos) << p.err;
    EXPECT_NE(p.err.find("HINT"), std::string::npos) << p.err;
  }
  // The validators' own words say what to pass.
  EXPECT_NE(parse({"--layers", "0"}).err.find("pass e.g. --layers 4"), std::string::npos);
  EXPECT_NE(parse({"--lr", "inf"}).err.find("finite"), std::string::npos);
}

TEST(Skeleton, ReadableFileNamesThePathAndTheFix) {
  CLI::App app{"t", "prog"};
  std::string path;
  app.add_option("--resume", path)->check(readable_file("pass a checkpoint written by --save"));
  std::ostringstream err;
  const char* bad[] = {"prog", "--resume", "/nonexistent/ck.pt"};
  EXPECT_EQ(run_cli(
                app, 3, bad, [] { return 0; }, err),
            kExitUsage);
  EXPECT_NE(err.str().find("--resume"), std::string::npos) << err.str();
  EXPECT_NE(err.str().find("cannot read '/nonexistent/ck.pt': pass a checkpoint"),
            std::string::npos)
      << err.str();
  const std::string real = ::testing::TempDir() + "/skeleton_readable.txt";
  std::ofstream(real) << "x";
  const char* good[] = {"prog", "--resume", real.c_str()};
  EXPECT_EQ(run_cli(
                app, 3, good, [] { return 0; }, err),
            kExitOk);
  std::remove(real.c_str());
}

std::vector<std::string> lines_of(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> all;
  for (std::string line; std::getline(in, line);) all.push_back(line);
  return all;
}

TEST(Skeleton, StepLogPrintsATenthOfTheSteps) {
  std::ostringstream err;
  StepLog log(err, /*talk=*/true, /*first=*/0, /*steps=*/20, /*tokens_per_step=*/100, "[rank 0] ");
  for (int64_t step = 0; step < 20; ++step) {
    log.begin_step();
    log.end_step(step, 5.0f - 0.1f * static_cast<float>(step));
  }
  // Lines for step 1, then every 2nd step (a tenth of 20): 1 + 10.
  const auto all = lines_of(err.str());
  ASSERT_EQ(all.size(), 11u) << err.str();
  const std::regex format(R"(\[rank 0\] step +\d+/20  loss \d\.\d{4} +\d+\.\dk tokens/s)");
  for (const auto& l : all) EXPECT_TRUE(std::regex_match(l, format)) << l;
  EXPECT_EQ(all.front().substr(0, 22), "[rank 0] step  1/20  l");
  EXPECT_NE(all.back().find("step 20/20  loss 3.1000"), std::string::npos) << all.back();
  EXPECT_EQ(log.losses().size(), 20u);
  EXPECT_EQ(log.step_seconds().size(), 20u);
  EXPECT_GT(log.tokens_per_s(), 0.0);
  // A rank that does not talk records the same and prints nothing.
  std::ostringstream quiet;
  StepLog other(quiet, /*talk=*/false, 0, 3, 100);
  for (int64_t step = 0; step < 3; ++step) other.end_step(step, 1.0f);
  EXPECT_TRUE(quiet.str().empty());
  EXPECT_EQ(other.losses().size(), 3u);
}

TEST(Skeleton, StepLogOfALongRunSaysTheTimeLeft) {
  std::ostringstream err;
  const int64_t first = 10, steps = first + StepLog::kLongRun;  // a resumed long run
  StepLog log(err, /*talk=*/true, first, steps, 100);
  for (int64_t step = first; step < steps; ++step) log.end_step(step, 1.0f);
  const auto all = lines_of(err.str());
  ASSERT_EQ(all.size(), 11u) << err.str();
  const std::regex format(R"(step +\d+/110  loss 1\.0000 +\d+\.\dk tokens/s  ETA \d+:\d\d)");
  for (const auto& l : all) EXPECT_TRUE(std::regex_match(l, format)) << l;
  EXPECT_NE(all.front().find("step  11/110"), std::string::npos) << all.front();
  EXPECT_NE(all.back().find("ETA 0:00"), std::string::npos) << all.back();
}

TEST(Skeleton, Helpers) {
  EXPECT_DOUBLE_EQ(median({}), 0.0);
  EXPECT_DOUBLE_EQ(median({3, 1, 2}), 2.0);
  EXPECT_DOUBLE_EQ(median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(with_commas(834304), "834,304");
  EXPECT_EQ(with_commas(-1234567), "-1,234,567");
  EXPECT_EQ(with_commas(999), "999");
  EXPECT_EQ(clock_time(150), "2:30");
  EXPECT_EQ(clock_time(3725), "1:02:05");
  EXPECT_EQ(human_bytes(512), "512 B");
  EXPECT_EQ(human_bytes(262144), "262.1 kB");
  EXPECT_EQ(human_bytes(1.88e9), "1.88 GB");
  EXPECT_NO_THROW(check_resume_step(3, 5));
  try {
    check_resume_step(5, 5);
    FAIL() << "a checkpoint at the last step leaves nothing to run";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.subject(), "--steps");
  }
  const auto c = config_json(GptConfig{}, 8, 1, 3e-3);
  for (const char* key :
       {"layers", "hidden", "heads", "seq", "vocab", "tied", "batch", "seed", "lr"}) {
    EXPECT_TRUE(c.contains(key)) << key;
  }
}

TEST(Skeleton, OneRankJobNeedsNoLauncher) {
  Job job = Job::start("gloo", std::chrono::seconds(5));
  EXPECT_EQ(job.world(), 1);
  EXPECT_TRUE(job.rank0());
  EXPECT_TRUE(job.device.is_cpu());
  job.finish();
  EXPECT_THROW(Job::start("mpi", std::chrono::seconds(5)), UsageError);
}

}  // namespace
}  // namespace dtc

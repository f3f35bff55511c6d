// Lesson 02 tests of the program: its flags, its errors, and its JSON line.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "dtc/compat.h"
#include "program.h"
#include "program_run.h"
#include "reference.h"

namespace dtc::l02 {
namespace {

using ::dtc::test::last_json_line;
using ::dtc::test::ProgramRun;

ProgramRun run(std::vector<std::string> args) {
  ::setenv("DTC_DEVICE", "cpu", 1);  // the allocator measures CPU memory, also on GPU machines
  return ::dtc::test::run_in_process("lesson02", std::move(args), run_program);
}

const std::vector<std::string> kTiny = {"--layers", "1",  "--hidden",       "32", "--heads", "2",
                                        "--seq",    "16", "--global-batch", "2"};

std::vector<std::string> tiny(std::vector<std::string> more) {
  std::vector<std::string> args = kTiny;
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(L02ProgramGiven, BadInputExitsTwoNamingTheFlag) {
  ::setenv("DTC_DEVICE", "cpu", 1);
  const std::vector<::dtc::test::BadInput> cases = {
      {{"--heads", "3"}, "--heads"},
      {{"--layers", "0"}, "--layers"},
      {{"--seq", "1000000"}, "--seq"},
      {{"--lr", "-1"}, "--lr"},
      {{"--steps", "0"}, "--steps"},
      {{"--resume", "/nonexistent/ck.pt"}, "--resume"},
      {{"--data", "/nonexistent/x"}, "--data"},
      {{"--precision", "fp8"}, "--precision"},
      {{"--grad-dtype", "bf16"}, "--grad-dtype"},
      {{"--recompute", "half"}, "--recompute"},
      {{"--precision", "bf16", "--save", "/tmp/x.pt"}, "--save"},
      // The ledger predicts a step that cannot fit before LibTorch's allocator fails on it.
      {{"--global-batch", "100000000"}, "--global-batch"},
      {{"--trace", "/proc/forbidden"}, "--trace"},
      {{"--trace", "/dev/null"}, "--trace"}};
  ::dtc::test::expect_usage_errors("lesson02", cases, run_program);
}

TEST(L02ProgramGiven, HelpExitsZero) {
  const ProgramRun r = run({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.err.find("--global-batch"), std::string::npos);
}

TEST(L02Program, JsonLineHasLossesTokensPerSecondAndMemory) {
  const ProgramRun r = run(tiny({"--steps", "3", "--json"}));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json_line(r.out);
  EXPECT_EQ(j.at("losses").size(), 3u);
  EXPECT_GT(j.at("tokens_per_s").get<double>(), 0.0);
  GptConfig m{256, 16, 32, 1, 2, true};
  const int64_t P = test::gpt_params(m);
  EXPECT_EQ(j.at("params").get<int64_t>(), P);
  const auto& mem = j.at("memory");
  for (const char* kind : {"measured", "from_tensors", "predicted"}) {
    SCOPED_TRACE(kind);
    EXPECT_EQ(mem.at(kind).at("params").get<int64_t>(), 4 * P);
    EXPECT_EQ(mem.at(kind).at("grads").get<int64_t>(), 4 * P);
    EXPECT_EQ(mem.at(kind).at("optimizer").get<int64_t>(), 8 * P);
  }
  EXPECT_GE(mem.at("measured").at("activations").get<int64_t>(),
            mem.at("predicted").at("activations").get<int64_t>());
  EXPECT_NE(r.err.find("tokens/s"), std::string::npos) << "progress goes to stderr";
  EXPECT_EQ(r.err.find("ETA"), std::string::npos) << "a 3-step run needs no time left";
}

TEST(L02Program, JsonReportsPrecisionRecomputeAndTheLedgersBytes) {
  // Any mode checked against the ledger by one command: the allocator's bytes for parameters,
  // gradients, master weights and AdamW's moments equal the ledger's, to the byte.
  GptConfig m{256, 16, 32, 1, 2, true};
  const int64_t P = test::gpt_params(m);
  struct Case {
    std::vector<std::string> flags;
    const char* precision;
    const char* grad_dtype;
    const char* recompute;
    int64_t params, grads, master;
  };
  const Case cases[] = {
      {{"--precision", "bf16"}, "bf16", "bf16", "none", 2 * P, 2 * P, 4 * P},
      {{"--precision", "bf16", "--grad-dtype", "fp32", "--recompute", "selective"},
       "bf16",
       "fp32",
       "selective",
       2 * P,
       4 * P,
       4 * P},
      {{"--precision", "fp16", "--recompute", "full"}, "fp16", "fp16", "full", 2 * P, 2 * P, 4 * P},
      {{"--recompute", "full"}, "fp32", "fp32", "full", 4 * P, 4 * P, 0}};
  for (const Case& k : cases) {
    SCOPED_TRACE(testing::Message() << k.precision << " " << k.recompute);
    auto flags = k.flags;
    flags.insert(flags.end(), {"--steps", "2", "--json"});
    const ProgramRun r = run(tiny(flags));
    if (std::string(k.precision) == "fp16" && !kCpuFp16Training) {
      EXPECT_EQ(r.code, 2) << "1.13 has no CPU fp16: a usage error that says so";
      EXPECT_NE(r.err.find("--precision"), std::string::npos) << r.err;
      continue;
    }
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = last_json_line(r.out);
    EXPECT_EQ(j.at("precision"), k.precision);
    EXPECT_EQ(j.at("grad_dtype"), k.grad_dtype);
    EXPECT_EQ(j.at("recompute"), k.recompute);
    const auto& mem = j.at("memory");
    for (const char* kind : {"measured", "predicted"}) {
      SCOPED_TRACE(kind);
      EXPECT_EQ(mem.at(kind).at("params").get<int64_t>(), k.params);
      EXPECT_EQ(mem.at(kind).at("grads").get<int64_t>(), k.grads);
      EXPECT_EQ(mem.at(kind).at("master").get<int64_t>(), k.master);
      EXPECT_EQ(mem.at(kind).at("optimizer").get<int64_t>(), 8 * P);
    }
    EXPECT_GE(mem.at("measured").at("activations").get<int64_t>(),
              mem.at("predicted").at("activations").get<int64_t>());
    for (const char* key : {"params", "grads", "master", "optimizer"}) {
      EXPECT_EQ(mem.at("from_tensors").at(key), mem.at("measured").at(key)) << key;
    }
    if (std::string(k.precision) == "fp16") {
      EXPECT_EQ(j.at("loss_scale").get<double>(), 65536.0) << "no overflow in 2 steps here";
      EXPECT_EQ(j.at("skipped_steps").get<int64_t>(), 0);
    }
  }
}

TEST(L02Program, SaveAndResumeContinueTheRun) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("dtc-l02-program-" + std::to_string(::getpid()) + ".pt"))
                               .string();
  const ProgramRun straight = run(tiny({"--steps", "4", "--json"}));
  ASSERT_EQ(straight.code, 0) << straight.err;
  const ProgramRun first = run(tiny({"--steps", "2", "--save", path}));
  ASSERT_EQ(first.code, 0) << first.err;
  const ProgramRun resumed = run(tiny({"--steps", "4", "--resume", path, "--json"}));
  std::remove(path.c_str());
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  const auto all = last_json_line(straight.out).at("losses").get<std::vector<float>>();
  const auto rest = last_json_line(resumed.out).at("losses").get<std::vector<float>>();
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[0], all[2]) << "bit for bit";
  EXPECT_EQ(rest[1], all[3]) << "bit for bit";
  EXPECT_EQ(last_json_line(resumed.out).at("first_step").get<int64_t>(), 2);
}

}  // namespace
}  // namespace dtc::l02

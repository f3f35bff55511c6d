// Lesson 01 tests: the lesson01 program, run in-process.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "dtc_test.h"
#include "program.h"
#include "program_run.h"

namespace dtc::l01 {
namespace {

using Result = ::dtc::test::ProgramRun;

Result run_lesson01(std::vector<std::string> args) {
  return ::dtc::test::run_in_process("lesson01", std::move(args), run_program);
}

using ::dtc::test::last_json_line;

// Each case (arguments, flag) must exit with 2 and a message naming the flag and the fix.
void expect_usage_errors(const std::vector<::dtc::test::BadInput>& cases) {
  ::dtc::test::expect_usage_errors("lesson01", cases, run_program);
}

TEST(L01Program, BareParamsJson) {
  // The outline's 7B example: 16 bytes/param -> 112 GB, and no activations without a shape.
  const Result r = run_lesson01({"--params", "7e9", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json_line(r.out);
  EXPECT_EQ(j.at("params").get<int64_t>(), 7000000000LL);
  EXPECT_CLOSE_REL(j.at("per_device_bytes").at("total").get<double>(), 112e9, 1e-12,
                   "course outline: 7B -> 112 GB");
  EXPECT_EQ(j.at("per_device_bytes").at("activations").get<double>(), 0.0);
  for (const char* key : {"params", "grads", "optimizer", "activations", "total"}) {
    EXPECT_TRUE(j.at("per_device_bytes").contains(key)) << key;
  }
  EXPECT_TRUE(j.contains("per_layer_activation_bytes"));
}

TEST(L01Program, ModelJson) {
  const Result r = run_lesson01({"--model", "llama-7b", "--zero", "3", "--dp", "8", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json_line(r.out);
  EXPECT_EQ(j.at("params").get<int64_t>(), 6738415616LL) << "LLaMA-7B (Touvron et al. 2023)";
  // ZeRO-3 over 8: all 16 bytes/param sharded (ZeRO sec. 5: (4+K)P/Nd).
  const double states = j.at("per_device_bytes").at("params").get<double>() +
                        j.at("per_device_bytes").at("grads").get<double>() +
                        j.at("per_device_bytes").at("optimizer").get<double>();
  EXPECT_CLOSE_REL(states, 16.0 * 6738415616.0 / 8, 1e-12, "ZeRO stage 3: (4+K)P/Nd");
  EXPECT_GT(j.at("per_layer_activation_bytes").get<double>(), 0.0);
}

TEST(L01Program, MixtureOfExpertsTotalAndActive) {
  // Mixtral 8x7B: 46,702,792,704 parameters, 12,879,925,248 active per token (by hand from its
  // config: L01Moe.Mixtral8x7bExact).
  const Result r = run_lesson01({"--model", "mixtral-8x7b", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json_line(r.out);
  EXPECT_EQ(j.at("params").get<int64_t>(), 46702792704LL) << "Mixtral 8x7B, total";
  EXPECT_EQ(j.at("active_params").get<int64_t>(), 12879925248LL) << "Mixtral 8x7B, active";
  const Result text = run_lesson01({"--model", "mixtral-8x7b"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("46.7B parameters, 12.9B active per token"), std::string::npos)
      << text.out;
  // A dense model: every parameter is active, and the table does not mention it.
  const auto dense = last_json_line(run_lesson01({"--model", "llama-7b", "--json"}).out);
  EXPECT_EQ(dense.at("active_params").get<int64_t>(), 6738415616LL) << "LLaMA-7B";
  EXPECT_EQ(run_lesson01({"--model", "llama-7b"}).out.find("active"), std::string::npos);
}

TEST(L01Program, TheFlopsOfAMixtureOfExpertsFollowItsActiveParameters) {
  // 6 N D with N the active parameters (Kaplan et al. 2020: N is what a token goes through):
  // Mixtral 8x7B's 12,879,925,248 (L01Moe.Mixtral8x7bExact).
  const Result r =
      run_lesson01({"--model", "mixtral-8x7b", "--tokens", "1e12", "--gpus", "1024", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CLOSE_REL(last_json_line(r.out).at("train_time_s").get<double>(),
                   6 * 12879925248.0 * 1e12 / (1024 * 989e12 * 0.4), 1e-12,
                   "closed form: 6 N_active D / (gpus peak mfu)");
}

TEST(L01Program, ExpertParallelismJson) {
  // --ep 8 over --dp 8: each GPU holds 1 of Mixtral's 8 experts a block: 1,605,636,096 +
  // 45,097,156,608 / 8 = 7,242,780,672 parameters, 2 bytes each in bf16; 5,637,144,576 of them
  // routed experts (by hand: L01Moe.ExpertParallelismHoldsEOverEpRoutedExperts).
  const Result r = run_lesson01({"--model", "mixtral-8x7b", "--dp", "8", "--ep", "8", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json_line(r.out);
  EXPECT_EQ(j.at("setup").at("ep").get<int64_t>(), 8);
  EXPECT_DOUBLE_EQ(j.at("params_per_replica").get<double>(), 7242780672.0);
  EXPECT_DOUBLE_EQ(j.at("expert_params_per_gpu").get<double>(), 5637144576.0);
  EXPECT_DOUBLE_EQ(j.at("per_device_bytes").at("params").get<double>(), 2 * 7242780672.0)
      << "1,605,636,096 + 45,097,156,608 / 8 parameters, 2 bytes each";
  const Result text = run_lesson01({"--model", "mixtral-8x7b", "--dp", "8", "--ep", "8"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("holds 1 of each MoE block's 8 routed experts"), std::string::npos)
      << text.out;
}

TEST(L01Program, PlanWithExpertParallelism) {
  // --plan --ep 8: every mix keeps ep 8 over its dp ranks, and costs the all-to-alls
  // (L01Traffic.ExpertAllToAll: 30,064,771,072 bytes a step for dp 16 at 4096 tokens, 64 a step).
  const Result r = run_lesson01({"--plan", "--model", "mixtral-8x7b", "--gpus", "16", "--ep", "8",
                                 "--seq", "4096", "--global-batch", "64", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json_line(r.out);
  EXPECT_EQ(j.at("params").get<int64_t>(), 46702792704LL);
  EXPECT_EQ(j.at("active_params").get<int64_t>(), 12879925248LL);
  const auto& plan = j.at("plan");
  EXPECT_EQ(plan.at("ep").get<int64_t>(), 8);
  EXPECT_EQ(plan.at("dp").get<int64_t>() % 8, 0) << "ep folds over the dp ranks";
  bool costed = false;
  for (const auto& t : plan.at("traffic")) costed |= t.at("strategy") == "EP";
  EXPECT_TRUE(costed) << plan.at("traffic");
  const auto& reasons = plan.at("reasons");
  ASSERT_EQ(reasons.size(), 8u) << "dp, tp, pp, cp, zero, recompute, micro-batch, ep";
  EXPECT_EQ(reasons[7].get<std::string>().rfind("ep 8: ", 0), 0u) << reasons[7];
  const Result cmp =
      run_lesson01({"--plan", "--model", "mixtral-8x7b", "--gpus", "16", "--ep", "8", "--seq",
                    "4096", "--global-batch", "64", "--compare", "16x1x1x1:1", "--json"});
  ASSERT_EQ(cmp.code, 0) << cmp.err;
  EXPECT_EQ(last_json_line(cmp.out).at("compare").at("ep").get<int64_t>(), 8);
}

TEST(L01Program, TableAndTimeToTrain) {
  const Result r = run_lesson01({"--model", "llama3-70b", "--tokens", "1e12", "--gpus", "1"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("optimizer states"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("does NOT fit"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("years"), std::string::npos) << "70B on 1T tokens, one GPU:\n" << r.out;
}

TEST(L01Program, NoArgumentsComparesTheFamily) {
  const Result r = run_lesson01({});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* name : {"llama-7b", "llama2-70b", "llama3-405b"}) {
    EXPECT_NE(r.out.find(name), std::string::npos) << name << " missing:\n" << r.out;
  }
  const Result j = run_lesson01({"--json"});
  ASSERT_EQ(j.code, 0) << j.err;
  const auto rows = last_json_line(j.out).at("comparison");
  ASSERT_EQ(rows.size(), 3u);
  // The outline: one 80 GB H100 cannot hold the training state past 7B.
  EXPECT_FALSE(rows[1].at("fits").get<bool>());
  EXPECT_FALSE(rows[2].at("fits").get<bool>());
}

// The course's own cluster (8 CPU ranks, 8 MiB each): the plan speaks MiB, fits the course's
// GPT split (lesson 11 runs the pick), and --mem-mib sets the same budget on another cluster.
TEST(L01Program, PlanOnTheCoursesCpuCluster) {
  const std::vector<std::string> args = {"--plan",     "--model",        "course-gpt", "--cluster",
                                         "course-cpu", "--precision",    "fp32",       "--seq",
                                         "64",         "--global-batch", "8",          "--gpus",
                                         "8"};
  const Result text = run_lesson01(args);
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("8 MiB each"), std::string::npos) << text.out;
  EXPECT_EQ(text.out.find("0.00 GB"), std::string::npos) << "MiB, not GB rounded to 0:\n"
                                                         << text.out;
  std::vector<std::string> json_args = args;
  json_args.emplace_back("--json");
  const auto j = last_json_line(run_lesson01(json_args).out);
  const auto& plan = j.at("plan");
  EXPECT_TRUE(plan.at("fits").get<bool>());
  EXPECT_EQ(j.at("params").get<int64_t>(), 834304) << "lesson 02's model";
  EXPECT_LE(plan.at("per_gpu_bytes").get<double>(), 0.9 * 8 * 1024 * 1024);
  EXPECT_GT(
      plan.at("tp").get<int64_t>() * plan.at("pp").get<int64_t>() * plan.at("cp").get<int64_t>(), 1)
      << "13.3 MB of fp32 AdamW state does not fit 8 MiB whole";
  const auto mib =
      last_json_line(run_lesson01({"--plan", "--model", "course-gpt", "--cluster", "dgx-h100",
                                   "--mem-mib", "8", "--gpus", "8", "--json"})
                         .out);
  EXPECT_DOUBLE_EQ(mib.at("cluster").at("gpu_mem_gb").get<double>(), 8.0 * 1024 * 1024 / 1e9);
  const Result both =
      run_lesson01({"--plan", "--model", "course-gpt", "--mem-mib", "8", "--gpu-mem", "80"});
  EXPECT_EQ(both.code, 2);
  EXPECT_NE(both.err.find("--mem-mib"), std::string::npos) << both.err;
}

TEST(L01Program, PlanJson) {
  const Result r = run_lesson01(
      {"--plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json_line(r.out);
  const auto& plan = j.at("plan");
  for (const char* key :
       {"dp", "tp", "pp", "cp", "zero_stage", "recompute", "micro_batch", "virtual_stages", "shard",
        "reasons", "branches", "per_gpu_bytes", "comm_time_s", "fits"}) {
    EXPECT_TRUE(plan.contains(key)) << key;
  }
  EXPECT_TRUE(plan.at("fits").get<bool>());
  EXPECT_EQ(plan.at("dp").get<int64_t>() * plan.at("tp").get<int64_t>() *
                plan.at("pp").get<int64_t>() * plan.at("cp").get<int64_t>(),
            64);
  EXPECT_LE(plan.at("tp").get<int64_t>(), 8) << "TP stays inside an 8-GPU node";
  EXPECT_LE(plan.at("per_gpu_bytes").get<double>(), 80e9);
  EXPECT_EQ(plan.at("reasons").size(), 7u) << "dp, tp, pp, cp, zero, recompute, micro-batch";
  const auto& branches = plan.at("branches");
  ASSERT_EQ(branches.size(), 5u) << "DDP, ZeRO, TP, TP+PP, TP+PP+CP";
  EXPECT_EQ(branches[0].at("family"), "DDP");
  EXPECT_TRUE(branches[0].at("best").is_null()) << "70B fits on no single GPU";
  EXPECT_FALSE(branches[1].at("best").is_null()) << "ZeRO-3 fits on 64 GPUs";
  for (const auto& b : branches) EXPECT_FALSE(b.at("verdict").get<std::string>().empty());
  EXPECT_EQ(j.at("strategies").size(), 7u) << "DDP, ZeRO-1/2/3, TP, PP, CP";
  // The plan's default numerics: fp32 gradients, reduced in fp32 (Megatron-LM's bf16 default).
  EXPECT_EQ(j.at("precision"), "mixed-fp32-grads");
  EXPECT_EQ(j.at("gradient_wire_bytes").get<double>(), 4.0);
  EXPECT_EQ(j.at("weight_wire_bytes").get<double>(), 2.0);
  const auto bf16 = last_json_line(run_lesson01({"--plan", "--model", "llama3-70b", "--gpus", "64",
                                                 "--precision", "mixed", "--json"})
                                       .out);
  EXPECT_EQ(bf16.at("precision"), "mixed") << "16-bit gradients on request";
  EXPECT_EQ(bf16.at("gradient_wire_bytes").get<double>(), 2.0);
  const auto accum = last_json_line(run_lesson01({"--plan", "--model", "llama3-70b", "--gpus", "64",
                                                  "--fp32-grad-accum", "--json"})
                                        .out);
  EXPECT_EQ(accum.at("precision"), "mixed") << "--fp32-grad-accum: 16-bit gradients + fp32 buffer";
  EXPECT_TRUE(accum.at("fp32_grad_accum").get<bool>());
  // The ledger alone keeps the textbook 2 + 2 + 12 (BareParamsJson: 16 bytes a parameter).
}

TEST(L01Program, PlanTableAndDoesNotFit) {
  const Result r = run_lesson01({"--plan", "--model", "llama3-70b", "--gpus", "64"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* text : {"ZeRO-3/FSDP", "TP(+SP)", "SP/CP", "Recommended mix", "years"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << " missing:\n" << r.out;
  }
  const Result small = run_lesson01({"--plan", "--model", "llama3-405b", "--gpus", "8"});
  ASSERT_EQ(small.code, 0) << small.err;
  EXPECT_NE(small.out.find("does NOT fit on this cluster: needs"), std::string::npos) << small.out;
}

TEST(L01ProgramGiven, PlanBadInputExitsWithTwoAndNamesTheFlag) {
  const std::vector<::dtc::test::BadInput> cases = {
      {{"--plan", "--model", "llama-7b", "--cluster", "tpu-v5"}, "--cluster"},
      {{"--plan", "--model", "llama-7b", "--gpus", "12"}, "--gpus"},
      {{"--plan", "--model", "llama-7b", "--gpus", "16", "--inter-bw", "0"}, "--inter-bw"},
      {{"--plan", "--model", "llama-7b", "--intra-bw", "0"}, "--intra-bw"},
      {{"--plan", "--model", "llama-7b", "--gpus-per-node", "0"}, "--gpus-per-node"},
      {{"--plan", "--model", "llama-7b", "--global-batch", "-4"}, "--global-batch"},
      {{"--plan", "--params", "7e9"}, "--plan"},
      {{"--plan", "--model", "llama-7b", "--tokens", "lots"}, "--tokens"},
      {{"--plan", "--model", "llama-7b", "--compare", "8x1x1"}, "--compare"},
      {{"--plan", "--model", "llama-7b", "--compare", "4x1x1x1"}, "--compare"},  // 8 GPUs
      {{"--plan", "--model", "llama-7b", "--compare", "1x3x1x1"}, "--compare"},
      {{"--plan", "--model", "llama-7b", "--compare", "8x1x1x1:4"}, "--compare"},
      {{"--plan", "--model", "llama-7b", "--compare", "8x1x1x1:hsdp3"}, "--compare"},
      {{"--plan", "--model", "llama-7b", "--compare", "8x1x1x1:1:none:0"}, "--compare"},
      {{"--plan", "--model", "llama-7b", "--compare", "4x1x2x1:1:none:1:3"}, "--compare"},
      {{"--plan", "--model", "llama-7b", "--max-micro-batch", "0"}, "--max-micro-batch"},
      {{"--model", "llama-7b", "--compare", "8x1x1x1"}, "--compare"},  // needs --plan
  };
  expect_usage_errors(cases);
}

TEST(L01Program, RunnerUpAndAComparedLayout) {
  // Llama 3 405B's published layout (Llama 3 paper, Table 4: tp 8, cp 1, pp 16, dp 128 on
  // 16,384 H100s, 8K sequences, 16M-token batches), costed by the same model as the plan.
  const Result r = run_lesson01({"--plan", "--model", "llama3-405b", "--cluster", "dgx-h100",
                                 "--gpus", "16384", "--seq", "8192", "--global-batch", "2048",
                                 "--compare", "128x8x16x1:1:none:1:8", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json_line(r.out);
  const auto& cmp = j.at("compare");
  EXPECT_EQ(cmp.at("dp").get<int64_t>(), 128);
  EXPECT_EQ(cmp.at("tp").get<int64_t>(), 8);
  EXPECT_EQ(cmp.at("pp").get<int64_t>(), 16);
  EXPECT_EQ(cmp.at("recompute").get<std::string>(), "none");
  EXPECT_EQ(cmp.at("micro_batch").get<int64_t>(), 1);
  EXPECT_EQ(cmp.at("virtual_stages").get<int64_t>(), 8);
  // Closed form of the interleaved bubble: (pp - 1) / (v m), m = 2048 / 128 = 16.
  EXPECT_DOUBLE_EQ(cmp.at("bubble").get<double>(), 15.0 / (8 * 16.0));
  // The runner-up is another layout that fits, costed the same way.
  const auto& up = j.at("runner_up");
  ASSERT_FALSE(up.is_null());
  EXPECT_TRUE(up.at("fits").get<bool>());
  const auto& plan = j.at("plan");
  EXPECT_FALSE(up.at("dp") == plan.at("dp") && up.at("tp") == plan.at("tp") &&
               up.at("pp") == plan.at("pp") && up.at("cp") == plan.at("cp"))
      << "the runner-up must be another layout";
  EXPECT_LE(up.at("per_gpu_bytes").get<double>(), 0.9 * 80e9);
}

// The plan's "mix" is --compare's grammar, every field written: fed back to --compare it costs
// the very mix the planner picked (the same layout, bytes and step time), for a plain pick and
// for an HSDP one. Lesson 11's --mix takes the same string.
TEST(L01Program, ThePlansMixIsACompareOfTheSameMix) {
  const std::vector<std::vector<std::string>> plans = {
      {"--plan", "--model", "llama3-405b", "--cluster", "dgx-h100", "--gpus", "16384", "--seq",
       "8192", "--global-batch", "2048"},
      {"--plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64"},
      {"--plan", "--model", "llama-7b", "--cluster", "dgx-h100", "--gpus", "8"}};
  for (const auto& args : plans) {
    SCOPED_TRACE(args[2]);
    std::vector<std::string> first = args;
    first.push_back("--json");
    const Result r = run_lesson01(first);
    ASSERT_EQ(r.code, 0) << r.err;
    const auto plan = last_json_line(r.out).at("plan");
    const std::string mix = plan.at("mix").get<std::string>();
    const std::string zero = plan.at("shard").get<int64_t>() > 0
                                 ? "hsdp" + std::to_string(plan.at("shard").get<int64_t>())
                                 : std::to_string(plan.at("zero_stage").get<int>());
    EXPECT_EQ(mix, fmt::format("{}x{}x{}x{}:{}:{}:{}:{}", plan.at("dp").get<int64_t>(),
                               plan.at("tp").get<int64_t>(), plan.at("pp").get<int64_t>(),
                               plan.at("cp").get<int64_t>(), zero,
                               plan.at("recompute").get<std::string>(),
                               plan.at("micro_batch").get<int64_t>(),
                               plan.at("virtual_stages").get<int64_t>()));
    std::vector<std::string> again = first;
    again.push_back("--compare");
    again.push_back(mix);
    const Result c = run_lesson01(again);
    ASSERT_EQ(c.code, 0) << c.err;
    const auto cmp = last_json_line(c.out).at("compare");
    EXPECT_EQ(cmp.at("mix").get<std::string>(), mix);
    EXPECT_EQ(cmp.at("per_gpu_bytes"), plan.at("per_gpu_bytes"));
    EXPECT_EQ(cmp.at("step_time_s"), plan.at("step_time_s"));
    EXPECT_EQ(cmp.at("bubble"), plan.at("bubble"));
  }
  // HSDP and recomputation written back as they were given.
  const std::string hsdp = "4x1x2x1:hsdp2:full:2:1";
  const Result h = run_lesson01({"--plan", "--model", "llama-7b", "--cluster", "dgx-h100", "--gpus",
                                 "8", "--compare", hsdp, "--json"});
  ASSERT_EQ(h.code, 0) << h.err;
  EXPECT_EQ(last_json_line(h.out).at("compare").at("mix").get<std::string>(), hsdp);
}

TEST(L01ProgramGiven, BadInputExitsWithTwoAndNamesTheFlag) {
  const std::vector<::dtc::test::BadInput> cases = {
      {{"--model", "gpt5"}, "--model"},
      {{"--model", "llama-7b", "--tp", "3"}, "--tp"},
      {{"--params", "7e9", "--zero", "4"}, "--zero"},
      {{"--model", "llama-7b", "--pp", "64"}, "--pp"},
      {{"--params", "0"}, "--params"},
      {{"--params", "-7e9"}, "--params"},
      {{"--params", "seven"}, "--params"},
      {{"--arch", "llama", "--hidden", "100", "--layers", "2", "--heads", "3", "--ffn", "64",
        "--vocab", "10"},
       "--heads"},
      {{"--arch", "gpt", "--hidden", "0", "--layers", "2", "--heads", "2", "--ffn", "64", "--vocab",
        "10", "--ctx", "8"},
       "--hidden"},
      {{"--model", "llama-7b", "--params", "7e9"}, "--params"},
      {{"--optimizer", "lion"}, "--optimizer"},
      {{"--mfu", "1.5"}, "--mfu"},
      {{"--model", "llama-7b", "--dp", "2", "--ep", "2"}, "--ep"},      // dense: no experts
      {{"--model", "mixtral-8x7b", "--dp", "3", "--ep", "3"}, "--ep"},  // 8 experts over 3
      {{"--model", "mixtral-8x7b", "--dp", "2", "--ep", "4"}, "--ep"},  // ep divides dp
      {{"--model", "mixtral-8x7b", "--ep", "0"}, "--ep"},
      {{"--params", "7e9", "--dp", "2", "--ep", "2"}, "--ep"},
      {{"--plan", "--model", "mixtral-8x7b", "--ep", "3"}, "--ep"},  // 8 experts over 3
      {{"--plan", "--model", "llama-7b", "--ep", "2"}, "--ep"},
      {{"--plan", "--model", "mixtral-8x7b", "--gpus", "8", "--ep", "16"}, "--ep"},
      {{"--plan", "--model", "mixtral-8x7b", "--gpus", "16", "--ep", "8", "--compare", "2x8x1x1"},
       "--compare"},  // dp 2: ep 8 does not fold over it
      {{"--arch", "llama", "--hidden", "64", "--layers", "2", "--heads", "4", "--ffn", "128",
        "--vocab", "10", "--top-k", "2"},
       "--experts"},
      {{"--arch", "llama", "--hidden", "64", "--layers", "2", "--heads", "4", "--ffn", "128",
        "--vocab", "10", "--experts", "4", "--top-k", "5"},
       "--top-k"},
  };
  expect_usage_errors(cases);
}

TEST(L01ProgramGiven, HelpExitsZero) {
  const Result r = run_lesson01({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.err.find("--model"), std::string::npos);
}

}  // namespace
}  // namespace dtc::l01

// Lesson 08 tests of the code the lesson gives in full: the tp checks, slicing, the dp x tp grid
// (Megatron-LM's layout, as in lesson 03) and the communication volume (closed form).
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "dtc/compare.h"
#include "dtc/errors.h"
#include "dtc_test.h"
#include "program.h"
#include "program_run.h"
#include "tensor_parallel.h"

namespace dtc::l08 {
namespace {

GptConfig tiny() {
  GptConfig m;
  m.hidden = 64;
  m.heads = 4;
  m.ctx = 16;
  m.layers = 1;
  return m;
}

std::string usage_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "no UsageError";
}

TEST(L08CheckGiven, TpMustDivideHeadsAndHiddenNotTheVocabulary) {
  EXPECT_NO_THROW(validate_tp(tiny(), 1));
  EXPECT_NO_THROW(validate_tp(tiny(), 2));
  EXPECT_NO_THROW(validate_tp(tiny(), 4));
  // hidden 64 is not split 3 ways
  EXPECT_NE(usage_message([] { validate_tp(tiny(), 3); }).find("hidden"), std::string::npos);
  // 2 heads, tp 4: hidden 64 splits, the heads do not
  GptConfig two_heads = tiny();
  two_heads.heads = 2;
  const std::string heads = usage_message([&] { validate_tp(two_heads, 4); });
  EXPECT_NE(heads.find("--tp"), std::string::npos) << heads;
  EXPECT_NE(heads.find("heads"), std::string::npos) << heads;
  EXPECT_NE(heads.find("1, 2"), std::string::npos) << "the hint lists the tp that fit: " << heads;
  // vocabulary 250, tp 4: padded to 252, not refused; GPT-2's 50,257 on 2, 4 and 8 ranks
  GptConfig odd_vocab = tiny();
  odd_vocab.vocab = 250;
  EXPECT_NO_THROW(validate_tp(odd_vocab, 4));
  EXPECT_EQ(padded_vocab(250, 4), 252);
  EXPECT_EQ(padded_vocab(50257, 2), 50258);
  EXPECT_EQ(padded_vocab(50257, 4), 50260);
  EXPECT_EQ(padded_vocab(50257, 8), 50264);
  EXPECT_EQ(padded_vocab(256, 4), 256);
  const torch::Tensor rows = torch::arange(10, torch::kFloat).view({5, 2});  // 5 rows, 3 ranks
  EXPECT_TRUE(torch::equal(shard_padded_rows(rows, 2, 3),
                           torch::cat({rows.narrow(0, 4, 1), torch::zeros({1, 2})})))
      << "the last rank: its real row, then a zero row of padding";
  EXPECT_TRUE(torch::equal(shard_padded_rows(rows, 1, 3), rows.narrow(0, 2, 2)));
  EXPECT_NE(usage_message([] { validate_tp(tiny(), 0); }).find("--tp"), std::string::npos);
}

TEST(L08CheckGiven, ShardTakesEqualSlices) {
  const torch::Tensor t = torch::arange(12, torch::kFloat).view({3, 4});
  EXPECT_TENSOR_CLOSE(shard(t, 1, 1, 2),
                      torch::tensor({2.f, 3.f, 6.f, 7.f, 10.f, 11.f}).view({3, 2}), kExact);
  EXPECT_TENSOR_CLOSE(shard(t, 0, 2, 3), torch::tensor({8.f, 9.f, 10.f, 11.f}).view({1, 4}),
                      kExact);
  EXPECT_THROW(shard(t, 1, 0, 3), std::invalid_argument);
}

// Megatron-LM's order (megatron/core/parallel_state.py): tp fastest. 4 ranks, dp 2 x tp 2:
// TP groups [0,1] [2,3], DP groups [0,2] [1,3].
TEST(L08GridGiven, MegatronOrderOnFourRanks) {
  const Mesh g = make_mesh(4, 2, 2);
  const std::vector<std::vector<int>> tp = {{0, 1}, {0, 1}, {2, 3}, {2, 3}};
  const std::vector<std::vector<int>> dp = {{0, 2}, {1, 3}, {0, 2}, {1, 3}};
  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE(rank);
    EXPECT_EQ(g.group(rank, {"tp"}), tp[static_cast<size_t>(rank)]);
    EXPECT_EQ(g.group(rank, {"dp_replicate"}), dp[static_cast<size_t>(rank)]);
    EXPECT_EQ(g.coord(rank, "tp"), rank % 2) << "rank = tp_rank + tp * dp_rank";
    EXPECT_EQ(g.coord(rank, "dp_replicate"), rank / 2);
  }
}

TEST(L08GridGiven, DefaultsAndErrors) {
  const Mesh all_tp = make_mesh(4, 0, 0);
  EXPECT_EQ(all_tp.size("tp"), 4);
  EXPECT_EQ(all_tp.size("dp_replicate"), 1);
  EXPECT_EQ(make_mesh(4, 2, 0).size("tp"), 2);
  EXPECT_EQ(make_mesh(8, 0, 2).size("dp_replicate"), 4);
  EXPECT_THROW(make_mesh(4, 3, 0), UsageError);
  EXPECT_THROW(make_mesh(4, 2, 4), UsageError);
  EXPECT_THROW(make_mesh(4, 0, -1), UsageError);
}

// Closed form (Korthikanti et al. 2022, arXiv:2205.05198, section 4.2.1: tensor parallelism does
// 4 allreduces of b*s*h per layer, 2 forward and 2 backward). GPT-3 175B layer (Brown et al.
// 2020, Table 2.1): h = 12288, s = 2048; b = 1, bf16 (2 bytes), tp = 8.
TEST(L08VolumeGiven, GptThreeLayerInClosedForm) {
  const CommVolume v = tp_comm_volume(1, 2048, 12288, 8, 2);
  EXPECT_EQ(v.allreduces, 4);
  EXPECT_EQ(v.bytes_each, 1LL * 2048 * 12288 * 2);  // 50,331,648 B
  EXPECT_EQ(v.bytes_per_layer, 4LL * 50331648);
  EXPECT_CLOSE_REL(v.wire_bytes_per_rank, 4.0 * 50331648 * 2 * 7 / 8, 1e-12,
                   "closed form: ring allreduce sends 2(n-1)/n of the data (nccl-tests busbw)");
  EXPECT_CLOSE_REL(v.nvlink_s, 352321536.0 / 450e9, 1e-12,
                   "closed form: NVLink 4, 900 GB/s both ways = 450 GB/s each way");
  EXPECT_CLOSE_REL(v.infiniband_s, 352321536.0 / 50e9, 1e-12,
                   "closed form: InfiniBand NDR 400 Gb/s = 50 GB/s");
}

TEST(L08ProgramGiven, BadInputExitsTwoNamingTheFlag) {
  // No launcher in the test's environment: one rank, so --tp 2 cannot fit.
  ::dtc::test::clear_launch_env();
  const std::vector<::dtc::test::BadInput> cases = {{{"--tp", "2", "--steps", "1"}, "--tp"},
                                                    {{"--dp", "2", "--steps", "1"}, "--dp"},
                                                    {{"--tp", "0"}, "--tp"},
                                                    {{"--dp", "-1"}, "--dp"},
                                                    {{"--heads", "3"}, "--heads"},
                                                    {{"--global-batch", "0"}, "--global-batch"},
                                                    {{"--steps", "0"}, "--steps"},
                                                    {{"--timeout-s", "0"}, "--timeout-s"},
                                                    {{"--backend", "mpi"}, "--backend"},
                                                    {{"--precision", "fp16"}, "--precision"}};
  ::dtc::test::expect_usage_errors("lesson08", cases, run_program);
}

TEST(L08ProgramGiven, AGridThatDoesNotFitNamesTheWorldSizeAndWhatToLaunch) {
  ::dtc::test::clear_launch_env();
  const auto r =
      ::dtc::test::run_in_process("lesson08", {"--tp", "2", "--steps", "1"}, run_program);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--tp 2 needs a multiple of 2 ranks, but this run has 1"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("--nproc_per_node 2"), std::string::npos) << r.err;
}

TEST(L08ProgramGiven, HelpExitsZero) {
  const char* argv[] = {"lesson08", "--help"};
  std::ostringstream out, err;
  EXPECT_EQ(run_program(2, argv, out, err), 0);
}

}  // namespace
}  // namespace dtc::l08

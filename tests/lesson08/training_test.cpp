// Lesson 08 tests, part 3: whole training runs. tp = 2 and tp = 4, and dp = 2 x tp = 2 on 4
// thread-ranks, against (a) the single-process baseline, trained right here with plain LibTorch
// (the course's GPT, AdamW, the same weights and batches), and (b) PyTorch's own run of the same
// model, tests/reference/lesson02_reference.json (tests/reference/lesson02_reference.py).
// Several fp32 steps with reordered sums: kFp32Steps against the baseline, kFp32VsPyTorch
// against PyTorch.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <mutex>

#include "dtc/compare.h"
#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/digest.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "plain_baseline.h"
#include "program.h"

namespace dtc::l08 {
namespace {

using test::kTimeout;

// Trains on world thread-ranks as dp x tp; every rank's losses must match.
// With @p vocab > 0 the model's vocabulary is that instead (no PyTorch reference then: the
// baseline only).
void expect_matches(const std::string& ref_name, int dp, int tp, int64_t vocab = 0,
                    bool overlap_dgrad = false) {
  const test::ReferenceCase ref = test::reference_case(ref_name);
  TrainConfig c = ref.config;
  if (vocab > 0) c.model.vocab = vocab;
  const std::vector<float>& pytorch = ref.losses;
  const auto steps = static_cast<int64_t>(pytorch.size());
  // The single-process baseline (lesson 02's training step), in plain LibTorch.
  const test::BaselineRun base = test::plain_baseline(c, steps);
  const auto& baseline = base.losses;
  const Grid grid = make_grid(dp * tp, dp, tp);
  std::mutex mu;
  std::vector<std::vector<float>> got(static_cast<size_t>(grid.world));
  nlohmann::json digest;  // the TP model's parameters, shards summed over the grid (rank 0's)
  run_ranks(
      grid.world,
      [&](RankContext& ctx) {
        const Groups g = make_groups(ctx.store, grid, ctx.rank, BackendKind::kGloo, kTimeout);
        nlohmann::json d;
        auto losses = train_tp(c, *g.tp, *g.dp, steps, torch::kCPU, {}, &d, overlap_dgrad);
        std::lock_guard<std::mutex> lock(mu);
        got[static_cast<size_t>(ctx.rank)] = losses;
        if (ctx.rank == 0) digest = d;
      },
      kTimeout);
  // Parameters, not only losses: each full parameter's sum of squares and sum against the
  // baseline's after the same steps (dtc/digest.h), within kFp32Steps' rtol (the sum against
  // its own scale, sqrt(numel x sumsq)).
  std::vector<std::string> names;
  std::vector<NamedPiece> pieces;
  size_t k = 0;
  for (const auto& item : Gpt(c.model)->named_parameters()) {
    names.push_back(item.key());
    pieces.emplace_back(item.key(), base.params[k++]);
  }
  const nlohmann::json want = param_digest(names, pieces);
  ASSERT_EQ(digest.size(), want.size()) << "param_digest of the TP model: every parameter";
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& a = digest[i];
    const auto& b = want[i];
    SCOPED_TRACE(b["name"].get<std::string>());
    EXPECT_EQ(a["numel"], b["numel"]);
    const double sumsq = b["sumsq"].get<double>();
    const double scale = std::sqrt(b["numel"].get<double>() * sumsq);
    EXPECT_NEAR(a["sumsq"].get<double>(), sumsq, kFp32Steps.rtol * sumsq + kFp32Steps.atol);
    EXPECT_NEAR(a["sum"].get<double>(), b["sum"].get<double>(),
                kFp32Steps.rtol * scale + kFp32Steps.atol);
  }
  for (int r = 0; r < grid.world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_EQ(got[static_cast<size_t>(r)].size(), pytorch.size());
    EXPECT_TENSOR_CLOSE(torch::tensor(got[static_cast<size_t>(r)]), torch::tensor(baseline),
                        kFp32Steps);
    if (vocab == 0) {
      EXPECT_TENSOR_CLOSE(torch::tensor(got[static_cast<size_t>(r)]), torch::tensor(pytorch),
                          kFp32VsPyTorch);
    }
  }
}

TEST(L08Training, TpTwoMatchesBaselineAndPyTorch) { expect_matches("tiny_tied", 1, 2); }
TEST(L08Training, TpFourMatchesBaselineAndPyTorch) { expect_matches("tiny_tied", 1, 4); }
TEST(L08Training, UntiedTpTwoMatchesBaselineAndPyTorch) { expect_matches("tiny_untied", 1, 2); }
TEST(L08Training, DpTwoByTpTwoMatchesBaselineAndPyTorch) { expect_matches("tiny_tied", 2, 2); }
// The overlapped backward (the input gradient's allreduce started before the weight gradient is
// computed) trains the same parameters and losses, and PyTorch's.
TEST(L08Training, OverlappedDgradMatchesBaselineAndPyTorch) {
  expect_matches("tiny_tied", 1, 2, 0, /*overlap_dgrad=*/true);
  expect_matches("tiny_untied", 2, 2, 0, /*overlap_dgrad=*/true);
}

// A vocabulary of 257, which neither 2 nor 4 divides: padded, trained, the baseline's
// parameters (the padding rows stay out of the digest), tied and untied.
TEST(L08Training, PaddedVocabularyMatchesBaseline) {
  expect_matches("tiny_tied", 1, 4, 257);
  expect_matches("tiny_untied", 1, 2, 257);
}

}  // namespace
}  // namespace dtc::l08

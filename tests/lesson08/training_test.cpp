// Lesson 08 tests, part 3: whole training runs. tp = 2 and tp = 4, and dp = 2 x tp = 2 on 4
// thread-ranks, against (a) the single-process baseline, trained right here with plain LibTorch
// (the course's GPT, AdamW, the same weights and batches), and (b) PyTorch's own run of the same
// model, tests/reference/lesson02_reference.json (tests/reference/lesson02_reference.py).
// Several fp32 steps with reordered sums: kFp32Steps against the baseline, kFp32VsPyTorch
// against PyTorch.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <mutex>

#include "dtc/compare.h"
#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "program.h"

namespace dtc::l08 {
namespace {

constexpr std::chrono::milliseconds kTimeout{3000};

const nlohmann::json& reference_case(const std::string& name) {
  static const nlohmann::json j = [] {
    std::ifstream in(source_path("tests/reference/lesson02_reference.json"));
    return nlohmann::json::parse(in);
  }();
  return j.at("cases").at(name);
}

TrainConfig config_of(const nlohmann::json& c) {
  const auto& j = c.at("config");
  TrainConfig t;
  t.model.vocab = j.at("vocab");
  t.model.ctx = j.at("ctx");
  t.model.hidden = j.at("hidden");
  t.model.layers = j.at("layers");
  t.model.heads = j.at("heads");
  t.model.tied = j.at("tied");
  t.seed = j.at("seed");
  t.batch = j.at("batch");
  t.lr = j.at("lr");
  t.beta1 = j.at("betas")[0];
  t.beta2 = j.at("betas")[1];
  t.eps = j.at("eps");
  t.weight_decay = j.at("weight_decay");
  return t;
}

// The single-process baseline (lesson 02's training step), in plain LibTorch.
std::vector<float> baseline_losses(const TrainConfig& c, int64_t steps) {
  Gpt model(c.model);
  init_weights(model, c.seed);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(c.lr)
                                                   .betas({c.beta1, c.beta2})
                                                   .eps(c.eps)
                                                   .weight_decay(c.weight_decay));
  const ByteDataset data = ByteDataset::builtin();
  std::vector<float> losses;
  for (int64_t step = 0; step < steps; ++step) {
    const Batch b = data.batch(c.seed, step, c.batch, c.model.ctx);
    zero_grad_to_none(opt);
    auto logits = model(b.inputs);
    auto loss = torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}),
                                                     b.targets.view({-1}));
    loss.backward();
    opt.step();
    losses.push_back(loss.item<float>());
  }
  return losses;
}

// Trains on world thread-ranks as dp x tp; every rank's losses must match.
void expect_matches(const std::string& ref_name, int dp, int tp) {
  const auto& ref = reference_case(ref_name);
  const TrainConfig c = config_of(ref);
  const auto pytorch = ref.at("losses").get<std::vector<float>>();
  const auto steps = static_cast<int64_t>(pytorch.size());
  const auto baseline = baseline_losses(c, steps);
  const Grid grid = make_grid(dp * tp, dp, tp);
  std::mutex mu;
  std::vector<std::vector<float>> got(static_cast<size_t>(grid.world));
  run_ranks(
      grid.world,
      [&](RankContext& ctx) {
        const Groups g = make_groups(ctx.store, grid, ctx.rank, BackendKind::kGloo, kTimeout);
        auto losses = train_tp(c, *g.tp, *g.dp, steps);
        std::lock_guard<std::mutex> lock(mu);
        got[static_cast<size_t>(ctx.rank)] = losses;
      },
      kTimeout);
  for (int r = 0; r < grid.world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_EQ(got[static_cast<size_t>(r)].size(), pytorch.size());
    EXPECT_TENSOR_CLOSE(torch::tensor(got[static_cast<size_t>(r)]), torch::tensor(baseline),
                        kFp32Steps);
    EXPECT_TENSOR_CLOSE(torch::tensor(got[static_cast<size_t>(r)]), torch::tensor(pytorch),
                        kFp32VsPyTorch);
  }
}

TEST(L08Training, TpTwoMatchesBaselineAndPyTorch) { expect_matches("tiny_tied", 1, 2); }
TEST(L08Training, TpFourMatchesBaselineAndPyTorch) { expect_matches("tiny_tied", 1, 4); }
TEST(L08Training, UntiedTpTwoMatchesBaselineAndPyTorch) { expect_matches("tiny_untied", 1, 2); }
TEST(L08Training, DpTwoByTpTwoMatchesBaselineAndPyTorch) { expect_matches("tiny_tied", 2, 2); }

}  // namespace
}  // namespace dtc::l08

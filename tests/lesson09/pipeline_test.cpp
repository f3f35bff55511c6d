// Lesson 09 tests: the stage split on real modules, send/recv, and pipelined training on thread-
// ranks against the single-process baseline, computed here with plain LibTorch (the course's
// GPT, untied, the same AdamW and the same batches as lesson 02), never by the code under test.
// Tolerance: dtc::kFp32Steps (the sum of m scaled micro-batch gradients differs from the full
// batch's gradient only by the order of fp32 additions, compounded over a few steps).
#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "dtc/compare.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "pipeline.h"
#include "plain_baseline.h"
#include "program.h"

namespace dtc::l09 {
namespace {

constexpr std::chrono::milliseconds kTimeout{5000};

// A small model so that a few steps on 4 thread-ranks take well under a second.
PipelineOptions small_run(ScheduleKind schedule, int64_t micro_batches) {
  PipelineOptions o;
  o.model.layers = 4;
  o.model.hidden = 32;
  o.model.heads = 2;
  o.model.ctx = 16;
  o.model.tied = false;
  o.batch = 8;
  o.steps = 3;
  o.micro_batches = micro_batches;
  o.schedule = schedule;
  o.sweep.clear();
  return o;
}

// The single-process baseline: whole batch, one model, one AdamW (lesson 02's hyperparameters;
// tests/support/plain_baseline.h).
std::vector<float> baseline_losses(const PipelineOptions& o) {
  test::AdamWHyper adamw;
  adamw.lr = o.lr;
  return test::plain_baseline(o.model, o.seed, o.batch, o.steps, adamw).losses;
}

std::vector<float> pipeline_losses(const PipelineOptions& o, int stages) {
  std::vector<float> losses;
  run_ranks(
      stages,
      [&](RankContext& ctx) {
        auto got = train_pipeline(o, *ctx.comm);
        if (ctx.rank == 0) losses = got;
      },
      kTimeout);
  return losses;
}

void expect_baseline(ScheduleKind schedule, int stages, int64_t micro_batches) {
  const PipelineOptions o = small_run(schedule, micro_batches);
  const auto expected = baseline_losses(o);
  const auto got = pipeline_losses(o, stages);
  ASSERT_EQ(got.size(), expected.size());
  EXPECT_TENSOR_CLOSE(torch::tensor(got), torch::tensor(expected), kFp32Steps);
}

TEST(L09Pipeline, GpipeTwoStagesMatchesBaseline) { expect_baseline(ScheduleKind::kGpipe, 2, 4); }
TEST(L09Pipeline, GpipeFourStagesMatchesBaseline) { expect_baseline(ScheduleKind::kGpipe, 4, 4); }
TEST(L09Pipeline, OneFOneBTwoStagesMatchesBaseline) { expect_baseline(ScheduleKind::k1f1b, 2, 4); }
TEST(L09Pipeline, OneFOneBFourStagesMatchesBaseline) { expect_baseline(ScheduleKind::k1f1b, 4, 8); }
// m = 1: no overlap at all, the pipeline is a model split over ranks.
TEST(L09Pipeline, OneMicroBatchMatchesBaseline) { expect_baseline(ScheduleKind::k1f1b, 2, 1); }

// make_stage keeps the full model's own modules: the same tensors, the model's order.
TEST(L09Split, StagesShareTheFullModelsWeights) {
  GptConfig c;
  c.layers = 5;
  c.hidden = 32;
  c.heads = 2;
  c.ctx = 16;
  c.tied = false;
  Gpt full(c);
  init_weights(full, 1);
  const auto all = full->parameters();
  std::vector<torch::Tensor> joined;
  for (int s = 0; s < 2; ++s) {
    Stage stage = make_stage(full, 2, s);
    EXPECT_EQ(static_cast<int64_t>(stage.blocks.size()), s == 0 ? 3 : 2);  // 5 = 3 + 2
    for (const auto& p : stage.parameters()) joined.push_back(p);
  }
  ASSERT_EQ(joined.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_TRUE(joined[i].is_same(all[i])) << "parameter " << i << " is not the model's own";
  }
  // The stages chained give the full model's logits.
  const Batch b = ByteDataset::builtin().batch(1, 0, 2, 16);
  auto x = make_stage(full, 2, 0).forward(b.inputs);
  x = make_stage(full, 2, 1).forward(x);
  EXPECT_TENSOR_CLOSE(x, full->forward(b.inputs), kExact);
}

TEST(L09P2p, SendAndRecvMoveActivationsBothWays) {
  run_ranks(
      2,
      [](RankContext& ctx) {
        const auto act = torch::arange(24, torch::kFloat).reshape({2, 3, 4});
        if (ctx.rank == 0) {
          send_tensor(*ctx.comm, act, 1, activation_tag(5))->wait();
          auto g = recv_tensor(*ctx.comm, {2, 3, 4}, 1, gradient_tag(5));
          EXPECT_TENSOR_CLOSE(g, -act, kExact);
        } else {
          auto a = recv_tensor(*ctx.comm, {2, 3, 4}, 0, activation_tag(5));
          EXPECT_TENSOR_CLOSE(a, act, kExact);
          send_tensor(*ctx.comm, -a, 0, gradient_tag(5))->wait();
        }
      },
      kTimeout);
}

}  // namespace
}  // namespace dtc::l09

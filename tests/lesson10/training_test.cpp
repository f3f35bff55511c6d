// Lesson 10 tests, part 2: whole training runs. Each attention, contiguous and zig-zag, on cp 2
// and 4 thread-ranks (and dp 2 x cp 2), against (a) the single-process baseline trained right
// here with plain LibTorch (the course's GPT, AdamW, the same weights and batches), on the
// PARAMETERS after several steps, and (b) PyTorch's own losses of the same runs
// (tests/reference/lesson02_reference.json). Several fp32 steps with reordered sums: kFp32Steps.
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "dtc/compare.h"
#include "dtc/errors.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "plain_baseline.h"
#include "program.h"

namespace dtc::l10 {
namespace {

using test::kTimeout;

// The course's attention core and masked_attention on positions 0..T-1 are the same function:
// what lets part 1's tests stand for the model's attention.
TEST(L10ModelGiven, MaskedAttentionIsTheModelsAttentionCore) {
  torch::manual_seed(3);
  const auto q = torch::randn({2, 4, 16, 8}), k = torch::randn({2, 4, 16, 8}),
             v = torch::randn({2, 4, 16, 8});
  const auto pos = torch::arange(16);
  const auto want = CausalSelfAttentionImpl::core(q, k, v);  // (B, T, H D)
  const auto got = masked_attention(q, k, v, pos, pos, true).transpose(1, 2).reshape({2, 16, 32});
  EXPECT_TENSOR_CLOSE(got, want, kExact);
}

// Several fp32 steps of AdamW, compared element by element. A few elements have gradients near
// AdamW's eps (1e-8): rows of bytes the corpus hardly holds, and the key bias, whose exact
// gradient is 0 (it adds q.b_k to every score of a row, which the softmax cancels). There the
// update lr g / (|g| + eps) turns the rounding of a reordered softmax (blocks merged by
// log-sum-exp, keys gathered in another order) into differences up to 7.3e-5 after 8 steps
// (measured, every case below). atol 2e-4 is 1/15 of one step's largest update (lr 3e-3): a
// missing block, a wrong mask or a wrong merge moves the weights by about lr per step. A wrong
// gradient SCALE leaves AdamW's update unchanged: GradientsOfOneStep* checks the gradients.
constexpr Tolerance kCpSteps{1e-4, 2e-4, "fp32, several AdamW steps, near-eps gradients"};

struct Case {
  int dp, cp;
  Attention attention;
  bool zigzag;
};

std::string name(const Case& c) {
  return std::string(attention_name(c.attention)) + (c.zigzag ? " zig-zag" : "") + ", dp " +
         std::to_string(c.dp) + " x cp " + std::to_string(c.cp);
}

// Trains on dp x cp thread-ranks; every rank's weights must be the baseline's.
void expect_matches_baseline(const std::string& ref_name, const Case& k, int64_t steps = 0) {
  const test::ReferenceCase ref = test::reference_case(ref_name);
  CpConfig c;
  c.run = ref.config;
  c.attention = k.attention;
  c.zigzag = k.zigzag;
  if (steps == 0) steps = static_cast<int64_t>(ref.losses.size());
  const test::BaselineRun base = test::plain_baseline(c.run, steps);
  const Mesh mesh = make_mesh(k.dp * k.cp, k.dp, k.cp);
  std::mutex mu;
  std::vector<std::vector<float>> losses(static_cast<size_t>(mesh.world()));
  std::vector<std::vector<torch::Tensor>> weights(static_cast<size_t>(mesh.world()));
  run_ranks(
      mesh.world(),
      [&](RankContext& ctx) {
        auto cp =
            new_subgroup(ctx.store, mesh.group_name(ctx.rank, {"cp"}), mesh.group(ctx.rank, {"cp"}),
                         ctx.rank, BackendKind::kGloo, kTimeout);
        std::vector<torch::Tensor> w;
        CpRunOptions run;
        run.steps = steps;
        run.weights = true;
        CpRunResult r = train_cp(c, *cp, *ctx.comm, /*tp=*/nullptr, run);
        auto l = r.losses;
        w = std::move(r.weights);
        std::lock_guard<std::mutex> lock(mu);
        losses[static_cast<size_t>(ctx.rank)] = l;
        weights[static_cast<size_t>(ctx.rank)] = w;
      },
      kTimeout);
  SCOPED_TRACE(name(k));
  const auto names = Gpt(c.run.model)->named_parameters().keys();
  for (int r = 0; r < mesh.world(); ++r) {
    const auto& w = weights[static_cast<size_t>(r)];
    ASSERT_EQ(w.size(), base.params.size()) << "rank " << r << ": every parameter";
    for (size_t i = 0; i < w.size(); ++i) {
      SCOPED_TRACE("rank " + std::to_string(r) + ", " + names[i]);
      EXPECT_TENSOR_CLOSE(w[i], base.params[i], kCpSteps);
    }
    EXPECT_TENSOR_CLOSE(torch::tensor(losses[static_cast<size_t>(r)]), torch::tensor(base.losses),
                        kFp32Steps);
  }
  if (steps == static_cast<int64_t>(ref.losses.size())) {
    EXPECT_TENSOR_CLOSE(torch::tensor(losses[0]), torch::tensor(ref.losses), kFp32VsPyTorch);
  }
}

// One step's gradients, summed over the ranks, against the baseline's on the whole batch: the
// scale that AdamW would hide. Each parameter within kFp32Steps' rtol, atol 1e-4 of its largest
// gradient (reordered fp32 sums of B x T tokens).
void expect_gradients_match(const Case& k, int64_t heads = 4) {
  RunConfig run;
  run.model.layers = 2;
  run.model.hidden = 8 * heads;
  run.model.heads = heads;
  run.model.ctx = 24;
  run.model.tied = false;
  run.batch = 4;
  const ByteDataset data = ByteDataset::builtin();
  const Batch batch = data.batch(run.seed, 0, run.batch, run.model.ctx);
  Gpt base = make_gpt(run.model, run.seed);
  auto logits = base->forward(batch.inputs);
  torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                       batch.targets.reshape({-1}))
      .backward();
  std::vector<torch::Tensor> want;
  for (const auto& p : base->parameters()) want.push_back(p.grad());
  const Mesh mesh = make_mesh(k.dp * k.cp, k.dp, k.cp);
  std::mutex mu;
  std::vector<std::vector<torch::Tensor>> got(static_cast<size_t>(mesh.world()));
  run_ranks(
      mesh.world(),
      [&](RankContext& ctx) {
        auto cp =
            new_subgroup(ctx.store, mesh.group_name(ctx.rank, {"cp"}), mesh.group(ctx.rank, {"cp"}),
                         ctx.rank, BackendKind::kGloo, kTimeout);
        Gpt full = make_gpt(run.model, run.seed);
        CpGpt model(full, *cp, k.attention, k.zigzag);
        const int64_t rows = run.batch / k.dp, first = mesh.coord(ctx.rank, "dp_replicate") * rows;
        Batch mine;
        mine.inputs =
            shard_sequence(batch.inputs.narrow(0, first, rows), cp->getRank(), k.cp, k.zigzag);
        mine.targets =
            shard_sequence(batch.targets.narrow(0, first, rows), cp->getRank(), k.cp, k.zigzag);
        model->loss(mine).backward();
        std::vector<torch::Tensor> grads;
        for (const auto& p : full->parameters()) {
          std::vector<torch::Tensor> g{p.grad().clone()};
          ctx.comm->allreduce(g)->wait();
          grads.push_back(g[0] / k.dp);
        }
        std::lock_guard<std::mutex> lock(mu);
        got[static_cast<size_t>(ctx.rank)] = grads;
      },
      kTimeout);
  SCOPED_TRACE(name(k));
  const auto names = base->named_parameters().keys();
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(names[i]);
    const double scale = want[i].abs().max().item<double>();
    const Tolerance tol{kFp32Steps.rtol, 1e-4 * scale, "fp32 gradients, reordered sums"};
    EXPECT_TENSOR_CLOSE(got[0][i], want[i], tol);
  }
}

TEST(L10Training, GradientsOfOneStepAreTheBaselines) {
  expect_gradients_match({1, 2, Attention::kRing, false});
  expect_gradients_match({1, 4, Attention::kRing, true});
  expect_gradients_match({1, 3, Attention::kRing, false}, /*heads=*/3);  // 24 tokens, 8 a rank
  expect_gradients_match({1, 2, Attention::kUlysses, false});
  expect_gradients_match({1, 3, Attention::kAllGather, true}, /*heads=*/3);
  expect_gradients_match({2, 2, Attention::kAllGather, false});
}

TEST(L10Training, RingMatchesTheBaselineParameters) {
  expect_matches_baseline("tiny_tied", {1, 2, Attention::kRing, false});
  expect_matches_baseline("tiny_untied", {1, 4, Attention::kRing, true});
}

TEST(L10Training, UlyssesMatchesTheBaselineParameters) {
  expect_matches_baseline("tiny_tied", {1, 4, Attention::kUlysses, false});
}

TEST(L10Training, AllGatherMatchesTheBaselineParameters) {
  expect_matches_baseline("tiny_untied", {1, 2, Attention::kAllGather, true});
}

TEST(L10Training, DataAndContextParallelTogether) {
  expect_matches_baseline("tiny_untied", {2, 2, Attention::kRing, true});
}

TEST(L10TrainingGiven, RefusesWhatDoesNotSplit) {
  CpConfig c;
  c.run.model.ctx = 30;  // 4 ranks: 30 tokens do not split
  run_ranks(
      4,
      [&](RankContext& ctx) {
        try {
          train_cp(c, *ctx.comm, *ctx.comm, /*tp=*/nullptr, CpRunOptions{});
          ADD_FAILURE() << "30 tokens on cp 4 must be refused";
        } catch (const UsageError& e) {
          EXPECT_EQ(e.subject(), "--seq") << e.what();
        }
      },
      kTimeout);
}

}  // namespace
}  // namespace dtc::l10

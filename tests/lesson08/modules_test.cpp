// Lesson 08 tests, part 2: every tensor-parallel module against the unsplit module on the same
// weights, on 2 and 4 thread-ranks. The reference is LibTorch's own unsplit module (the course's
// GPT, dtc/model.h), run once in the main thread; each rank must produce the full output and the
// slice of every gradient that it owns. One fp32 op whose sums are split by rank: kFp32Op.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "dtc/compare.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "tensor_parallel.h"

namespace dtc::l08 {
namespace {

using test::kTimeout;
namespace F = torch::nn::functional;

// One block of the course's GPT with GPT-2 weights (init_weights), then biases and LayerNorms
// made nonzero so that every parameter's gradient path is exercised.
Gpt make_full() {
  GptConfig m;
  m.hidden = 64;
  m.heads = 4;
  m.ctx = 16;
  m.layers = 1;
  Gpt full(m);
  init_weights(full, 5);
  auto gen = at::detail::createCPUGenerator(11);
  torch::NoGradGuard no_grad;
  for (auto& p : full->named_parameters()) {
    if (p.key().find("bias") != std::string::npos) {
      p.value().copy_(at::randn(p.value().sizes(), gen) * 0.1);
    }
  }
  return full;
}

torch::Tensor randn(at::IntArrayRef sizes, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn(sizes, gen);
}

// Rank r's rows of c_attn's (3h, ...) gradient: slice r of each of the q, k, v blocks.
torch::Tensor qkv_slice(const torch::Tensor& full, int r, int W) {
  auto parts = full.chunk(3, 0);
  return torch::cat({shard(parts[0], 0, r, W), shard(parts[1], 0, r, W), shard(parts[2], 0, r, W)},
                    0);
}

class L08Modules : public ::testing::TestWithParam<int> {};

TEST_P(L08Modules, ColumnAndRowParallelLinear) {
  const int W = GetParam();
  torch::nn::Linear a(64, 96), b(96, 48);
  {
    // Weights at the scale of a trained layer (std 1/sqrt(in)), so that outputs and gradients
    // are O(1) and the fp32 tolerance means what it says.
    torch::NoGradGuard no_grad;
    a->weight.copy_(randn({96, 64}, 1) / 8.0);
    a->bias.copy_(randn({96}, 2) * 0.1);
    b->weight.copy_(randn({48, 96}, 3) / std::sqrt(96.0));
    b->bias.copy_(randn({48}, 4) * 0.1);
  }
  const torch::Tensor x = randn({2, 5, 64}, 5), G = randn({2, 5, 48}, 6);
  // Reference: y = b(a(x)), loss = sum(y * G).
  const torch::Tensor xr = x.clone().requires_grad_();
  const torch::Tensor y_ref = b(a(xr));
  (y_ref * G).sum().backward();
  const torch::Tensor hidden_ref = a(x).detach();
  run_ranks(
      W,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        ColumnParallelLinear col(a, *ctx.comm);
        RowParallelLinear row(b, *ctx.comm);
        const torch::Tensor xl = x.clone().requires_grad_();
        const torch::Tensor hidden = col(xl);  // (2, 5, 96/W)
        EXPECT_TENSOR_CLOSE(hidden.detach(), shard(hidden_ref, 2, r, W), kFp32Op);
        const torch::Tensor y = row(hidden);
        EXPECT_TENSOR_CLOSE(y.detach(), y_ref.detach(), kFp32Op);
        (y * G).sum().backward();
        EXPECT_TENSOR_CLOSE(xl.grad(), xr.grad(), kFp32Op);
        EXPECT_TENSOR_CLOSE(col->weight.grad(), shard(a->weight.grad(), 0, r, W), kFp32Op);
        EXPECT_TENSOR_CLOSE(col->bias.grad(), shard(a->bias.grad(), 0, r, W), kFp32Op);
        EXPECT_TENSOR_CLOSE(row->weight.grad(), shard(b->weight.grad(), 1, r, W), kFp32Op);
        EXPECT_TENSOR_CLOSE(row->bias.grad(), b->bias.grad(), kFp32Op);
      },
      kTimeout);
}

TEST_P(L08Modules, MlpMatchesTheUnsplitMlp) {
  const int W = GetParam();
  Gpt full = make_full();
  Mlp mlp = full->h[0]->as<BlockImpl>()->mlp;
  const torch::Tensor x = randn({2, 16, 64}, 7), G = randn({2, 16, 64}, 8);
  const torch::Tensor xr = x.clone().requires_grad_();
  const torch::Tensor y_ref = mlp(xr);
  (y_ref * G).sum().backward();
  run_ranks(
      W,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        TpMlp tp(mlp, *ctx.comm);
        const torch::Tensor xl = x.clone().requires_grad_();
        const torch::Tensor y = tp(xl);
        EXPECT_TENSOR_CLOSE(y.detach(), y_ref.detach(), kFp32Op);
        (y * G).sum().backward();
        EXPECT_TENSOR_CLOSE(xl.grad(), xr.grad(), kFp32Op);
        EXPECT_TENSOR_CLOSE(tp->c_fc->weight.grad(), shard(mlp->c_fc->weight.grad(), 0, r, W),
                            kFp32Op);
        EXPECT_TENSOR_CLOSE(tp->c_fc->bias.grad(), shard(mlp->c_fc->bias.grad(), 0, r, W), kFp32Op);
        EXPECT_TENSOR_CLOSE(tp->c_proj->weight.grad(), shard(mlp->c_proj->weight.grad(), 1, r, W),
                            kFp32Op);
        EXPECT_TENSOR_CLOSE(tp->c_proj->bias.grad(), mlp->c_proj->bias.grad(), kFp32Op);
      },
      kTimeout);
}

TEST_P(L08Modules, AttentionMatchesTheUnsplitAttention) {
  const int W = GetParam();
  Gpt full = make_full();
  CausalSelfAttention attn = full->h[0]->as<BlockImpl>()->attn;
  const torch::Tensor x = randn({2, 16, 64}, 9), G = randn({2, 16, 64}, 10);
  const torch::Tensor xr = x.clone().requires_grad_();
  const torch::Tensor y_ref = attn(xr);
  (y_ref * G).sum().backward();
  run_ranks(
      W,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        TpAttention tp(attn, 4, *ctx.comm);
        EXPECT_EQ(tp->local_heads, 4 / W);
        EXPECT_TENSOR_CLOSE(tp->c_attn->weight.detach(),
                            qkv_slice(attn->c_attn->weight.detach(), r, W), kExact);
        const torch::Tensor xl = x.clone().requires_grad_();
        const torch::Tensor y = tp(xl);
        EXPECT_TENSOR_CLOSE(y.detach(), y_ref.detach(), kFp32Op);
        (y * G).sum().backward();
        EXPECT_TENSOR_CLOSE(xl.grad(), xr.grad(), kFp32Op);
        EXPECT_TENSOR_CLOSE(tp->c_attn->weight.grad(), qkv_slice(attn->c_attn->weight.grad(), r, W),
                            kFp32Op);
        EXPECT_TENSOR_CLOSE(tp->c_attn->bias.grad(), qkv_slice(attn->c_attn->bias.grad(), r, W),
                            kFp32Op);
        EXPECT_TENSOR_CLOSE(tp->c_proj->weight.grad(), shard(attn->c_proj->weight.grad(), 1, r, W),
                            kFp32Op);
        EXPECT_TENSOR_CLOSE(tp->c_proj->bias.grad(), attn->c_proj->bias.grad(), kFp32Op);
      },
      kTimeout);
}

TEST_P(L08Modules, VocabParallelEmbeddingMatchesTheFullTable) {
  const int W = GetParam();
  Gpt full = make_full();
  torch::nn::Embedding wte = full->wte;
  auto gen = at::detail::createCPUGenerator(12);
  const torch::Tensor tokens = at::randint(0, 256, {3, 16}, gen);
  const torch::Tensor G = randn({3, 16, 64}, 13);
  const torch::Tensor y_ref = wte(tokens);
  (y_ref * G).sum().backward();
  run_ranks(
      W,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        VocabParallelEmbedding tp(wte, *ctx.comm);
        EXPECT_EQ(tp->vocab_begin, r * 256 / W);
        const torch::Tensor y = tp(tokens);
        EXPECT_TENSOR_CLOSE(y.detach(), y_ref.detach(), kFp32Op);
        (y * G).sum().backward();
        EXPECT_TENSOR_CLOSE(tp->weight.grad(), shard(wte->weight.grad(), 0, r, W), kFp32Op);
      },
      kTimeout);
}

TEST_P(L08Modules, VocabParallelCrossEntropyMatchesTheFullOne) {
  const int W = GetParam();
  // Logits with a wide range (x 8), and four rows far past where fp32's exp overflows (88.7):
  // up to about +-1,500, and one row of 1,000 everywhere. Without the max shift, exp gives inf.
  torch::Tensor logits = randn({24, 256}, 14) * 8.0;
  logits.narrow(0, 0, 3).mul_(50.0);
  logits[3].fill_(1000.0);
  auto gen = at::detail::createCPUGenerator(15);
  const torch::Tensor targets = at::randint(0, 256, {24}, gen);
  const torch::Tensor lr = logits.clone().requires_grad_();
  const torch::Tensor loss_ref = F::cross_entropy(lr, targets);
  loss_ref.backward();
  run_ranks(
      W,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        const torch::Tensor local = shard(logits, 1, r, W).requires_grad_();
        const torch::Tensor loss =
            vocab_parallel_cross_entropy(local, targets, r * 256 / W, *ctx.comm);
        ASSERT_EQ(loss.dim(), 0) << "the mean over the N positions: a scalar";
        EXPECT_TENSOR_CLOSE(loss.detach(), loss_ref.detach(), kFp32Op);
        loss.backward();
        ASSERT_TRUE(local.grad().defined()) << "the loss must be differentiable in the logits";
        EXPECT_TENSOR_CLOSE(local.grad(), shard(lr.grad(), 1, r, W), kFp32Op);
      },
      kTimeout);
}

// GPT-2's vocabulary, 50,257 tokens, which no tp of 2, 4 or 8 divides: the embedding and the
// cross-entropy padded to a multiple of tp (padding rows never looked up, padding columns out
// of the softmax) give the unpadded table's rows and the unpadded loss, and the real columns'
// gradients; the padding's gradients are 0.
void expect_padded_vocabulary_matches(int W) {
  SCOPED_TRACE(testing::Message() << W << " ranks");
  const int64_t V = 50257;
  const int64_t Vp = padded_vocab(V, W);
  ASSERT_NE(V % W, 0);
  torch::nn::Embedding wte(V, 8);
  auto gen = at::detail::createCPUGenerator(21);
  const torch::Tensor tokens = at::randint(V - 40, V, {2, 8}, gen);  // the last rank's rows too
  const torch::Tensor G = randn({2, 8, 8}, 22);
  (wte(tokens) * G).sum().backward();
  const torch::Tensor logits = randn({16, V}, 23) * 4.0;
  const torch::Tensor targets = at::randint(V - 40, V, {16}, gen);
  const torch::Tensor lr = logits.clone().requires_grad_();
  const torch::Tensor loss_ref = F::cross_entropy(lr, targets);
  loss_ref.backward();
  const torch::Tensor padded_logits = torch::cat({logits, torch::zeros({16, Vp - V})}, 1);
  const torch::Tensor padded_grad = torch::cat({lr.grad(), torch::zeros({16, Vp - V})}, 1);
  const torch::Tensor padded_wgrad = torch::cat({wte->weight.grad(), torch::zeros({Vp - V, 8})});
  run_ranks(
      W,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        VocabParallelEmbedding tp(wte, *ctx.comm);
        EXPECT_EQ(tp->weight.size(0), Vp / W);
        EXPECT_EQ(tp->vocab_end, std::min<int64_t>((r + 1) * Vp / W, V));
        const torch::Tensor y = tp(tokens);
        EXPECT_TENSOR_CLOSE(y.detach(), wte(tokens).detach(), kFp32Op);
        (y * G).sum().backward();
        EXPECT_TENSOR_CLOSE(tp->weight.grad(), shard(padded_wgrad, 0, r, W), kFp32Op);
        const torch::Tensor local = shard(padded_logits, 1, r, W).requires_grad_();
        const torch::Tensor loss =
            vocab_parallel_cross_entropy(local, targets, r * Vp / W, *ctx.comm, V);
        EXPECT_TENSOR_CLOSE(loss.detach(), loss_ref.detach(), kFp32Op);
        loss.backward();
        EXPECT_TENSOR_CLOSE(local.grad(), shard(padded_grad, 1, r, W), kFp32Op);
      },
      kTimeout);
}

TEST(L08Vocabulary, PaddedVocabularyMatchesTheFullOne) {
  for (int W : {2, 4, 8}) expect_padded_vocabulary_matches(W);
}

TEST_P(L08Modules, WholeModelLogitsMatch) {
  const int W = GetParam();
  Gpt full = make_full();
  auto gen = at::detail::createCPUGenerator(16);
  const torch::Tensor tokens = at::randint(0, 256, {2, 16}, gen);
  torch::Tensor logits_ref;
  {
    torch::NoGradGuard no_grad;
    logits_ref = full(tokens);  // (2, 16, 256)
  }
  run_ranks(
      W,
      [&](RankContext& ctx) {
        TpGpt tp(full, *ctx.comm);
        torch::NoGradGuard no_grad;
        EXPECT_TENSOR_CLOSE(tp(tokens), shard(logits_ref, 2, ctx.rank, W), kFp32Op);
      },
      kTimeout);
}

INSTANTIATE_TEST_SUITE_P(Ranks, L08Modules, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

}  // namespace
}  // namespace dtc::l08

// Lesson 10 tests, part 3: activation memory per rank, measured by the counting allocator
// (dtc/memory.h: the bytes this thread-rank's forward leaves allocated until backward), against
// the closed forms of program.h (predict_activation_bytes: what each layer keeps, tensor by
// tensor, README section 6), to the byte. At a sequence where the scores dominate: s = 256,
// h = 32, 4 heads, so a s^2 b (262,144 scores) is twice 16 s b h (131,072).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/memory.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "program.h"

namespace dtc::l10 {
namespace {

using test::kTimeout;

// s = 256, h = 32, 4 heads: the scores, a s^2 b = 262,144, are twice 16 s b h = 131,072.
RunConfig long_sequence(Precision precision) {
  RunConfig run;
  run.model.layers = 2;
  run.model.hidden = 32;
  run.model.heads = 4;
  run.model.ctx = 256;
  run.batch = 1;
  run.precision = precision;
  return run;
}

// s = 64, b = 2: the scores, 32,768, half of 16 s b h.
RunConfig short_sequence(Precision precision) {
  RunConfig run = long_sequence(precision);
  run.model.ctx = 64;
  run.batch = 2;
  return run;
}

// Each rank's activation bytes for @p kind on cp thread-ranks, measured three times: every
// reading must agree.
std::vector<int64_t> measure(const RunConfig& run, Attention kind, int cp, bool zigzag) {
  install_counting_allocator();
  std::mutex mu;
  std::vector<int64_t> got(static_cast<size_t>(cp));
  run_ranks(
      cp,
      [&](RankContext& ctx) {
        Gpt full = make_gpt(run.model, run.seed);
        if (run.precision == Precision::kBf16) full->to(torch::kBFloat16);
        CpGpt model(full, *ctx.comm, kind, zigzag);
        const Batch batch = ByteDataset::builtin().batch(run.seed, 0, run.batch, run.model.ctx);
        Batch mine;
        mine.inputs = shard_sequence(batch.inputs, ctx.rank, cp, zigzag);
        mine.targets = shard_sequence(batch.targets, ctx.rank, cp, zigzag);
        const int64_t first = measure_activation_bytes(model, mine);
        for (int i = 0; i < 2; ++i) {
          EXPECT_EQ(measure_activation_bytes(model, mine), first)
              << "rank " << ctx.rank << ": the same forward again";
        }
        std::lock_guard<std::mutex> lock(mu);
        got[static_cast<size_t>(ctx.rank)] = first;
      },
      kTimeout);
  return got;
}

// Every rank's bytes: the closed form, or (@p qkv_either) the closed form or that plus 2 n h e a
// layer (the whole qkv projection kept, see below).
void expect_closed_forms(const RunConfig& run, Attention kind, bool qkv_either = false) {
  const GptConfig& m = run.model;
  const int64_t e = run.precision == Precision::kFp32 ? 4 : 2;
  for (int cp : {1, 2, 4}) {
    const bool zigzag = kind != Attention::kUlysses && cp > 1;
    const auto got = measure(run, kind, cp, zigzag);
    const int64_t want = predict_activation_bytes(kind, m.layers, run.batch, m.ctx, m.hidden,
                                                  m.heads, m.vocab, cp, e);
    const int64_t whole = want + m.layers * 2 * (run.batch * m.ctx / cp) * m.hidden * e;
    for (int r = 0; r < cp; ++r) {
      const int64_t g = got[static_cast<size_t>(r)];
      EXPECT_TRUE(g == want || (qkv_either && g == whole))
          << attention_name(kind) << ", s " << m.ctx << ", cp " << cp << ", rank " << r << ", "
          << precision_name(run.precision) << ": bytes kept for backward " << g << ", want " << want
          << (qkv_either ? fmt::format(" or {} (the whole qkv projection kept)", whole)
                         : std::string());
    }
  }
}

// The ring keeps nothing of size s x s. Ulysses and all-gather keep the scores (LibTorch's
// softmax keeps its output) and the causal mask (masked_fill keeps it). All-gather's queries are
// a strided view of the qkv projection: LibTorch's matmul keeps a copy of them (n h), or the
// view itself and with it the whole projection (3 n h), 2 n h e more a layer. Which, is
// LibTorch's choice (measured: the copy at s = 64, the view at s = 256, both precisions, 2.x
// and 1.13), not the learner's code: either passes.
void expect_closed_forms(Precision precision) {
  expect_closed_forms(long_sequence(precision), Attention::kRing);
  expect_closed_forms(long_sequence(precision), Attention::kUlysses);
  expect_closed_forms(short_sequence(precision), Attention::kAllGather, /*qkv_either=*/true);
  expect_closed_forms(long_sequence(precision), Attention::kAllGather, /*qkv_either=*/true);
}

TEST(L10Memory, ActivationsPerRankAreTheClosedFormsToTheByte) {
  expect_closed_forms(Precision::kFp32);
}

TEST(L10Memory, Bf16ActivationsAreTheClosedFormsToTheByte) {
  if (!kGlooBf16) GTEST_SKIP() << "LibTorch 1.13's gloo has no bf16 collectives";
  expect_closed_forms(Precision::kBf16);
}

TEST(L10Memory, RingActivationsFallAsOneOverCp) {
  // Everything the ring keeps is per token: cp ranks hold exactly 1/cp each (but for the
  // loss's two fp32 scalars, 8 bytes on every rank).
  const RunConfig run = long_sequence(Precision::kFp32);
  const int64_t one = measure(run, Attention::kRing, 1, false)[0];
  for (int cp : {2, 4}) {
    for (int64_t got : measure(run, Attention::kRing, cp, true)) {
      EXPECT_EQ(got - 8, (one - 8) / cp) << "ring, cp " << cp << ": per-rank bytes";
    }
  }
  // On one rank, all-gather is the plain softmax attention: the ring keeps, per layer, no
  // scores (4 a s^2 b bytes) and no mask (s^2), nor the whole qkv projection's other two thirds
  // (2 s b h x 4 where LibTorch keeps it: see above), but its fp32 output and log-sum-exp
  // (4 s b h + 4 s b a). At this length the scores dominate.
  const int64_t s = run.model.ctx, b = run.batch, h = run.model.hidden, a = run.model.heads;
  const int64_t plain = measure(run, Attention::kAllGather, 1, false)[0];
  const int64_t saves =
      run.model.layers * (4 * a * s * s * b + s * s - 4 * s * b * h - 4 * s * b * a);
  const int64_t qkv = run.model.layers * 8 * s * b * h;  // the qkv projection's other two thirds
  EXPECT_TRUE(plain - one == saves + qkv || plain - one == saves)
      << "bytes the ring saves against plain attention, one rank, s = " << s << ": " << plain - one
      << ", want " << saves + qkv << " (LibTorch keeps the whole qkv projection)"
      << " or " << saves;
  EXPECT_GT(static_cast<double>(plain) / static_cast<double>(one), 2.0)
      << "one ring rank keeps less than half of what plain attention keeps (README section 6)";
}

}  // namespace
}  // namespace dtc::l10

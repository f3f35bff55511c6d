// Lesson 08's timeline (README section 8's picture): tensor parallelism's communication is on
// the critical path. Each block's forward holds its two allreduces (g after the attention's and
// the MLP's row-parallel layer), each waited for as soon as it is issued and complete before the
// block ends: the next layer needs the sum, nothing runs beside it. Its backward holds two more
// (f's, the column-parallel layers' input gradients), also waited for at once, unless
// --overlap-dgrad (set_overlap_dgrad) computes the weight gradient while the allreduce runs.
// Checked on timestamps, from outside the learner's code: each thread-rank records its own
// trace (dtc/trace.h), the given "fwd block"/"bwd block" spans and every allreduce of the TP
// group from issue to completion, with when it was first waited for (a TracingComm under it).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dtc/model.h"
#include "dtc/ranks.h"
#include "dtc/trace.h"
#include "dtc_test.h"
#include "tensor_parallel.h"

namespace dtc::l08 {
namespace {

constexpr int kTp = 2;
constexpr int64_t kBatch = 4, kSeq = 256;

GptConfig config() {
  GptConfig c;
  c.layers = 2;
  c.hidden = 512;  // a weight-gradient matmul of milliseconds, well above the threads' jitter
  c.heads = 8;
  c.ctx = kSeq;
  return c;
}

// One traced forward and backward of the TP model on kTp thread-ranks; each rank's spans.
std::vector<std::vector<TracedSpan>> traced_step(bool overlap_dgrad) {
  std::vector<std::vector<TracedSpan>> spans(kTp);
  run_ranks(
      kTp,
      [&](RankContext& ctx) {
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        tracer->set_clock(sync_clock(*ctx.store, ctx.rank, ctx.world));
        auto comm = c10::make_intrusive<TracingComm>(ctx.comm, tracer, "tp");
        TpGpt model(make_gpt(config(), 5), *comm);
        model->set_overlap_dgrad(overlap_dgrad);
        torch::manual_seed(3);
        const auto tokens = torch::randint(config().vocab, {kBatch, kSeq}, torch::kLong);
        {
          TraceScope scope(tracer.get());
          model->forward(tokens).pow(2).mean().backward();
        }
        spans[static_cast<size_t>(ctx.rank)] = traced_spans(tracer->to_json());
      },
      test::kTimeout);
  return spans;
}

// What the weight-gradient matmul of the attention's c_attn takes here (the least of a few):
// the time --overlap-dgrad puts between the input gradient's allreduce and its wait.
double weight_grad_us() {
  const int64_t rows = kBatch * kSeq, in = config().hidden, out = 3 * in / kTp;
  const auto g = torch::randn({rows, out}), x = torch::randn({rows, in});
  double best = 1e300;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto dw = g.t().matmul(x);
    (void)dw.sum().item<float>();
    best = std::min(
        best,
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// The allreduces that ran inside @p block: issued and complete within it.
std::vector<TracedSpan> allreduces_in(const std::vector<TracedSpan>& spans,
                                      const TracedSpan& block) {
  std::vector<TracedSpan> out;
  for (const auto& s : select_spans(spans, -1, TraceTrack::kComm, "allreduce")) {
    if (s.begin_us >= block.begin_us && s.end_us <= block.end_us) out.push_back(s);
  }
  return out;
}

// From issue to the first wait() (+inf when nobody waited).
double until_wait_us(const TracedSpan& s) {
  return s.args.contains("wait_us") ? s.args["wait_us"].get<double>() - s.begin_us : 1e300;
}

// The median of @p v (empty: +inf).
double median(std::vector<double> v) {
  if (v.empty()) return 1e300;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// For each rank, the allreduces inside each of its blocks named @p prefix (two per block, says
// @p why): appends when each was first waited for, from its issue, to @p waits. In the forward
// (@p forward) also each one's group and bytes.
void block_allreduce_waits(const std::vector<std::vector<TracedSpan>>& spans, const char* prefix,
                           const char* why, bool forward, std::vector<double>* waits) {
  for (int r = 0; r < kTp; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const auto& mine = spans[static_cast<size_t>(r)];
    const auto blocks = select_spans(mine, -1, TraceTrack::kCompute, prefix);
    ASSERT_EQ(blocks.size(), static_cast<size_t>(config().layers));
    for (const auto& block : blocks) {
      SCOPED_TRACE(block.name);
      const auto ars = allreduces_in(mine, block);
      EXPECT_EQ(ars.size(), 2u) << why;
      for (const auto& ar : ars) {
        if (forward) {
          EXPECT_EQ(ar.args.value("group", ""), "tp");
          EXPECT_EQ(ar.args.value("bytes", 0), kBatch * kSeq * config().hidden * 4)
              << "the block's whole (B, T, h) activation, fp32";
        } else {
          EXPECT_LT(until_wait_us(ar), 1e299) << "each allreduce is waited for";
        }
        waits->push_back(until_wait_us(ar));
      }
    }
  }
}

// Times are taken from threads that share two cores with gloo's: one wait may come late (a time
// slice), so the checks on when a wait came take the median over both ranks' allreduces.
TEST(L08Timeline, ForwardAllreducesAreWaitedForInsideTheirBlock) {
  const double dw = weight_grad_us();
  double least = 1e300;  // the least median of up to three steps (a busy machine delays waits)
  for (int attempt = 0; attempt < 3 && least >= dw / 2; ++attempt) {
    std::vector<double> waits;
    block_allreduce_waits(traced_step(/*overlap_dgrad=*/false), "fwd block",
                          "g after the attention's c_proj and after the MLP's: one allreduce "
                          "each, issued and complete inside the block",
                          /*forward=*/true, &waits);
    least = std::min(least, median(waits));
  }
  EXPECT_LT(least, dw / 2) << "allreduces waited for as soon as they were issued (a "
                              "weight-gradient matmul takes "
                           << dw << " us here): the next layer needs the sum";
}

TEST(L08Timeline, BackwardAllreducesRunBesideTheWeightGradientOnlyWithOverlapDgrad) {
  const double dw = weight_grad_us();
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(fmt::format("overlap_dgrad {}", overlap));
    // A busy machine only makes waits come later, so "waited for at once" takes the least
    // median of up to three steps (the overlapped wait, a lower bound, is checked on one).
    double least = 1e300;
    for (int attempt = 0; attempt < (overlap ? 1 : 3) && least >= dw / 2; ++attempt) {
      std::vector<double> waits;
      block_allreduce_waits(traced_step(overlap), "bwd block",
                            "f's backward for c_fc and for c_attn: the input gradients' sums, "
                            "one allreduce each, inside the block",
                            /*forward=*/false, &waits);
      least = std::min(least, median(waits));
    }
    if (overlap) {
      EXPECT_GT(least, dw / 2) << "--overlap-dgrad: dW = dY^T X (about " << dw
                               << " us here) is computed between issue and wait";
    } else {
      EXPECT_LT(least, dw / 2) << "without it, f's allreduce is waited for at once";
    }
  }
}

}  // namespace
}  // namespace dtc::l08

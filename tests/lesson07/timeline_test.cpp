// Lesson 07's timeline (README section 8's picture of stage 3), read back from a trace: with
// --prefetch the next block's all-gather is on the wire while the current block computes;
// without it, each gather waits for the block before. Checked on timestamps, from outside the
// engine: each thread-rank records its own trace (dtc/trace.h), the model's per-block forward
// spans and every collective from issue to completion (a TracingComm under the engine).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "dtc/data.h"
#include "dtc/ranks.h"
#include "dtc/trace.h"
#include "dtc_test.h"
#include "zero.h"

namespace dtc::l07 {
namespace {

constexpr int64_t kBlocks = 4;

// The second step (the first warms up) of stage 3 on 2 thread-ranks: each rank's spans.
std::vector<std::vector<TracedSpan>> traced_stage3_step(bool prefetch) {
  GptConfig config;
  config.ctx = 32;
  config.hidden = 64;
  config.layers = kBlocks;
  config.heads = 4;
  std::vector<std::vector<TracedSpan>> spans(2);
  const ByteDataset data = ByteDataset::builtin();
  run_ranks(
      2,
      [&](RankContext& ctx) {
        Gpt model(config);
        init_weights(model, 1);
        ZeroOptions o;
        o.stage = 3;
        o.prefetch = prefetch;
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        ZeroEngine engine(model, c10::make_intrusive<TracingComm>(ctx.comm, tracer, "world"), o);
        engine.forward_backward(data.batch(1, 0, 2, config.ctx, ctx.rank * 2));
        engine.optimizer_step();
        {
          TraceScope scope(tracer.get());
          TraceSpan step("step", 1);
          engine.forward_backward(data.batch(1, 1, 2, config.ctx, ctx.rank * 2));
        }
        // Only the traced step: what the tracer recorded before its "step 1" span is dropped.
        const auto all = traced_spans(tracer->to_json());
        double begin = 0;
        for (const auto& s : all)
          if (s.name == "step 1") begin = s.begin_us;
        for (const auto& s : all)
          if (s.begin_us >= begin) spans[static_cast<size_t>(ctx.rank)].push_back(s);
      },
      test::kTimeout);
  return spans;
}

// The forward's gathers in order: the outer unit's (embeddings and head), then block 0's, ...
std::vector<TracedSpan> forward_gathers(const std::vector<TracedSpan>& spans) {
  const auto blocks = select_spans(spans, -1, TraceTrack::kCompute, "fwd block");
  if (blocks.size() != static_cast<size_t>(kBlocks))
    throw std::runtime_error(fmt::format("{} forward block spans, not {}", blocks.size(), kBlocks));
  std::vector<TracedSpan> out;
  for (const auto& g : select_spans(spans, -1, TraceTrack::kComm, "allgather")) {
    if (g.begin_us < blocks.back().end_us) out.push_back(g);
  }
  if (out.size() != static_cast<size_t>(kBlocks) + 1)
    throw std::runtime_error(
        fmt::format("{} all-gathers in forward, expected the outer unit's "
                    "and one per block ({})",
                    out.size(), kBlocks + 1));
  return out;
}

// Block i + 1's all-gather (gathers[i + 2]) against block i's forward, on every rank: issued
// before it ends with prefetch, after it without.
void expect_gather_order(bool prefetch) {
  const auto spans = traced_stage3_step(prefetch);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const auto& mine = spans[static_cast<size_t>(r)];
    const auto blocks = select_spans(mine, -1, TraceTrack::kCompute, "fwd block");
    const auto gathers = forward_gathers(mine);
    for (int64_t i = 0; i + 1 < kBlocks; ++i) {
      const double issued = gathers[static_cast<size_t>(i + 2)].begin_us;
      const double ended = blocks[static_cast<size_t>(i)].end_us;
      if (prefetch) {
        EXPECT_LT(issued, ended) << "block " << i + 1 << "'s all-gather was issued after block "
                                 << i << "'s forward ended: no prefetch";
        // on the wire while block i computes: waited for only after block i's forward ...
        const auto& args = gathers[static_cast<size_t>(i + 2)].args;
        ASSERT_TRUE(args.contains("wait_us")) << "no wait() on block " << i + 1 << "'s gather";
        EXPECT_GE(args["wait_us"].get<double>(), ended)
            << "block " << i + 1 << "'s all-gather was waited for before block " << i
            << "'s forward ended: it did not run beside it";
        // ... and one block ahead, not more: issued after block i - 1's forward ended
        if (i > 0) {
          EXPECT_GE(issued, blocks[static_cast<size_t>(i - 1)].end_us)
              << "block " << i + 1 << "'s all-gather was issued before block " << i - 1
              << "'s forward ended: more than one block's parameters gathered at once";
        }
      } else {
        EXPECT_GE(issued, ended) << "block " << i + 1;
      }
    }
  }
}

TEST(L07Timeline, Stage3PrefetchGathersTheNextBlockWhileThisOneComputes) {
  expect_gather_order(/*prefetch=*/true);
}

TEST(L07Timeline, Stage3WithoutPrefetchGathersEachBlockAfterTheOneBefore) {
  expect_gather_order(/*prefetch=*/false);
}

}  // namespace
}  // namespace dtc::l07

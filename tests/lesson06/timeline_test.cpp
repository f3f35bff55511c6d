// Lesson 06's timeline (README section 5's picture), read back from a trace: the claim the
// picture makes is checked on the timestamps, from outside the Reducer. Each thread-rank records
// its own trace (dtc/trace.h): the given step's "backward" span, the model's per-block backward
// spans (gradient hooks) and every allreduce from issue to completion (a TracingComm around the
// rank's communicator).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "ddp.h"
#include "dtc/data.h"
#include "dtc/ranks.h"
#include "dtc/trace.h"
#include "dtc_test.h"
#include "program.h"

namespace dtc::l06 {
namespace {

using test::kTimeout;

TrainConfig timeline_config(SyncMode sync) {
  TrainConfig c;
  c.model.layers = 2;
  c.model.hidden = 64;
  c.model.heads = 2;
  c.model.ctx = 32;
  c.batch = 4;
  c.sync = sync;
  c.bucket_bytes = 16 * 1024;  // several buckets
  return c;
}

// One traced step (the second: the first warms up) on each of 2 thread-ranks: each rank's spans.
std::vector<std::vector<TracedSpan>> traced_step(SyncMode sync) {
  const TrainConfig c = timeline_config(sync);
  const ByteDataset data = ByteDataset::builtin();
  std::vector<std::vector<TracedSpan>> spans(2);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        DdpTrainer warm(c, ctx.comm, torch::kCPU, c.seed);
        warm.step(rank_batches(data, c, 0, ctx.rank, 2));
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        auto comm = c10::make_intrusive<TracingComm>(ctx.comm, tracer, "world");
        DdpTrainer trainer(c, comm, torch::kCPU, c.seed);
        {
          TraceScope scope(tracer.get());
          trainer.step(rank_batches(data, c, 1, ctx.rank, 2));
        }
        spans[static_cast<size_t>(ctx.rank)] = traced_spans(tracer->to_json());
      },
      kTimeout);
  return spans;
}

const TracedSpan& only(const std::vector<TracedSpan>& spans, const std::string& name) {
  const TracedSpan* found = nullptr;
  for (const auto& s : spans) {
    if (s.name == name) {
      if (found) throw std::runtime_error("two '" + name + "' spans in one traced step");
      found = &s;
    }
  }
  if (!found) throw std::runtime_error("no '" + name + "' span in the traced step");
  return *found;
}

// The gradients' allreduces: every allreduce but the step's 4-byte loss.
std::vector<TracedSpan> gradient_allreduces(const std::vector<TracedSpan>& spans) {
  std::vector<TracedSpan> out;
  for (const auto& s : select_spans(spans, -1, TraceTrack::kComm, "allreduce")) {
    if (s.args.value("bytes", 0) > 4) out.push_back(s);
  }
  return out;
}

TEST(L06Timeline, FirstBucketsAllreduceStartsBeforeBackwardEnds) {
  // The bucketed picture: the comm track is busy while the compute track is still in backward.
  // The first bucket (the last layers' gradients, ready first) is on the wire before backward
  // ends, and at least one block's backward starts after it was issued (computation goes on
  // beside the communication).
  const auto spans = traced_step(SyncMode::kBucketed);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const auto& mine = spans[static_cast<size_t>(r)];
    const TracedSpan& backward = only(mine, "backward");
    const auto grads = gradient_allreduces(mine);
    ASSERT_GE(grads.size(), 3u) << "expected several buckets' allreduces";
    EXPECT_LT(grads.front().begin_us, backward.end_us)
        << "the first bucket's allreduce was issued " << grads.front().begin_us - backward.end_us
        << " us after backward ended: no overlap";
    const auto blocks = select_spans(mine, -1, TraceTrack::kCompute, "bwd block");
    ASSERT_EQ(blocks.size(), 2u) << "one backward span per block";
    const bool computed_beside =
        std::any_of(blocks.begin(), blocks.end(),
                    [&](const TracedSpan& b) { return b.begin_us > grads.front().begin_us; });
    EXPECT_TRUE(computed_beside)
        << "no block's backward started after the first bucket's allreduce was issued";
    // Every bucket but the last (the embedding's, ready last) is issued before backward ends.
    const auto before = std::count_if(grads.begin(), grads.end(), [&](const TracedSpan& g) {
      return g.begin_us < backward.end_us;
    });
    EXPECT_GE(before, static_cast<long>(grads.size()) - 1);
    // And it is not waited for at once: a block's backward starts between the first bucket's
    // issue and the first wait() on it (a Reducer that waits in its hook overlaps nothing).
    ASSERT_TRUE(grads.front().args.contains("wait_us"))
        << "no wait() on the first bucket's Work: finish() must wait for every bucket's Work";
    const double waited = grads.front().args["wait_us"].get<double>();
    const bool ran_before_the_wait =
        std::any_of(blocks.begin(), blocks.end(), [&](const TracedSpan& b) {
          return b.begin_us > grads.front().begin_us && b.begin_us < waited;
        });
    EXPECT_TRUE(ran_before_the_wait)
        << "the first bucket was waited for " << waited - grads.front().begin_us
        << " us after it was issued, before any later block's backward began: the hook waited";
  }
}

TEST(L06Timeline, NaiveAllreducesStartAfterBackward) {
  // The naive picture, for contrast: one allreduce per parameter, every one after backward.
  const auto spans = traced_step(SyncMode::kNaive);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const auto& mine = spans[static_cast<size_t>(r)];
    const TracedSpan& backward = only(mine, "backward");
    const auto grads = gradient_allreduces(mine);
    ASSERT_FALSE(grads.empty());
    for (const auto& g : grads) EXPECT_GE(g.begin_us, backward.end_us);
    // and they sit inside the given step's "sync gradients" span
    const TracedSpan& sync = only(mine, "sync gradients");
    EXPECT_GE(grads.front().begin_us, sync.begin_us);
  }
}

}  // namespace
}  // namespace dtc::l06

// Lesson 10's timeline (README section 3's picture of the ring), read back from a trace: while
// a rank computes one block of attention, the next block's K/V is on the wire. Checked on
// timestamps, from outside the learner's ring: each thread-rank records its own trace
// (dtc/trace.h), the given block_attention's "attn" spans and every send and receive from issue
// to completion (a TracingComm under the ring).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "context_parallel.h"
#include "dtc/ranks.h"
#include "dtc/trace.h"
#include "dtc_test.h"
#include "program.h"

namespace dtc::l10 {
namespace {

// One traced ring forward (and, with @p backward, its backward) on cp thread-ranks (zig-zag: no
// step is skipped).
std::vector<std::vector<TracedSpan>> traced_ring_forward(int cp, bool overlap,
                                                         bool backward = false) {
  const int64_t B = 2, H = 2, T = 64 * cp, D = 16;
  std::vector<std::vector<TracedSpan>> spans(static_cast<size_t>(cp));
  run_ranks(
      cp,
      [&](RankContext& ctx) {
        torch::manual_seed(7);
        auto q = torch::randn({B, H, T, D}), k = torch::randn({B, H, T, D}),
             v = torch::randn({B, H, T, D});
        auto shard = [&](const torch::Tensor& t) {
          return shard_sequence(t, ctx.rank, cp, /*zigzag=*/true, /*dim=*/2);
        };
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        tracer->set_clock(sync_clock(*ctx.store, ctx.rank, ctx.world));
        c10::intrusive_ptr<Comm> comm = c10::make_intrusive<TracingComm>(ctx.comm, tracer, "cp");
        if (!overlap) comm = c10::make_intrusive<WaitingComm>(comm);
        if (backward) {
          TraceScope scope(tracer.get());
          auto qs = shard(q).requires_grad_(), ks = shard(k).requires_grad_(),
               vs = shard(v).requires_grad_();
          ring_attention(qs, ks, vs, *comm, /*zigzag=*/true).sum().backward();
        } else {
          TraceScope scope(tracer.get());
          torch::NoGradGuard no_grad;
          ring_attention(shard(q), shard(k), shard(v), *comm, /*zigzag=*/true);
        }
        spans[static_cast<size_t>(ctx.rank)] = traced_spans(tracer->to_json());
      },
      test::kTimeout);
  return spans;
}

// The k-th operation (in issue order) with @p tag among @p ops, or null.
const TracedSpan* kth_with_tag(const std::vector<TracedSpan>& ops, int tag, size_t k) {
  for (const auto& op : ops) {
    if (op.args.value("tag", -1) != tag) continue;
    if (k-- == 0) return &op;
  }
  return nullptr;
}

// How many of a rank's attention blocks, but the last, ran while the next K/V was on the wire.
// Ring step k's rotation is the k-th send and receive of K (tag 0) and of V (tag 1), counted in
// issue order, so that a rotation is paired with its own step (not with whatever was issued
// near it): all four were issued before block k began, and both receives were waited for only
// after it ended.
// @p name: "attn" (forward) or "attn bwd"; @p skip: the rotations of K/V before the pass (the
// backward's come after the forward's cp - 1).
int blocks_beside_a_rotation(const std::vector<TracedSpan>& spans, int* blocks,
                             const std::string& name = "attn", size_t skip = 0) {
  const auto attn = select_spans(spans, -1, TraceTrack::kCompute, name);
  const auto send = select_spans(spans, -1, TraceTrack::kComm, "send");
  const auto recv = select_spans(spans, -1, TraceTrack::kComm, "recv");
  *blocks = static_cast<int>(attn.size());
  int beside = 0;
  for (size_t k = 0; k + 1 < attn.size(); ++k) {
    bool ok = true;
    for (int tag : {0, 1}) {
      const TracedSpan* s = kth_with_tag(send, tag, k + skip);
      const TracedSpan* r = kth_with_tag(recv, tag, k + skip);
      ok = ok && s && r && s->begin_us < attn[k].begin_us && r->begin_us < attn[k].begin_us &&
           r->args.contains("wait_us") && r->args["wait_us"].get<double>() >= attn[k].end_us;
    }
    if (ok) ++beside;
  }
  return beside;
}

TEST(L10Timeline, RingReceivesTheNextBlockWhileComputingThisOne) {
  const int cp = 4;
  const auto spans = traced_ring_forward(cp, /*overlap=*/true);
  for (int r = 0; r < cp; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    int blocks = 0;
    const int beside = blocks_beside_a_rotation(spans[static_cast<size_t>(r)], &blocks);
    EXPECT_EQ(blocks, cp) << "one attention block per ring step (zig-zag skips none)";
    EXPECT_EQ(beside, cp - 1)
        << "blocks computed while the next K/V was still arriving (the last has none to wait for)";
  }
}

TEST(L10Timeline, RingBackwardReceivesTheNextBlockWhileComputingThisOne) {
  // The backward's K/V rotation (tags 0 and 1 again, after the forward's cp - 1) is posted,
  // sends and receives, before each block's backward and waited for after it.
  const int cp = 4;
  const auto spans = traced_ring_forward(cp, /*overlap=*/true, /*backward=*/true);
  for (int r = 0; r < cp; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    int blocks = 0;
    const int beside = blocks_beside_a_rotation(spans[static_cast<size_t>(r)], &blocks, "attn bwd",
                                                static_cast<size_t>(cp - 1));
    EXPECT_EQ(blocks, cp) << "one backward block per ring step (zig-zag skips none)";
    EXPECT_EQ(beside, cp - 1) << "backward blocks computed while the next K/V was arriving, "
                                 "its sends and receives both posted before the block";
  }
}

TEST(L10Timeline, WithoutOverlapNoBlockRunsBesideAReceive) {
  // --no-overlap's picture: each hop is waited for as soon as it is posted (WaitingComm), so the
  // comm and compute tracks take turns.
  const int cp = 4;
  const auto spans = traced_ring_forward(cp, /*overlap=*/false);
  for (int r = 0; r < cp; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    int blocks = 0;
    EXPECT_EQ(blocks_beside_a_rotation(spans[static_cast<size_t>(r)], &blocks), 0);
    EXPECT_EQ(blocks, cp);
  }
}

}  // namespace
}  // namespace dtc::l10

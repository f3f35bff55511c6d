// Lesson 03 tests, part 3: ring reduce-scatter, all-gather and allreduce from send/recv, on
// 2, 3 and 4 thread-ranks and on lengths that do not divide evenly (0, 1, primes, n < W).
// References: numpy.array_split's chunk rule, closed-form sums of integer-valued inputs (exact
// in float32), and gloo's own allreduce on random inputs (one fp32 op: kFp32Op).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <chrono>
#include <set>

#include "collectives.h"
#include "dtc/compare.h"
#include "dtc/observe.h"
#include "dtc/ranks.h"
#include "dtc_test.h"

namespace dtc::l03 {
namespace {

using test::kTimeout;
using test::kWorlds;
const int64_t kLengths[] = {0, 1, 2, 3, 5, 7, 10, 1001, 65537};

// numpy.array_split(np.arange(n), w): the first n % w chunks hold n // w + 1 elements.
int64_t split_size(int64_t n, int w, int i) { return n / w + (i < n % w ? 1 : 0); }
int64_t split_offset(int64_t n, int w, int i) {
  int64_t offset = 0;
  for (int j = 0; j < i; ++j) offset += split_size(n, w, j);
  return offset;
}

TEST(L03Ring, ChunksFollowArraySplit) {
  // [len(c) for c in numpy.array_split(numpy.arange(10), 4)] == [3, 3, 2, 2]
  EXPECT_EQ(ring_chunks(10, 4), (std::vector<Chunk>{{0, 3}, {3, 3}, {6, 2}, {8, 2}}));
  // numpy.array_split(numpy.arange(2), 4): [1, 1, 0, 0]; empty chunks sit at the end
  EXPECT_EQ(ring_chunks(2, 4), (std::vector<Chunk>{{0, 1}, {1, 1}, {2, 0}, {2, 0}}));
  EXPECT_EQ(ring_chunks(0, 3), (std::vector<Chunk>{{0, 0}, {0, 0}, {0, 0}}));
  EXPECT_EQ(ring_chunks(7, 1), (std::vector<Chunk>{{0, 7}}));
  EXPECT_EQ(ring_chunks(1001, 3), (std::vector<Chunk>{{0, 334}, {334, 334}, {668, 333}}));
}

// Rank r holds x[i] = (r + 1)(i + 1): the sum over ranks is W (W + 1) / 2 (i + 1), exactly.
at::Tensor ramp(int64_t n, int rank) {
  return torch::arange(1, n + 1, torch::kFloat) * static_cast<float>(rank + 1);
}

TEST(L03Ring, ReduceScatterClosedForm) {
  for (int world : kWorlds) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          for (int64_t n : kLengths) {
            SCOPED_TRACE(testing::Message() << "n " << n << ", rank " << ctx.rank);
            auto flat = ramp(n, ctx.rank);
            auto mine = ring_reduce_scatter(*ctx.comm, flat);
            const int64_t off = split_offset(n, world, ctx.rank);
            const int64_t size = split_size(n, world, ctx.rank);
            ASSERT_EQ(mine.numel(), size) << "the returned view is chunk r";
            auto expected = ramp(n, 0).narrow(0, off, size) * (world * (world + 1) / 2.0f);
            EXPECT_TENSOR_CLOSE(mine, expected, kExact);
            // ... and it is a view of flat, not a copy: the sum lives in flat's chunk r
            EXPECT_TENSOR_CLOSE(flat.narrow(0, off, size), expected, kExact);
          }
        },
        kTimeout);
  }
}

TEST(L03Ring, AllGatherClosedForm) {
  for (int world : kWorlds) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          for (int64_t n : kLengths) {
            SCOPED_TRACE(testing::Message() << "n " << n << ", rank " << ctx.rank);
            // Only chunk r is ours (r + 1 in it); the rest is -1, to be overwritten.
            auto flat = torch::full({n}, -1.0f);
            flat.narrow(0, split_offset(n, world, ctx.rank), split_size(n, world, ctx.rank))
                .fill_(static_cast<float>(ctx.rank + 1));
            ring_all_gather(*ctx.comm, flat);
            auto expected = torch::empty({n});
            for (int i = 0; i < world; ++i) {
              expected.narrow(0, split_offset(n, world, i), split_size(n, world, i))
                  .fill_(i + 1.0f);
            }
            EXPECT_TENSOR_CLOSE(flat, expected, kExact);
          }
        },
        kTimeout);
  }
}

TEST(L03Ring, AllreduceClosedForm) {
  for (int world : kWorlds) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          for (int64_t n : kLengths) {
            SCOPED_TRACE(testing::Message() << "n " << n << ", rank " << ctx.rank);
            auto flat = ramp(n, ctx.rank);
            ring_allreduce(*ctx.comm, flat);
            EXPECT_TENSOR_CLOSE(flat, ramp(n, 0) * (world * (world + 1) / 2.0f), kExact);
          }
        },
        kTimeout);
  }
}

TEST(L03Ring, AllreduceEqualsGloo) {
  for (int world : kWorlds) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          for (int64_t n : kLengths) {
            SCOPED_TRACE(testing::Message() << "n " << n << ", rank " << ctx.rank);
            // Random data, different on every rank (a generator per thread: no shared state).
            auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * n + ctx.rank);
            auto mine = at::randn({n}, gen);
            std::vector<at::Tensor> gloo{mine.clone()};
            ctx.comm->allreduce(gloo)->wait();  // the library's answer
            ring_allreduce(*ctx.comm, mine);
            // Same sum, different order of additions: one fp32 op's tolerance.
            EXPECT_TENSOR_CLOSE(mine, gloo[0], kFp32Op);
          }
        },
        kTimeout, RanksTransport::kGloo);  // gloo itself, not the thread-ranks' local transport
  }
}

// What a ring is, seen from outside the learner's code (a RecordingComm around the Comm): only
// send and recv; sends only to r + 1, receives only from r - 1; each rank sends every chunk but
// its own once in the reduce-scatter and every chunk but r + 1's once in the all-gather (the
// 2 (W - 1) / W of the data that makes the ring bandwidth-optimal); and no rank waits for a
// send while it has no receive posted (on a transport whose sends block until the peer
// receives, NCCL's with large messages, that order deadlocks: every rank waits on its send).
TEST(L03Ring, AllreduceSendsOnlyToItsNeighboursTheRingsBytes) {
  for (int world : {2, 3, 4}) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          for (int64_t n : {int64_t{10}, int64_t{1001}}) {
            SCOPED_TRACE(testing::Message() << "n " << n << ", rank " << ctx.rank);
            auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
            auto flat = ramp(n, ctx.rank);
            ring_allreduce(*rec, flat);
            const int r = ctx.rank;
            const int next = (r + 1) % world, prev = (r + world - 1) % world;
            int64_t sent = 0, recvs_posted = 0, sends_waited = 0;
            std::set<int64_t> recv_calls;
            for (const auto& e : rec->events()) {
              if (e.op == "send") {
                EXPECT_EQ(e.peer, next) << "a ring sends to rank r + 1 only";
                sent += e.bytes;
              } else if (e.op == "recv") {
                EXPECT_EQ(e.peer, prev) << "a ring receives from rank r - 1 only";
                ++recvs_posted;
                recv_calls.insert(e.seq);
              } else if (e.op == "wait" && e.label == "send") {
                // Each step's receive must be posted before its send is waited on (either wait
                // may come first after that).
                EXPECT_GT(recvs_posted, sends_waited)
                    << "waited for a send before posting that step's receive: on NCCL with large "
                       "messages every rank waits on its send and none receives (post the recv "
                       "first)";
                ++sends_waited;
              } else if (e.op != "wait") {
                ADD_FAILURE() << "a ring is made of send and recv only; it called " << e.op;
              }
            }
            const int64_t want = 4 * (2 * n - split_size(n, world, r) - split_size(n, world, next));
            EXPECT_EQ(sent, want) << "bytes sent: every chunk but chunk r (reduce-scatter) and "
                                     "every chunk but chunk r + 1 (all-gather), once";
            EXPECT_TENSOR_CLOSE(flat, ramp(n, 0) * (world * (world + 1) / 2.0f), kExact);
          }
        },
        kTimeout);
  }
}

TEST(L03Ring, OneRankIsIdentity) {
  run_ranks(
      1,
      [&](RankContext& ctx) {
        auto flat = ramp(10, 0);
        ring_allreduce(*ctx.comm, flat);
        EXPECT_TENSOR_CLOSE(flat, ramp(10, 0), kExact);
      },
      kTimeout);
}

// Input checks are given code: they pass on the untouched exercise.
TEST(L03RingGiven, RejectsWhatIsNotAFlatFloatTensor) {
  EXPECT_THROW(ring_chunks(-1, 2), std::invalid_argument);
  EXPECT_THROW(ring_chunks(4, 0), std::invalid_argument);
  run_ranks(
      1,
      [&](RankContext& ctx) {
        EXPECT_THROW(ring_allreduce(*ctx.comm, torch::ones({2, 2})), std::invalid_argument);
        EXPECT_THROW(ring_reduce_scatter(*ctx.comm, torch::ones({4}, torch::kDouble)),
                     std::invalid_argument);
        EXPECT_THROW(ring_all_gather(*ctx.comm, torch::ones({8}).slice(0, 0, 8, 2)),
                     std::invalid_argument);
        EXPECT_THROW(ring_all_gather(*ctx.comm, at::Tensor()), std::invalid_argument);
      },
      kTimeout);
}

}  // namespace
}  // namespace dtc::l03

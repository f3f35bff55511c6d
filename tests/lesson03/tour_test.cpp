// Lesson 03 tests, part 1: the collectives tour. Each collective runs on 2, 3 and 4 thread-ranks
// (dtc::run_ranks, 3 s timeout) and every rank checks its own result against the closed form
// that collectives.h states. Sums: 1 + 2 + ... + W = W (W + 1) / 2.
#include <gtest/gtest.h>

#include <chrono>

#include "collectives.h"
#include "dtc/compare.h"
#include "dtc/ranks.h"
#include "dtc_test.h"

namespace dtc::l03 {
namespace {

using test::kTimeout;
using test::kWorlds;

float triangle(int w) { return w * (w + 1) / 2.0f; }

TEST(L03Tour, Broadcast) {
  for (int world : kWorlds) {
    for (int root : {0, world - 1}) {
      SCOPED_TRACE(testing::Message() << "world " << world << ", root " << root);
      run_ranks(
          world,
          [&](RankContext& ctx) {
            auto got = tour_broadcast(*ctx.comm, root, 5);
            EXPECT_TENSOR_CLOSE(got, torch::full({5}, static_cast<float>(root + 1)), kExact);
          },
          kTimeout);
    }
  }
}

TEST(L03Tour, Allreduce) {
  for (int world : kWorlds) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          auto got = tour_allreduce(*ctx.comm, 5);
          EXPECT_TENSOR_CLOSE(got, torch::full({5}, triangle(world)), kExact);
        },
        kTimeout);
  }
}

TEST(L03Tour, Allgather) {
  for (int world : kWorlds) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          auto got = tour_allgather(*ctx.comm, 3);
          // (W, 3): row i is full(3, i)
          auto expected = torch::arange(world, torch::kFloat).unsqueeze(1).expand({world, 3});
          EXPECT_TENSOR_CLOSE(got, expected.contiguous(), kExact);
        },
        kTimeout);
  }
}

TEST(L03Tour, Reduce) {
  for (int world : kWorlds) {
    for (int root : {0, world - 1}) {
      SCOPED_TRACE(testing::Message() << "world " << world << ", root " << root);
      run_ranks(
          world,
          [&](RankContext& ctx) {
            auto got = tour_reduce(*ctx.comm, root, 4);
            if (ctx.rank == root) {
              ASSERT_TRUE(got.defined()) << "the root must return the sum";
              EXPECT_TENSOR_CLOSE(got, torch::full({4}, triangle(world)), kExact);
            } else {
              EXPECT_FALSE(got.defined()) << "a non-root returns at::Tensor()";
            }
          },
          kTimeout);
    }
  }
}

TEST(L03Tour, Alltoall) {
  for (int world : kWorlds) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          const int64_t chunk = 3;
          auto got = tour_alltoall(*ctx.comm, chunk);
          // chunk j came from rank j, which filled it for us with 100 j + r
          auto expected = torch::empty({world * chunk});
          for (int j = 0; j < world; ++j) {
            expected.narrow(0, j * chunk, chunk).fill_(100.0 * j + ctx.rank);
          }
          EXPECT_TENSOR_CLOSE(got, expected, kExact);
        },
        kTimeout);
  }
}

TEST(L03Tour, SendRecvRing) {
  for (int world : kWorlds) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          auto got = tour_send_recv(*ctx.comm, 6);
          const int left = (ctx.rank - 1 + world) % world;
          EXPECT_TENSOR_CLOSE(got, torch::full({6}, static_cast<float>(left)), kExact);
        },
        kTimeout);
  }
}

TEST(L03Tour, Barrier) {
  for (int world : kWorlds) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          // Rank 0 arrives late: without the barrier the others would count too few keys.
          if (ctx.rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
          EXPECT_EQ(tour_barrier(*ctx.comm, *ctx.store, "test/"), world);
        },
        kTimeout);
  }
}

}  // namespace
}  // namespace dtc::l03

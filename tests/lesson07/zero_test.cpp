// Lesson 07 tests, part 1: the pieces. The padded layout against lesson 01's parameter formula,
// the counting collectives on 2 and 3 thread-ranks against closed forms (sums of integer-valued
// inputs are exact in fp32) and the ring's byte count, and the elementwise AdamW against
// LibTorch's torch::optim::AdamW, on the full tensor and shard by shard.
#include <gtest/gtest.h>

#include <chrono>

#include "dtc/compare.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "zero.h"

namespace dtc::l07 {
namespace {

using test::kTimeout;

TEST(L07Layout, PaddedSizeClosedForm) {
  EXPECT_EQ(padded_size(10, 4), 12);  // ceil(10 / 4) * 4
  EXPECT_EQ(padded_size(12, 4), 12);
  EXPECT_EQ(padded_size(0, 3), 0);
  EXPECT_EQ(padded_size(7, 1), 7);
  EXPECT_EQ(padded_size(118528, 3), 118530);
}

// Lesson 01's GPT formula per unit: a block holds 12h^2 + 13h, the outer unit Vh + ctx h + 2h
// (+ Vh untied); the sum is L(12h^2 + 13h) + Vh + ctx h + 2h (+ Vh).
TEST(L07Layout, UnitsFollowTheParameterFormula) {
  for (bool tied : {true, false}) {
    for (int world : {1, 2, 3, 4}) {
      SCOPED_TRACE(testing::Message() << "tied " << tied << ", world " << world);
      GptConfig c;
      c.hidden = 64;
      c.layers = 3;
      c.ctx = 32;
      c.tied = tied;
      Gpt model(c);
      const FlatLayout layout = make_layout(model, world);
      const int64_t h = c.hidden, V = c.vocab;
      ASSERT_EQ(layout.units.size(), 4u);
      EXPECT_EQ(layout.units[0].numel, V * h + c.ctx * h + 2 * h + (tied ? 0 : V * h));
      for (size_t i = 1; i < 4; ++i) EXPECT_EQ(layout.units[i].numel, 12 * h * h + 13 * h);
      EXPECT_EQ(layout.numel,
                3 * (12 * h * h + 13 * h) + V * h + c.ctx * h + 2 * h + (tied ? 0 : V * h));
      int64_t offset = 0;
      for (const Unit& unit : layout.units) {
        EXPECT_EQ(unit.padded % world, 0);
        EXPECT_LT(unit.padded - unit.numel, world);
        EXPECT_EQ(unit.offset, offset);
        offset += unit.padded;
      }
      EXPECT_EQ(layout.padded, offset);
      EXPECT_EQ(layout.shard * world, layout.padded);
    }
  }
}

// Rank r holds x[i] = (r + 1)(i + 1): the sum over ranks is W (W + 1) / 2 (i + 1), exactly.
at::Tensor ramp(int64_t n, int rank) {
  return torch::arange(1, n + 1, torch::kFloat) * static_cast<float>(rank + 1);
}

TEST(L07Comm, ReduceScatterClosedFormAndBytes) {
  for (int world : {2, 3}) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          CountingComm comm(ctx.comm);
          const int64_t chunk = 5;
          auto mine = comm.reduce_scatter(ramp(world * chunk, ctx.rank));
          auto expected = ramp(world * chunk, 0).narrow(0, ctx.rank * chunk, chunk) *
                          static_cast<float>(world * (world + 1) / 2);
          EXPECT_TENSOR_CLOSE(mine, expected, kExact);
          // ring reduce-scatter: (W-1)/W of the N fp32 elements leave each rank
          EXPECT_EQ(comm.bytes_sent(), (world - 1) * chunk * 4);
        },
        kTimeout);
  }
}

TEST(L07Comm, AllGatherClosedFormAndBytes) {
  for (int world : {2, 3}) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          CountingComm comm(ctx.comm);
          auto full = comm.all_gather(torch::full({4}, static_cast<float>(ctx.rank + 1)));
          // chunk j came from rank j: j + 1, four times
          auto expected = torch::arange(1, world + 1, torch::kFloat).repeat_interleave(4);
          EXPECT_TENSOR_CLOSE(full, expected, kExact);
          EXPECT_EQ(comm.bytes_sent(), (world - 1) * 4 * 4);
        },
        kTimeout);
  }
}

TEST(L07Comm, AllReduceClosedFormAndBytes) {
  for (int world : {2, 3}) {
    SCOPED_TRACE(testing::Message() << "world " << world);
    run_ranks(
        world,
        [&](RankContext& ctx) {
          CountingComm comm(ctx.comm);
          auto t = ramp(6 * world, ctx.rank);
          comm.all_reduce(t);
          EXPECT_TENSOR_CLOSE(t, ramp(6 * world, 0) * static_cast<float>(world * (world + 1) / 2),
                              kExact);
          // ring allreduce = reduce-scatter + all-gather: 2 (W-1)/W N elements of 4 bytes
          EXPECT_EQ(comm.bytes_sent(), 2 * (world - 1) * 6 * 4);
        },
        kTimeout);
  }
}

// The reference is LibTorch's own AdamW, stepping the same tensor from the same gradients.
TEST(L07AdamW, MatchesTorchAdamWOnTheFullTensorAndShardByShard) {
  torch::manual_seed(7);
  const AdamWOptions o;
  auto start = torch::randn({1000});
  std::vector<torch::Tensor> grads;
  for (int i = 0; i < 5; ++i) grads.push_back(torch::randn({1000}));

  auto reference = start.clone().requires_grad_();
  torch::optim::AdamW optimizer({reference}, torch::optim::AdamWOptions(o.lr)
                                                 .betas({o.beta1, o.beta2})
                                                 .eps(o.eps)
                                                 .weight_decay(o.weight_decay));
  auto full = start.clone(), m = torch::zeros({1000}), v = torch::zeros({1000});
  auto sharded = start.clone(), ms = torch::zeros({1000}), vs = torch::zeros({1000});
  for (int step = 1; step <= 5; ++step) {
    reference.mutable_grad() = grads[step - 1].clone();
    optimizer.step();
    adamw_update(full, grads[step - 1], m, v, step, o);
    // three uneven shards: AdamW is elementwise, so the pieces make the whole
    for (auto [off, n] : {std::pair<int64_t, int64_t>{0, 334}, {334, 333}, {667, 333}}) {
      adamw_update(sharded.narrow(0, off, n), grads[step - 1].narrow(0, off, n),
                   ms.narrow(0, off, n), vs.narrow(0, off, n), step, o);
    }
  }
  EXPECT_TENSOR_CLOSE(full, reference.detach(), kFp32Op);
  EXPECT_TENSOR_CLOSE(sharded, full, kExact);
}

}  // namespace
}  // namespace dtc::l07

// Lesson 10 tests, part 1: the merge, and each context-parallel attention against the unsplit
// attention on the same q, k, v (masked_attention on the whole sequence, which is the course
// model's attention core: tests/lesson10/training_test.cpp checks that against
// dtc::CausalSelfAttentionImpl::core, and tests/reference/lesson10_sdpa.py against PyTorch's
// scaled_dot_product_attention). Values and gradients, 2, 3 and 4 thread-ranks, contiguous and
// zig-zag; communication seen from outside through a RecordingComm, and the work each rank does
// through the block observer of the given block_attention.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "context_parallel.h"
#include "dtc/compare.h"
#include "dtc/data.h"
#include "dtc/errors.h"
#include "dtc/observe.h"
#include "dtc/ranks.h"
#include "dtc_test.h"

namespace dtc::l10 {
namespace {

using test::kTimeout;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Deterministic inputs, the same on every thread-rank.
torch::Tensor randn(std::vector<int64_t> shape, uint64_t seed, double scale = 1.0) {
  torch::manual_seed(seed);  // per-thread generator state is shared: callers hold a lock
  return torch::randn(shape) * scale;
}

std::mutex rng_mu;  // torch's default generator is process-wide

struct Qkv {
  torch::Tensor q, k, v, w;  // w: the upstream gradient, loss = sum(out * w)
};

Qkv inputs(int64_t B, int64_t H, int64_t T, int64_t D, uint64_t seed, double scale = 1.0) {
  std::lock_guard<std::mutex> lock(rng_mu);
  return {randn({B, H, T, D}, seed, scale), randn({B, H, T, D}, seed + 1, scale),
          randn({B, H, T, D}, seed + 2), randn({B, H, T, D}, seed + 3)};
}

// The unsplit attention's output and its gradients with respect to q, k and v.
struct Reference {
  torch::Tensor out, dq, dk, dv;
};

Reference unsplit(const Qkv& x, bool causal) {
  auto q = x.q.clone().requires_grad_(), k = x.k.clone().requires_grad_(),
       v = x.v.clone().requires_grad_();
  const auto pos = torch::arange(x.q.size(2), torch::kLong);
  auto out = masked_attention(q, k, v, pos, pos, causal);
  (out * x.w).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// ---------------------------------------------------------------------------------------------
// Part 1: the merge
// ---------------------------------------------------------------------------------------------

TEST(L10Merge, BlocksInAnyOrderGiveTheWholeSoftmax) {
  const Qkv x = inputs(2, 3, 5, 4, 11);
  const torch::Tensor keys = randn({2, 3, 12, 4}, 12), values = randn({2, 3, 12, 4}, 13);
  const auto qp = torch::arange(5), kp = torch::arange(12);
  const torch::Tensor want = masked_attention(x.q, keys, values, qp, kp, /*causal=*/false);
  const double scale = 1.0 / std::sqrt(4.0);
  const torch::Tensor want_lse = (x.q.matmul(keys.transpose(-2, -1)) * scale).logsumexp(-1);
  for (const std::vector<int>& order : {std::vector<int>{0, 1, 2}, {2, 0, 1}, {1, 2, 0}}) {
    torch::Tensor out = torch::zeros({2, 3, 5, 4});
    torch::Tensor lse = torch::full({2, 3, 5}, -kInf);
    for (int b : order) {  // key blocks of 3, 4 and 5: unequal on purpose
      const int64_t begin = b == 0 ? 0 : (b == 1 ? 3 : 7), len = b == 0 ? 3 : (b == 1 ? 4 : 5);
      merge_block(out, lse,
                  block_attention(x.q, keys.narrow(2, begin, len), values.narrow(2, begin, len), qp,
                                  kp.narrow(0, begin, len), false));
    }
    SCOPED_TRACE(::testing::Message()
                 << "blocks merged in order " << order[0] << order[1] << order[2]);
    EXPECT_TENSOR_CLOSE(out, want, kFp32Op);
    EXPECT_TENSOR_CLOSE(lse, want_lse, kFp32Op);
  }
}

TEST(L10Merge, RowsThatSeeNothingAreLeftAlone) {
  // Causal, queries at positions 0..3, a block of keys at 2..5: queries 0 and 1 see none of it.
  const torch::Tensor q = randn({1, 1, 4, 2}, 21), k = randn({1, 1, 4, 2}, 22),
                      v = randn({1, 1, 4, 2}, 23);
  const BlockOut block = block_attention(q, k, v, torch::arange(4), torch::arange(2, 6), true);
  ASSERT_TRUE(torch::isinf(block.lse.select(2, 0)).all().item<bool>())
      << "given block_attention: a query that sees no key has lse -inf";
  torch::Tensor out = torch::full({1, 1, 4, 2}, 7.0f);
  torch::Tensor lse = torch::full({1, 1, 4}, 1.5f);
  merge_block(out, lse, block);
  EXPECT_TENSOR_CLOSE(out.narrow(2, 0, 2), torch::full({1, 1, 2, 2}, 7.0f), kExact);
  EXPECT_TENSOR_CLOSE(lse.narrow(2, 0, 2), torch::full({1, 1, 2}, 1.5f), kExact);
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>()) << out;
  // A running result that has seen nothing takes the block's values.
  torch::Tensor empty_out = torch::zeros({1, 1, 4, 2});
  torch::Tensor empty_lse = torch::full({1, 1, 4}, -kInf);
  merge_block(empty_out, empty_lse, block);
  EXPECT_TENSOR_CLOSE(empty_out, block.out, kExact);
  EXPECT_TENSOR_CLOSE(empty_lse.narrow(2, 2, 2), block.lse.narrow(2, 2, 2), kExact);
  EXPECT_TRUE(torch::isinf(empty_lse.narrow(2, 0, 2)).all().item<bool>());
}

TEST(L10Merge, ScoresInTheThousandsStayFinite) {
  // Scores of order 1e4: exp() overflows fp32 unless each side is shifted by its maximum.
  const Qkv x = inputs(1, 2, 6, 8, 31, /*scale=*/60.0);
  const auto qp = torch::arange(6), kp = torch::arange(6);
  const torch::Tensor want = masked_attention(x.q, x.k, x.v, qp, kp, false);
  torch::Tensor out = torch::zeros({1, 2, 6, 8});
  torch::Tensor lse = torch::full({1, 2, 6}, -kInf);
  for (int64_t begin : {0, 2, 4}) {
    merge_block(out, lse,
                block_attention(x.q, x.k.narrow(2, begin, 2), x.v.narrow(2, begin, 2), qp,
                                kp.narrow(0, begin, 2), false));
  }
  ASSERT_TRUE(torch::isfinite(out).all().item<bool>()) << "merge_block overflowed";
  EXPECT_GT(lse.abs().max().item<float>(), 1000.0f) << "the test's scores are in the thousands";
  EXPECT_TENSOR_CLOSE(out, want, kFp32Op);
}

TEST(L10Merge, MergesIntoAViewOfALargerOutput) {
  // Ring attention merges into some rows of its output (zig-zag): merge_block works in place.
  const Qkv x = inputs(1, 1, 4, 2, 41);
  const auto pos = torch::arange(4);
  torch::Tensor out = torch::zeros({1, 1, 8, 2});
  torch::Tensor lse = torch::full({1, 1, 8}, -kInf);
  torch::Tensor rows = out.narrow(2, 4, 4);
  torch::Tensor rows_lse = lse.narrow(2, 4, 4);
  merge_block(rows, rows_lse, block_attention(x.q, x.k, x.v, pos, pos, false));
  EXPECT_TENSOR_CLOSE(out.narrow(2, 4, 4), masked_attention(x.q, x.k, x.v, pos, pos, false),
                      kFp32Op);
  EXPECT_TENSOR_CLOSE(out.narrow(2, 0, 4), torch::zeros({1, 1, 4, 2}), kExact);
}

// ---------------------------------------------------------------------------------------------
// Part 2: ring attention
// ---------------------------------------------------------------------------------------------

class L10Ring : public ::testing::TestWithParam<int> {};

// The number of (query, key) pairs of rank's rows and src's that the causal mask lets through.
int64_t visible_pairs(const torch::Tensor& qp, const torch::Tensor& kp) {
  return (kp.unsqueeze(0) <= qp.unsqueeze(1)).sum().item<int64_t>();
}

TEST_P(L10Ring, BlockPlanComputesExactlyWhatTheMaskLetsThrough) {
  const int cp = GetParam();
  const int64_t tl = 6, seq = tl * cp;  // 2 cp divides seq: zig-zag chunks of 3
  for (bool zigzag : {false, true}) {
    std::vector<int64_t> work(static_cast<size_t>(cp), 0);
    for (int rank = 0; rank < cp; ++rank) {
      const auto qp = local_positions(seq, rank, cp, zigzag);
      for (int src = 0; src < cp; ++src) {
        SCOPED_TRACE(::testing::Message() << "cp " << cp << (zigzag ? " zig-zag" : " contiguous")
                                          << ", rank " << rank << ", block of rank " << src);
        const auto kp = local_positions(seq, src, cp, zigzag);
        const RingBlock b = ring_block(rank, src, cp, tl, zigzag, /*causal=*/true);
        const int64_t all = visible_pairs(qp, kp);
        if (b.skip) {
          EXPECT_EQ(all, 0) << "skipped a block with visible keys";
          continue;
        }
        ASSERT_GE(b.q_begin, 0);
        ASSERT_GE(b.k_begin, 0);
        ASSERT_LE(b.q_begin + b.q_len, tl);
        ASSERT_LE(b.k_begin + b.k_len, tl);
        const auto q_in = qp.narrow(0, b.q_begin, b.q_len), k_in = kp.narrow(0, b.k_begin, b.k_len);
        EXPECT_EQ(visible_pairs(q_in, k_in), all) << "the range leaves out visible pairs";
        EXPECT_GT(all, 0) << "a block with no visible key must be skipped";
        if (!b.masked) {
          EXPECT_EQ(visible_pairs(q_in, k_in), b.q_len * b.k_len)
              << "masked is false, but some pair in the range is in the future";
        } else {
          EXPECT_LT(visible_pairs(q_in, k_in), b.q_len * b.k_len)
              << "masked is true, but every pair in the range is visible: the mask is work "
                 "(and a kernel that skips it is faster), so set masked only where some query "
                 "must not see some key";
        }
        work[static_cast<size_t>(rank)] += b.q_len * b.k_len;
      }
    }
    for (int rank = 0; rank < cp; ++rank) {
      // Closed forms: contiguous, rank r computes r earlier blocks and its diagonal, (r + 1)
      // Tl^2; zig-zag, its diagonal and half of every other block, (1 + (cp - 1) / 2) Tl^2.
      const int64_t want = zigzag ? tl * tl + (cp - 1) * tl * tl / 2 : (rank + 1) * tl * tl;
      EXPECT_EQ(work[static_cast<size_t>(rank)], want)
          << "scores rank " << rank << " computes, " << (zigzag ? "zig-zag" : "contiguous");
    }
  }
  // Without the causal mask every block is computed whole.
  const RingBlock b = ring_block(0, cp - 1, cp, tl, true, /*causal=*/false);
  EXPECT_FALSE(b.skip);
  EXPECT_EQ(b.q_len * b.k_len, tl * tl);
}

TEST_P(L10Ring, LoopsComputeThePlanForwardAndBackward) {
  // The block observer of the given block_attention and block_attention_backward sees, from
  // outside, the (query rows, key rows) of every block each rank computes. Summed per pass, they
  // must be the closed forms of the plan: contiguous, rank r computes (r + 1) Tl^2 scores;
  // zig-zag, (1 + (cp - 1) / 2) Tl^2 on every rank; without the mask, cp Tl^2. A loop that
  // computes a skipped block, or a whole block where the plan computes half, gives the same
  // values (the mask zeroes what it adds) and does up to twice the work.
  const int cp = GetParam();
  const int64_t tl = 4, T = tl * cp;
  const Qkv x = inputs(1, 2, T, 4, 17);
  for (const auto& [zigzag, causal] :
       std::vector<std::pair<bool, bool>>{{false, true}, {true, true}, {false, false}}) {
    run_ranks(
        cp,
        [&, zigzag = zigzag, causal = causal](RankContext& ctx) {
          int64_t work[2] = {0, 0}, blocks[2] = {0, 0};  // forward, backward
          const BlockObserver previous =
              set_block_observer([&](int64_t q_rows, int64_t k_rows, bool backward) {
                work[backward] += q_rows * k_rows;
                ++blocks[backward];
              });
          auto shard = [&](const torch::Tensor& t) {
            return shard_sequence(t, ctx.rank, cp, zigzag, 2).requires_grad_();
          };
          auto q = shard(x.q), k = shard(x.k), v = shard(x.v);
          ring_attention(q, k, v, *ctx.comm, zigzag, causal).sum().backward();
          set_block_observer(previous);
          const int64_t r = ctx.rank;
          const int64_t want = !causal  ? cp * tl * tl
                               : zigzag ? tl * tl + (cp - 1) * tl * tl / 2
                                        : (r + 1) * tl * tl;
          const int64_t want_blocks = !causal || zigzag ? cp : r + 1;
          for (int pass = 0; pass < 2; ++pass) {
            SCOPED_TRACE(::testing::Message()
                         << "cp " << cp << ", rank " << r << (zigzag ? ", zig-zag" : ", contiguous")
                         << (causal ? ", causal" : "") << (pass ? ", backward" : ", forward"));
            EXPECT_EQ(work[pass], want)
                << "(query, key) scores computed: call the attention on ring_block's ranges "
                   "only, and skip what it skips";
            EXPECT_EQ(blocks[pass], want_blocks) << "blocks computed";
          }
        },
        kTimeout);
  }
}

// Runs ring (or another) attention on cp thread-ranks and compares each rank's rows with the
// unsplit attention's, values and gradients.
void expect_matches_unsplit(Attention kind, int cp, bool zigzag, bool causal, int64_t heads = 2,
                            int64_t T = 0) {
  const int64_t B = 2, D = 4;
  if (T == 0) T = 2 * 3 * cp;
  const Qkv x = inputs(B, heads, T, D, 100 + static_cast<uint64_t>(cp));
  const Reference want = unsplit(x, causal);
  run_ranks(
      cp,
      [&](RankContext& ctx) {
        auto shard = [&](const torch::Tensor& t) {
          return shard_sequence(t, ctx.rank, cp, zigzag, /*dim=*/2);
        };
        auto q = shard(x.q).requires_grad_(), k = shard(x.k).requires_grad_(),
             v = shard(x.v).requires_grad_();
        const torch::Tensor out = context_attention(kind, q, k, v, *ctx.comm, zigzag, causal);
        SCOPED_TRACE(::testing::Message()
                     << attention_name(kind) << ", cp " << cp << ", rank " << ctx.rank
                     << (zigzag ? ", zig-zag" : ", contiguous") << (causal ? ", causal" : ""));
        ASSERT_EQ(out.sizes(), q.sizes());
        EXPECT_TENSOR_CLOSE(out.detach(), shard(want.out), kFp32Op);
        (out * shard(x.w)).sum().backward();
        ASSERT_TRUE(q.grad().defined() && k.grad().defined() && v.grad().defined())
            << "every input needs its gradient";
        EXPECT_TENSOR_CLOSE(q.grad(), shard(want.dq), kFp32Op);
        EXPECT_TENSOR_CLOSE(k.grad(), shard(want.dk), kFp32Op);
        EXPECT_TENSOR_CLOSE(v.grad(), shard(want.dv), kFp32Op);
      },
      kTimeout);
}

TEST_P(L10Ring, MatchesTheUnsplitAttentionContiguous) {
  expect_matches_unsplit(Attention::kRing, GetParam(), false, true);
}
TEST_P(L10Ring, MatchesTheUnsplitAttentionZigzag) {
  expect_matches_unsplit(Attention::kRing, GetParam(), true, true);
}
TEST_P(L10Ring, MatchesTheUnsplitAttentionWithoutMask) {
  expect_matches_unsplit(Attention::kRing, GetParam(), false, false);
}

TEST(L10RingLong, EveryAttentionAtALengthWhereTheScoresDominate) {
  // s = 512 on 4 ranks: the unsplit scores (2 x 2 x 512 x 512) are 64 times q's elements.
  for (Attention kind : {Attention::kRing, Attention::kUlysses, Attention::kAllGather}) {
    expect_matches_unsplit(kind, 4, kind != Attention::kUlysses, true, /*heads=*/4, /*T=*/512);
  }
}

TEST_P(L10Ring, EachRotationIsInFlightWhileItsBlockIsComputed) {
  const int cp = GetParam();
  const Qkv x = inputs(1, 2, 2 * 2 * cp, 4, 7);
  run_ranks(
      cp,
      [&](RankContext& ctx) {
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        const BlockObserver previous = set_block_observer([&](int64_t, int64_t, bool backward) {
          rec->mark(backward ? "backward block" : "forward block");
        });
        auto shard = [&](const torch::Tensor& t) {
          return shard_sequence(t, ctx.rank, cp, true, 2).requires_grad_();
        };
        auto q = shard(x.q), k = shard(x.k), v = shard(x.v);
        ring_attention(q, k, v, *rec, /*zigzag=*/true).sum().backward();
        set_block_observer(previous);
        // Zig-zag: no step is skipped, so each pass has cp blocks. Before the block of every
        // step but the last, the next block's sends are posted and not yet waited for: the
        // event just before the mark is a send, a receive or the end of their group, never a
        // wait.
        for (const char* pass : {"forward block", "backward block"}) {
          const auto events = rec->events();
          int blocks = 0;
          for (size_t i = 0; i < events.size(); ++i) {
            if (events[i].op != "mark" || events[i].label != pass) continue;
            ++blocks;
            if (blocks == cp) break;  // the last step has nothing left to fetch
            ASSERT_GT(i, 0u);
            const std::string before = events[i - 1].op;
            EXPECT_TRUE(before == "send" || before == "recv" || before == "group_end")
                << "rank " << ctx.rank << ", " << pass << " " << blocks << " of " << cp
                << ": the last communication event before it is '" << before
                << "': start the next block's rotation, compute, then wait";
          }
          EXPECT_EQ(blocks, cp) << pass << "s on rank " << ctx.rank;
        }
        // Backward: the dK/dV accumulator sent on at step s travels while step s + 1's block is
        // computed: no wait for its sends before that block.
        const auto events = rec->events();
        std::vector<size_t> marks;
        for (size_t i = 0; i < events.size(); ++i) {
          if (events[i].op == "mark" && events[i].label == "backward block") marks.push_back(i);
        }
        for (size_t m = 1; m < marks.size(); ++m) {
          std::vector<int64_t> grad_calls;  // the gradients' sends (tags 2, 3) and their group
          for (size_t i = marks[m - 1]; i < marks[m]; ++i) {
            const bool grad_send = events[i].op == "send" && events[i].tag >= 2;
            if (grad_send) grad_calls.push_back(events[i].seq);
            if (!grad_calls.empty() && events[i].op == "group_end") {
              grad_calls.push_back(events[i].seq);
            }
          }
          for (size_t i = marks[m - 1]; i < marks[m]; ++i) {
            if (events[i].op != "wait") continue;
            for (int64_t id : grad_calls) {
              EXPECT_NE(events[i].id, id)
                  << "rank " << ctx.rank << ", backward step " << m
                  << ": the dK/dV rotation was waited for before the next block: start it, "
                     "compute the next block, then wait";
            }
          }
        }
      },
      kTimeout);
}

TEST_P(L10Ring, SendsTheClosedFormBytes) {
  // Forward: K and V, cp - 1 rotations of a (B, H, Tl, D) block each, in their own dtype (2
  // bytes an element in bf16: a ring that widens them to fp32 sends twice the bytes). Backward:
  // K and V again, cp - 1 times, and their fp32 gradients cp times (the last brings them home).
  const int cp = GetParam();
  const int64_t B = 1, H = 2, T = 2 * 2 * cp, D = 4, tl = T / cp;
  const Qkv x = inputs(B, H, T, D, 8);
  std::vector<torch::ScalarType> dtypes{torch::kFloat};
  if (kGlooBf16) dtypes.push_back(torch::kBFloat16);  // (LibTorch 1.13's gloo: no bf16)
  for (const torch::ScalarType dtype : dtypes) {
    run_ranks(
        cp,
        [&](RankContext& ctx) {
          SCOPED_TRACE(::testing::Message() << "inputs in " << c10::toString(dtype));
          auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
          auto shard = [&](const torch::Tensor& t) {
            return shard_sequence(t.to(dtype), ctx.rank, cp, false, 2).requires_grad_();
          };
          auto q = shard(x.q), k = shard(x.k), v = shard(x.v);
          auto out = ring_attention(q, k, v, *rec, false);
          const int64_t elements = B * H * tl * D;
          const int64_t block = elements * c10::elementSize(dtype);  // K or V on the wire
          const int64_t grad_block = elements * 4;                   // fp32 dK or dV
          EXPECT_EQ(rec->bytes("send"), 2 * (cp - 1) * block) << "forward, rank " << ctx.rank;
          rec->clear();
          out.sum().backward();
          EXPECT_EQ(rec->bytes("send"), 2 * (cp - 1) * block + 2 * cp * grad_block)
              << "backward, rank " << ctx.rank;
          for (const auto& e : rec->events("send")) {
            EXPECT_EQ(e.peer, (ctx.rank + 1) % cp) << "a ring sends to the next rank only";
          }
        },
        kTimeout);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, L10Ring, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// ---------------------------------------------------------------------------------------------
// Part 3: Ulysses
// ---------------------------------------------------------------------------------------------

class L10Ulysses : public ::testing::TestWithParam<int> {};

TEST_P(L10Ulysses, SequenceToHeadsLayoutAndBack) {
  const int cp = GetParam();
  const int64_t B = 2, H = 2 * cp, T = 3 * cp, D = 2, tl = T / cp;
  const torch::Tensor full = torch::arange(B * H * T * D, torch::kFloat).view({B, H, T, D});
  run_ranks(
      cp,
      [&](RankContext& ctx) {
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        const torch::Tensor mine = full.narrow(2, ctx.rank * tl, tl).contiguous();
        const torch::Tensor heads = seq_to_heads(mine, *rec);
        // Rank r: heads [r H/cp, (r+1) H/cp), every token in order.
        EXPECT_TENSOR_CLOSE(heads, full.narrow(1, ctx.rank * (H / cp), H / cp), kExact);
        EXPECT_TENSOR_CLOSE(heads_to_seq(heads, *rec), mine, kExact);
        EXPECT_EQ(rec->events("alltoall").size(), 2u) << "one alltoall each way";
      },
      kTimeout);
}

TEST_P(L10Ulysses, MatchesTheUnsplitAttention) {
  expect_matches_unsplit(Attention::kUlysses, GetParam(), false, true, /*heads=*/GetParam() * 2);
}

TEST_P(L10Ulysses, SendsTheClosedFormBytes) {
  // Four all-to-alls each way (q, k, v, the output), each of this rank's b (s/cp) h elements;
  // a rank keeps 1/cp of each. The recorder counts a call's input bytes, own slice included.
  const int cp = GetParam();
  const int64_t B = 1, H = 2 * cp, T = 2 * cp, D = 2, tl = T / cp;
  const Qkv x = inputs(B, H, T, D, 9);
  run_ranks(
      cp,
      [&](RankContext& ctx) {
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        auto shard = [&](const torch::Tensor& t) {
          return shard_sequence(t, ctx.rank, cp, false, 2).requires_grad_();
        };
        auto q = shard(x.q), k = shard(x.k), v = shard(x.v);
        auto out = ulysses_attention(q, k, v, *rec, false);
        const int64_t each = B * H * tl * D * 4;
        EXPECT_EQ(rec->events("alltoall").size(), 4u);
        EXPECT_EQ(rec->bytes("alltoall"), 4 * each);
        rec->clear();
        out.sum().backward();
        EXPECT_EQ(rec->events("alltoall").size(), 4u);
        EXPECT_EQ(rec->bytes("alltoall"), 4 * each);
      },
      kTimeout);
}

TEST(L10UlyssesGiven, HeadsMustSplit) {
  run_ranks(
      2,
      [](RankContext& ctx) {
        EXPECT_THROW(seq_to_heads(torch::zeros({1, 3, 2, 2}), *ctx.comm), std::invalid_argument);
      },
      kTimeout);
}

INSTANTIATE_TEST_SUITE_P(Ranks, L10Ulysses, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// ---------------------------------------------------------------------------------------------
// Part 4: all-gather KV
// ---------------------------------------------------------------------------------------------

class L10AllGather : public ::testing::TestWithParam<int> {};

TEST_P(L10AllGather, GathersTheSequenceAndSumsTheGradient) {
  const int cp = GetParam();
  const int64_t B = 1, H = 2, T = 2 * cp, D = 3, tl = T / cp;
  const torch::Tensor full = torch::arange(B * H * T * D, torch::kFloat).view({B, H, T, D});
  run_ranks(
      cp,
      [&](RankContext& ctx) {
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        auto mine = full.narrow(2, ctx.rank * tl, tl).clone().requires_grad_();
        const torch::Tensor all = gather_sequence(mine, *rec);
        EXPECT_TENSOR_CLOSE(all.detach(), full, kExact);
        EXPECT_EQ(rec->events("allgather").size(), 1u) << "one allgather forward";
        rec->clear();
        // Rank r's upstream gradient is (r + 1) (t + 1) at gathered row t: each rank's row t
        // gets the sum over the ranks, cp (cp + 1) / 2 (t + 1), exactly, so a row sent to the
        // wrong rank or summed into the wrong place shows.
        const torch::Tensor row = torch::arange(1, T + 1, torch::kFloat).view({1, 1, T, 1});
        (all * row * static_cast<float>(ctx.rank + 1)).sum().backward();
        ASSERT_TRUE(mine.grad().defined());
        const torch::Tensor want =
            (row.narrow(2, ctx.rank * tl, tl) * (cp * (cp + 1) / 2.0f)).expand({B, H, tl, D});
        EXPECT_TENSOR_CLOSE(mine.grad(), want, kExact);
        EXPECT_EQ(rec->events("alltoall").size(), 1u) << "one alltoall backward";
      },
      kTimeout);
}

TEST_P(L10AllGather, SendsTheClosedFormBytes) {
  // Forward: one allgather each of K and V, this rank's (B, H, Tl, D) block as its input (the
  // ring all-gather puts cp - 1 of them on the wire: 2 (cp-1) b s h / cp). Backward: one
  // all-to-all each of the gathered gradients, cp blocks of which cp - 1 leave the rank.
  const int cp = GetParam();
  const int64_t B = 1, H = 2, T = 2 * cp, D = 2, tl = T / cp;
  const Qkv x = inputs(B, H, T, D, 10);
  run_ranks(
      cp,
      [&](RankContext& ctx) {
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        auto shard = [&](const torch::Tensor& t) {
          return shard_sequence(t, ctx.rank, cp, false, 2).requires_grad_();
        };
        auto q = shard(x.q), k = shard(x.k), v = shard(x.v);
        auto out = allgather_attention(q, k, v, *rec, false);
        const int64_t block = B * H * tl * D * 4;
        EXPECT_EQ(rec->events("allgather").size(), 2u) << "K and V";
        EXPECT_EQ(rec->bytes("allgather"), 2 * block);
        rec->clear();
        out.sum().backward();
        EXPECT_EQ(rec->events("alltoall").size(), 2u) << "dK and dV";
        EXPECT_EQ(rec->bytes("alltoall"), 2 * cp * block);
      },
      kTimeout);
}

TEST_P(L10AllGather, MatchesTheUnsplitAttentionContiguous) {
  expect_matches_unsplit(Attention::kAllGather, GetParam(), false, true);
}
TEST_P(L10AllGather, MatchesTheUnsplitAttentionZigzag) {
  expect_matches_unsplit(Attention::kAllGather, GetParam(), true, true);
}

INSTANTIATE_TEST_SUITE_P(Ranks, L10AllGather, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// ---------------------------------------------------------------------------------------------
// Against PyTorch: scaled_dot_product_attention (tests/reference/lesson10_sdpa.py)
// ---------------------------------------------------------------------------------------------

// The reference script's inputs, by its formula, in fp32.
torch::Tensor field(const std::vector<int64_t>& shape, bool cosine, double scale, double shift) {
  auto x = torch::zeros(shape, torch::kDouble);
  auto a = x.accessor<double, 4>();
  for (int64_t b = 0; b < shape[0]; ++b)
    for (int64_t h = 0; h < shape[1]; ++h)
      for (int64_t t = 0; t < shape[2]; ++t)
        for (int64_t d = 0; d < shape[3]; ++d) {
          const double arg = scale * static_cast<double>(1 + 131 * b + 17 * h + 3 * t + d) + shift;
          a[b][h][t][d] = cosine ? std::cos(arg) : std::sin(arg);
        }
  return x.to(torch::kFloat);
}

class L10VsPyTorch : public ::testing::TestWithParam<int> {};

TEST_P(L10VsPyTorch, EveryAttentionGivesSdpasValuesAndGradients) {
  const int cp = GetParam();
  std::ifstream in(source_path("tests/reference/lesson10_sdpa.json"));
  ASSERT_TRUE(in.good()) << "tests/reference/lesson10_sdpa.json (tests/reference/lesson10_sdpa.py)";
  const nlohmann::json ref = nlohmann::json::parse(in);
  const auto shape = ref.at("shape").get<std::vector<int64_t>>();
  auto tensor = [&](const char* key) {
    return torch::tensor(ref.at(key).get<std::vector<double>>(), torch::kDouble)
        .view(shape)
        .to(torch::kFloat);
  };
  const Qkv x{field(shape, false, 0.37, 0), field(shape, true, 0.29, 0),
              field(shape, false, 0.11, 0.5), field(shape, true, 0.23, 0)};
  const torch::Tensor out = tensor("out"), dq = tensor("dq"), dk = tensor("dk"), dv = tensor("dv");
  for (Attention kind : {Attention::kRing, Attention::kUlysses, Attention::kAllGather}) {
    for (bool zigzag : {false, true}) {
      if (kind == Attention::kUlysses && (zigzag || shape[1] % cp != 0)) continue;
      run_ranks(
          cp,
          [&](RankContext& ctx) {
            auto shard = [&](const torch::Tensor& t) {
              return shard_sequence(t, ctx.rank, cp, zigzag, 2);
            };
            auto q = shard(x.q).requires_grad_(), k = shard(x.k).requires_grad_(),
                 v = shard(x.v).requires_grad_();
            const torch::Tensor y = context_attention(kind, q, k, v, *ctx.comm, zigzag);
            (y * shard(x.w)).sum().backward();
            SCOPED_TRACE(::testing::Message() << attention_name(kind) << ", cp " << cp << ", rank "
                                              << ctx.rank << (zigzag ? ", zig-zag" : ""));
            EXPECT_TENSOR_CLOSE(y.detach(), shard(out), kFp32VsPyTorch);
            EXPECT_TENSOR_CLOSE(q.grad(), shard(dq), kFp32VsPyTorch);
            EXPECT_TENSOR_CLOSE(k.grad(), shard(dk), kFp32VsPyTorch);
            EXPECT_TENSOR_CLOSE(v.grad(), shard(dv), kFp32VsPyTorch);
          },
          kTimeout);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, L10VsPyTorch, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// ---------------------------------------------------------------------------------------------
// Given: the split and its checks
// ---------------------------------------------------------------------------------------------

TEST(L10Given, LocalPositions) {
  EXPECT_TENSOR_CLOSE(local_positions(8, 1, 2, false), torch::arange(4, 8), kExact);
  // Zig-zag, cp 2, 8 tokens: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_TENSOR_CLOSE(local_positions(8, 0, 2, true), torch::tensor({0, 1, 6, 7}), kExact);
  EXPECT_TENSOR_CLOSE(local_positions(8, 1, 2, true), torch::tensor({2, 3, 4, 5}), kExact);
}

TEST(L10Given, ValidateNamesTheFlagToFix) {
  auto flag_of = [](int64_t seq, int64_t heads, int cp, Attention kind, bool zigzag) {
    try {
      validate_cp(seq, heads, cp, kind, zigzag);
    } catch (const UsageError& e) {
      return e.subject();
    }
    return std::string("none");
  };
  EXPECT_EQ(flag_of(64, 4, 2, Attention::kRing, true), "none");
  EXPECT_EQ(flag_of(63, 4, 3, Attention::kRing, false), "none");  // odd splits where they divide
  EXPECT_EQ(flag_of(64, 4, 3, Attention::kRing, false), "--seq");
  EXPECT_EQ(flag_of(60, 4, 4, Attention::kAllGather, true), "--seq");  // 2 cp = 8 chunks
  EXPECT_EQ(flag_of(64, 4, 8, Attention::kUlysses, false), "--heads");
  EXPECT_EQ(flag_of(64, 4, 2, Attention::kUlysses, true), "--zigzag");
  EXPECT_EQ(flag_of(64, 4, 0, Attention::kRing, false), "--cp");
}

}  // namespace
}  // namespace dtc::l10

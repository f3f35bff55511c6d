// Lesson 13: expert parallelism against the single-device MoE, seen from outside the learner's
// code: what each rank's experts were given (MoeLayerImpl::on_experts, called by the given
// layer), what went through the ep group (a RecordingComm's per-peer bytes), one step's
// gradients and the parameters after several steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>

#include "digest_close.h"
#include "dtc/data.h"
#include "dtc/errors.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "moe.h"

namespace dtc::l13 {
namespace {

using test::kTimeout;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A float field from an explicit formula, so each row says where it came from.
torch::Tensor field(int64_t rows, int64_t cols, double scale, double shift) {
  const torch::Tensor r = torch::arange(rows, torch::kDouble).unsqueeze(1);
  const torch::Tensor c = torch::arange(cols, torch::kDouble).unsqueeze(0);
  return torch::sin(scale * (1 + 3 * r + c) + shift).to(torch::kFloat);
}

/// A routing of @p n tokens to @p k of @p e experts from @p pick(t, j), all kept, weights from a
/// formula (with autograd when @p grad).
Routing routing_of(int64_t n, int64_t k, const std::function<int64_t(int64_t, int64_t)>& pick,
                   bool grad = false) {
  Routing r;
  r.experts = torch::empty({n, k}, torch::kLong);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) r.experts[t][j] = pick(t, j);
  }
  r.weights = (0.5 + 0.25 * field(n, k, 0.7, 0.1)).detach().requires_grad_(grad);
  r.keep = torch::ones({n, k}, torch::kBool);
  return r;
}

/// The MoE layer of a one-layer model, initialised by name as make_moe_gpt() does.
MoeLayer make_layer(int64_t hidden, const MoeConfig& moe, uint64_t seed) {
  GptConfig g;
  g.hidden = hidden;
  g.heads = 1;
  g.layers = 1;
  MoeLayer layer(g, moe);
  torch::NoGradGuard no_grad;
  for (auto& p : layer->named_parameters()) {
    const std::string name = "h.0.mlp." + p.key();
    torch::Tensor flat = p.value().view({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) flat[i] = init_value(seed, name, i, 1);
  }
  return layer;
}

// ---------------------------------------------------------------------------------------------
// 1. The all-to-all with uneven splits, and its backward
// ---------------------------------------------------------------------------------------------

// Rank r sends (r + 2q) % 3 rows to rank q (zero rows to some ranks), each row [r, q, i, 0.5]:
// each rank must receive from q exactly q's rows for it, in rank order; the gradient of a
// weighted sum comes back to the rows that were sent.
TEST(L13AllToAll, UnevenSplitsAndBackward) {
  for (int world : test::kWorlds) {
    run_ranks(
        world,
        [&](RankContext& ctx) {
          const int r = ctx.rank;
          auto rows = [&](int from, int to) -> int64_t { return (from + 2 * to) % 3; };
          std::vector<int64_t> send, recv;
          std::vector<torch::Tensor> parts;
          for (int q = 0; q < world; ++q) {
            send.push_back(rows(r, q));
            recv.push_back(rows(q, r));
            for (int64_t i = 0; i < rows(r, q); ++i) {
              parts.push_back(torch::tensor({double(r), double(q), double(i), 0.5}).unsqueeze(0));
            }
          }
          torch::Tensor x =
              (parts.empty() ? torch::zeros({0, 4}, torch::kDouble) : torch::cat(parts))
                  .to(torch::kFloat)
                  .requires_grad_(true);
          const torch::Tensor y = all_to_all(x, send, recv, *ctx.comm);
          int64_t at = 0;
          ASSERT_EQ(y.size(0), std::accumulate(recv.begin(), recv.end(), int64_t{0}))
              << "world " << world;
          for (int q = 0; q < world; ++q) {
            for (int64_t i = 0; i < rows(q, r); ++i, ++at) {
              EXPECT_TRUE(
                  torch::equal(y[at].detach(), torch::tensor({float(q), float(r), float(i), 0.5f})))
                  << "world " << world << " rank " << r << ": row " << at << " should be rank " << q
                  << "'s row " << i << " for it, got " << y[at];
            }
          }
          // loss = sum(y * (1 + row index)): each sent row's gradient is its destination's weight
          const torch::Tensor w = torch::arange(1, y.size(0) + 1, torch::kFloat).unsqueeze(1);
          (y * w).sum().backward();
          ASSERT_TRUE(x.grad().defined()) << "the all-to-all's backward did not reach x";
          at = 0;
          for (int q = 0; q < world; ++q) {
            // on rank q, rank r's rows start after the rows of ranks before r
            int64_t first = 1;
            for (int s = 0; s < r; ++s) first += rows(s, q);
            for (int64_t i = 0; i < rows(r, q); ++i, ++at) {
              EXPECT_FLOAT_EQ(x.grad()[at][0].item<float>(), static_cast<float>(first + i))
                  << "world " << world << " rank " << r << ": the gradient of the row sent to rank "
                  << q << " must come back from there (the all-to-all with the splits swapped)";
            }
          }
        },
        kTimeout);
  }
}

// ---------------------------------------------------------------------------------------------
// 2. The counts
// ---------------------------------------------------------------------------------------------

TEST(L13Counts, EachRankLearnsWhatItReceives) {
  for (int world : test::kWorlds) {
    for (int64_t local : {1, 2}) {
      const int64_t e = world * local;
      run_ranks(
          world,
          [&](RankContext& ctx) {
            auto count = [&](int from, int64_t expert) -> int64_t {
              return (7 * from + 3 * expert) % 5;  // zeros among them
            };
            torch::Tensor send = torch::empty({e}, torch::kLong);
            for (int64_t x = 0; x < e; ++x) send[x] = count(ctx.rank, x);
            const torch::Tensor got = exchange_counts(send, *ctx.comm);
            ASSERT_EQ(got.sizes().vec(), (std::vector<int64_t>{world, local}));
            for (int q = 0; q < world; ++q) {
              for (int64_t j = 0; j < local; ++j) {
                EXPECT_EQ(got[q][j].item<int64_t>(), count(q, ctx.rank * local + j))
                    << "world " << world << " rank " << ctx.rank << ": what rank " << q
                    << " sends to local expert " << j;
              }
            }
          },
          kTimeout);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Dispatch and combine: the right copies reach each expert, and come back in place
// ---------------------------------------------------------------------------------------------

struct Case {
  std::string name;
  int world;
  int64_t experts;
  int64_t k;
  /// tokens on rank r
  std::function<int64_t(int)> tokens;
  /// expert of rank r's token t, choice j
  std::function<int64_t(int, int64_t, int64_t)> pick;
};

std::vector<Case> routing_cases() {
  std::vector<Case> cases;
  for (int world : test::kWorlds) {
    const int64_t e = 2 * world;
    cases.push_back({"random", world, e, 2, [](int r) { return 5 + 2 * r; },
                     [e](int r, int64_t t, int64_t j) {
                       std::mt19937_64 g(1000 * r + 10 * t);
                       const int64_t first = static_cast<int64_t>(g() % e);
                       return j == 0 ? first
                                     : (first + 1 + static_cast<int64_t>(g() % (e - 1))) % e;
                     }});
    const int64_t e3 = 3 * world;
    cases.push_back({"three_experts_per_rank", world, e3, 3, [](int r) { return 4 + r; },
                     [e3](int r, int64_t t, int64_t j) { return (5 * r + 7 * t + 4 * j) % e3; }});
    cases.push_back({"all_to_one_expert", world, e, 1, [](int) { return 6; },
                     [e](int, int64_t, int64_t) { return e - 1; }});
    cases.push_back({"an_expert_with_none", world, e, 2, [](int) { return 4; },
                     [e](int r, int64_t t, int64_t j) { return 1 + (r + t + j) % (e - 1); }});
    cases.push_back({"a_rank_with_no_tokens", world, e, 2, [](int r) { return r == 1 ? 0 : 5; },
                     [e](int r, int64_t t, int64_t j) { return (r + 3 * t + j) % e; }});
  }
  return cases;
}

// Each token row encodes (rank, token): [r, t, sin(...)...]. The experts are the identity, so
// combine must give back sum_j w_j x_t; what each local expert was given must be exactly the
// copies that chose it, from every rank.
TEST(L13Dispatch, RoundTripUnderAdversarialRoutings) {
  const int64_t h = 6;
  for (const Case& c : routing_cases()) {
    const int64_t local = c.experts / c.world;
    // from outside: the (rank, token) pairs each expert must receive
    std::map<int64_t, std::multiset<std::pair<int, int64_t>>> want;
    for (int r = 0; r < c.world; ++r) {
      for (int64_t t = 0; t < c.tokens(r); ++t) {
        for (int64_t j = 0; j < c.k; ++j) want[c.pick(r, t, j)].insert({r, t});
      }
    }
    for (int64_t x = 0; x < c.experts; ++x) want[x];  // every expert's entry, before the threads
    run_ranks(
        c.world,
        [&](RankContext& ctx) {
          const int r = ctx.rank;
          const int64_t n = c.tokens(r);
          torch::Tensor x = torch::cat({torch::full({n, 1}, double(r)),
                                        torch::arange(n, torch::kDouble).unsqueeze(1),
                                        field(n, h - 2, 0.3, r).to(torch::kDouble)},
                                       1)
                                .to(torch::kFloat)
                                .requires_grad_(true);
          const Routing routing = routing_of(
              n, c.k, [&](int64_t t, int64_t j) { return c.pick(r, t, j); }, true);
          const Dispatch d = dispatch(x, routing, c.experts, *ctx.comm);
          const std::string where =
              c.name + ", world " + std::to_string(c.world) + ", rank " + std::to_string(r);
          ASSERT_EQ(static_cast<int64_t>(d.tokens_per_expert.size()), local) << where;
          int64_t row = 0;
          for (int64_t j = 0; j < local; ++j) {
            std::multiset<std::pair<int, int64_t>> got;
            for (int64_t i = 0; i < d.tokens_per_expert[j]; ++i, ++row) {
              ASSERT_LT(row, d.tokens.size(0)) << where;
              got.insert({static_cast<int>(d.tokens[row][0].item<float>()),
                          static_cast<int64_t>(d.tokens[row][1].item<float>())});
            }
            EXPECT_EQ(got, want.at(r * local + j))
                << where << ": local expert " << j << " (expert " << r * local + j
                << ") must get exactly the copies that chose it, from every rank";
          }
          EXPECT_EQ(row, d.tokens.size(0)) << where;
          // identity experts: the round trip is sum_j w_j x
          const torch::Tensor y = combine(d.tokens * 1.0, d, routing, *ctx.comm);
          const torch::Tensor expect = x.detach() * routing.weights.detach().sum(1, true);
          EXPECT_TRUE(torch::allclose(y.detach(), expect, 1e-6, 1e-6))
              << where << ": dispatch then combine must give back sum_j w_j x_t for each token";
          // and its backward: d(sum y)/dx = sum_j w_j, d/dw_j = sum of x_t
          y.sum().backward();
          if (n > 0) {
            EXPECT_TRUE(torch::allclose(
                x.grad(), routing.weights.detach().sum(1, true).expand({n, h}), 1e-6, 1e-6))
                << where << ": the gradient through both all-to-alls";
            EXPECT_TRUE(torch::allclose(routing.weights.grad(),
                                        x.detach().sum(1, true).expand({n, c.k}), 1e-5, 1e-5))
                << where << ": the router weights' gradient (each weight applied once)";
          }
        },
        kTimeout);
  }
}

// Dropped copies (routing.keep false) are not sent, and contribute nothing.
TEST(L13Dispatch, DroppedCopiesStayHome) {
  run_ranks(
      2,
      [&](RankContext& ctx) {
        const int64_t n = 4, h = 3;
        const torch::Tensor x = field(n, h, 0.5, ctx.rank);
        Routing routing = routing_of(n, 2, [](int64_t t, int64_t j) { return (t + j) % 4; });
        routing.keep[1][0] = false;
        routing.keep[2][1] = false;
        const Dispatch d = dispatch(x, routing, 4, *ctx.comm);
        EXPECT_EQ(d.tokens.size(0), 6) << "two ranks each send 6 of their 8 copies";
        const torch::Tensor y = combine(d.tokens.clone(), d, routing, *ctx.comm);
        const torch::Tensor w = routing.weights.detach() * routing.keep.to(torch::kFloat);
        EXPECT_TRUE(torch::allclose(y, x * w.sum(1, true), 1e-6, 1e-6))
            << "a dropped copy contributes nothing to its token";
      },
      kTimeout);
}

// ---------------------------------------------------------------------------------------------
// 4. The bytes on the wire, recorded from outside
// ---------------------------------------------------------------------------------------------

// One layer forward and backward on ep 4: the token all-to-alls send each rank exactly the rows
// of its copies for that rank's experts, h x 4 bytes each, in the forward (dispatch, combine) and
// the backward (the same two); the counts all-to-all E/P int64 to each rank.
TEST(L13Bytes, EachPeerGetsItsCopiesAndNoMore) {
  const int world = 4;
  const int64_t h = 8;
  MoeConfig moe;
  moe.experts = 8;
  moe.top_k = 2;
  run_ranks(
      world,
      [&](RankContext& ctx) {
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        MoeLayer layer = make_layer(h, moe, 3);
        layer->shard_experts(rec.get());
        const torch::Tensor x = field(6 + ctx.rank, h, 0.9, ctx.rank).requires_grad_(true);
        const torch::Tensor y = layer->forward(x.unsqueeze(0));
        // from the given router's choices: copies this rank sends to each rank
        std::vector<int64_t> copies(world, 0);
        const torch::Tensor chosen = layer->stats.counts;  // per expert, this rank's choices
        for (int64_t e = 0; e < moe.experts; ++e) copies[e / 2] += chosen[e].item<int64_t>();
        (y * field(6 + ctx.rank, h, 0.4, 1).unsqueeze(0)).sum().backward();
        const auto events = rec->events("alltoall");
        ASSERT_EQ(events.size(), 5u)
            << "one forward and backward: the counts, the tokens out, the results back (forward), "
               "then the results' gradients out and the tokens' gradients back (backward); "
               "got "
            << events.size() << " all-to-alls";
        EXPECT_EQ(events[0].sent_to, std::vector<int64_t>(world, 2 * 8))
            << "the counts: E/P = 2 int64 to each rank";
        std::vector<int64_t> tokens_out(world);
        for (int q = 0; q < world; ++q) tokens_out[q] = copies[q] * h * 4;
        EXPECT_EQ(events[1].sent_to, tokens_out)
            << "dispatch: each copy's row to its expert's rank";
        EXPECT_EQ(events[3].sent_to, tokens_out)
            << "backward of combine: each result's gradient back to the expert's rank";
        EXPECT_EQ(events[2].sent_to, events[4].sent_to)
            << "combine's results and dispatch's gradients go back along the same splits";
        // combine returns to each rank what it sent here: over all ranks, as many bytes each way
        int64_t back = 0, forth = 0;
        for (int q = 0; q < world; ++q) {
          back += events[2].sent_to[q];
          forth += events[1].sent_to[q];
        }
        std::vector<torch::Tensor> t{torch::tensor({back, forth})};
        ctx.comm->allreduce(t)->wait();
        EXPECT_EQ(t[0][0].item<int64_t>(), t[0][1].item<int64_t>())
            << "combine sends back, over all ranks, as many rows as dispatch sent";
      },
      kTimeout);
}

// Uniform routing (token t's j-th choice expert (t k + j) mod E): the token all-to-alls of one
// forward and backward send the closed form, N k h 4 bytes (ep - 1) / ep each way, forward and
// backward: 4 N k h 4 (ep - 1) / ep to the other ranks; the counts E/P int64 to each.
TEST(L13Bytes, UniformRoutingSendsTheClosedForm) {
  for (int world : {2, 4}) {
    const int64_t n = 8, k = 2, e = 8, h = 5;
    run_ranks(
        world,
        [&](RankContext& ctx) {
          auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
          const torch::Tensor x = field(n, h, 0.3, ctx.rank).requires_grad_(true);
          const Routing routing =
              routing_of(n, k, [&](int64_t t, int64_t j) { return (t * k + j) % e; });
          const Dispatch d = dispatch(x, routing, e, *rec);
          combine(d.tokens * 2.0, d, routing, *rec).sum().backward();
          const auto events = rec->events("alltoall");
          ASSERT_EQ(events.size(), 5u);
          int64_t tokens = 0, counts = 0;
          for (size_t i = 0; i < events.size(); ++i) {
            for (int q = 0; q < world; ++q) {
              if (q != ctx.rank)
                (i == 0 ? counts : tokens) += events[i].sent_to[static_cast<size_t>(q)];
            }
          }
          EXPECT_EQ(tokens, 4 * n * k * h * 4 * (world - 1) / world)
              << world << " ranks: 4 N k h 4 (ep-1)/ep bytes (closed form)";
          EXPECT_EQ(counts, (e / world) * 8 * (world - 1))
              << "the counts: E/P int64 to each other rank";
          EXPECT_EQ(counts + tokens, rec->alltoall_bytes_to_others());
        },
        kTimeout);
  }
}

// ---------------------------------------------------------------------------------------------
// 5. The layer against the single-device MoE
// ---------------------------------------------------------------------------------------------

// Rank r's tokens through the expert-parallel layer give what the single-device layer gives for
// them (with a capacity, computed on each rank's own tokens, too), and the gradients: x's and the
// router's locally; the experts', summed over the ranks, the single-device gradient of the sum
// of the ranks' losses.
TEST(L13Layer, MatchesTheSingleDeviceMoe) {
  const int64_t h = 8;
  for (int world : {2, 4}) {
    for (double capacity : {0.0, 1.0}) {
      MoeConfig moe;
      moe.experts = 4;
      moe.top_k = 2;
      moe.capacity_factor = capacity;
      moe.shared = 1;
      run_ranks(
          world,
          [&](RankContext& ctx) {
            const int r = ctx.rank;
            const torch::Tensor x = field(5 + 2 * r, h, 0.37, r);
            const torch::Tensor wgt = field(5 + 2 * r, h, 0.23, 1 + r);
            // single device, this rank's tokens
            MoeLayer one = make_layer(h, moe, 7);
            const torch::Tensor x1 = x.clone().requires_grad_(true);
            const torch::Tensor y1 = one->forward(x1.unsqueeze(0));
            (y1 * wgt.unsqueeze(0)).sum().backward();
            // expert parallel
            MoeLayer par = make_layer(h, moe, 7);
            par->shard_experts(ctx.comm.get());
            const torch::Tensor x2 = x.clone().requires_grad_(true);
            const torch::Tensor y2 = par->forward(x2.unsqueeze(0));
            (y2 * wgt.unsqueeze(0)).sum().backward();
            const std::string where = "world " + std::to_string(world) + ", capacity " +
                                      std::to_string(capacity) + ", rank " + std::to_string(r);
            EXPECT_TRUE(torch::allclose(y2, y1, 1e-5, 1e-6)) << where << ": the output";
            EXPECT_TRUE(torch::allclose(x2.grad(), x1.grad(), 1e-5, 1e-6))
                << where << ": x's gradient";
            EXPECT_TRUE(
                torch::allclose(par->router->weight.grad(), one->router->weight.grad(), 1e-5, 1e-6))
                << where << ": the router's gradient (transformers#48687: wrong under EP)";
            // the single-device expert gradients of every rank's loss, summed: what each EP rank's
            // experts must hold, their rows
            for (auto& p : one->named_parameters()) {
              if (p.key().rfind("experts.", 0) != 0) continue;
              std::vector<torch::Tensor> sum{p.value().grad().clone()};
              ctx.comm->allreduce(sum)->wait();
              const int64_t local = moe.experts / world;
              const torch::Tensor mine = sum[0].narrow(0, r * local, local);
              const torch::Tensor got = par->named_parameters()[p.key()].grad();
              EXPECT_TRUE(torch::allclose(got, mine, 1e-5, 1e-6))
                  << where << ": " << p.key()
                  << "'s gradient on its ep rank: every rank's copies' contributions";
            }
          },
          kTimeout);
    }
  }
}

// The contrast (given code): tensor-parallel experts over the same group compute the same
// function, hold as much, and send more: every token to every rank, (P - 1) N h 4 bytes each way
// and each pass, against ep's N k h 4 (P - 1) / P under uniform routing.
TEST(L13ExpertTpGiven, SameFunctionOtherBytes) {
  const int64_t h = 8, n = 6;
  for (int world : {2, 4}) {
    MoeConfig moe;
    moe.experts = 4;
    moe.top_k = 2;
    run_ranks(
        world,
        [&](RankContext& ctx) {
          const int r = ctx.rank;
          const torch::Tensor x = field(n, h, 0.37, r);
          const torch::Tensor wgt = field(n, h, 0.23, 1 + r);
          MoeLayer one = make_layer(h, moe, 7);
          const torch::Tensor x1 = x.clone().requires_grad_(true);
          const torch::Tensor y1 = one->forward(x1.unsqueeze(0));
          (y1 * wgt.unsqueeze(0)).sum().backward();
          auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
          MoeLayer tp = make_layer(h, moe, 7);
          tp->split_experts(rec.get());
          const torch::Tensor x2 = x.clone().requires_grad_(true);
          const torch::Tensor y2 = tp->forward(x2.unsqueeze(0));
          (y2 * wgt.unsqueeze(0)).sum().backward();
          const std::string where =
              "world " + std::to_string(world) + ", rank " + std::to_string(r);
          EXPECT_TRUE(torch::allclose(y2, y1, 1e-5, 1e-6)) << where << ": the output";
          EXPECT_TRUE(torch::allclose(x2.grad(), x1.grad(), 1e-5, 1e-6)) << where;
          EXPECT_TRUE(
              torch::allclose(tp->router->weight.grad(), one->router->weight.grad(), 1e-5, 1e-6))
              << where << ": the router";
          EXPECT_TRUE(torch::allclose(tp->experts->c_proj->bias.grad(),
                                      one->experts->c_proj->bias.grad(), 1e-5, 1e-6))
              << where << ": c_proj's bias, added on the token's rank";
          // the hidden slices: every rank's tokens went through them
          std::vector<torch::Tensor> sum{one->experts->c_fc->weight.grad().clone()};
          ctx.comm->allreduce(sum)->wait();
          const int64_t w = 4 * h / world;
          EXPECT_TRUE(torch::allclose(tp->experts->c_fc->weight.grad(), sum[0].narrow(1, r * w, w),
                                      1e-5, 1e-6))
              << where << ": c_fc's slice, from the whole group's tokens";
          // memory: the ep layout's E/P whole experts, plus c_proj's bias whole on every rank
          auto bytes = [](MoeLayer& m) {
            int64_t b = 0;
            for (const auto& p : m->experts->parameters()) b += p.numel() * 4;
            return b;
          };
          MoeLayer ep = make_layer(h, moe, 7);
          ep->shard_experts(ctx.comm.get());
          EXPECT_EQ(bytes(tp), bytes(ep) + (moe.experts - moe.experts / world) * h * 4) << where;
          // bytes: the tokens out (the first all-to-all) and the partial outputs back (the fifth)
          const auto events = rec->events("alltoall");
          ASSERT_GE(events.size(), 5u);
          for (size_t i : {size_t{0}, size_t{4}}) {
            int64_t others = 0;
            for (int q = 0; q < world; ++q) {
              if (q != r) others += events[i].sent_to[static_cast<size_t>(q)];
            }
            EXPECT_EQ(others, (world - 1) * n * h * 4) << where << ": all-to-all " << i;
          }
        },
        kTimeout);
  }
}

// ---------------------------------------------------------------------------------------------
// 6. Training against the single-device MoE: one step's gradients, then the parameters
// ---------------------------------------------------------------------------------------------

RunConfig small_run() {
  RunConfig run;
  run.model.layers = 2;
  run.model.hidden = 32;
  run.model.heads = 2;
  run.model.ctx = 16;
  run.batch = 8;
  run.seed = 1;
  return run;
}

struct Trained {
  std::map<std::string, torch::Tensor> params;  // the full model's, stitched
  std::map<std::string, torch::Tensor> grads;   // after the first step's reduction
  std::vector<MoeStep> steps;
  std::vector<int64_t> expert_rows;  // rows each rank's experts got in the first forward
};

/// Trains @p steps steps on @p world ranks, ep @p ep, and stitches every parameter and the first
/// step's reduced gradients back into the full model's.
Trained train(int world, int ep, const MoeConfig& moe, int64_t steps) {
  Trained out;
  std::mutex mu;
  out.expert_rows.assign(static_cast<size_t>(world), 0);
  const RunConfig run = small_run();
  run_ranks(
      world,
      [&](RankContext& ctx) {
        MoeGroups g = make_moe_groups(ctx.store, ctx.rank, world, ep, BackendKind::kGloo, kTimeout);
        MoeTrainer trainer(run, moe, g);
        for (int64_t i = 0; i < run.model.layers; ++i) {
          moe_layer(trainer.model(), i).on_experts =
              [&, rank = ctx.rank](const torch::Tensor& tokens, const std::vector<int64_t>&) {
                std::lock_guard<std::mutex> lock(mu);
                out.expert_rows[static_cast<size_t>(rank)] += tokens.size(0);
              };
        }
        std::vector<std::pair<std::string, torch::Tensor>> grads;
        trainer.after_reduce = [&] {
          if (!grads.empty()) return;
          for (const auto& [name, p] : trainer.named_parameters())
            grads.emplace_back(name, p.grad().clone());
          for (int64_t i = 0; i < run.model.layers; ++i)
            moe_layer(trainer.model(), i).on_experts = nullptr;
        };
        std::vector<MoeStep> mine;
        for (int64_t s = 0; s < steps; ++s) mine.push_back(trainer.step(s));
        std::lock_guard<std::mutex> lock(mu);
        if (ctx.rank == 0) out.steps = mine;
        if (ctx.rank >= ep) return;  // the first ep group holds every expert once
        const int64_t local = moe.experts / ep;
        auto put = [&](std::map<std::string, torch::Tensor>& into, const std::string& name,
                       const torch::Tensor& t) {
          if (!is_expert(name)) {
            if (ctx.rank == 0) into[name] = t.detach().clone();
            return;
          }
          std::vector<int64_t> sizes = t.sizes().vec();
          sizes[0] = moe.experts;
          if (!into.count(name)) into[name] = torch::zeros(sizes);
          into[name].narrow(0, ctx.rank * local, local).copy_(t.detach());
        };
        for (const auto& [name, p] : trainer.named_parameters()) put(out.params, name, p);
        for (const auto& [name, gr] : grads) put(out.grads, name, gr);
      },
      std::chrono::seconds(60));
  return out;
}

void expect_same_training(const Trained& got, const Trained& want, const std::string& where) {
  ASSERT_EQ(got.steps.size(), want.steps.size());
  for (size_t s = 0; s < want.steps.size(); ++s) {
    EXPECT_EQ(got.steps[s].counts, want.steps[s].counts)
        << where << ": step " << s << "'s router choices per layer and expert differ from the "
        << "single device's";
    EXPECT_NEAR(got.steps[s].loss, want.steps[s].loss, 1e-5 * (1 + std::abs(want.steps[s].loss)))
        << where << ": step " << s << "'s loss";
  }
  for (const auto& [name, g] : want.grads) {
    ASSERT_TRUE(got.grads.count(name)) << name;
    const double scale = g.abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(got.grads.at(name), g, 1e-4, 1e-5 * (1 + scale)))
        << where << ": the first step's reduced gradient of " << name << " (max |diff| "
        << (got.grads.at(name) - g).abs().max().item<double>() << ", max |g| " << scale
        << ", ratio of norms " << (got.grads.at(name).norm() / g.norm()).item<double>() << ")";
  }
  for (const auto& [name, p] : want.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    EXPECT_TRUE(torch::allclose(got.params.at(name), p, 1e-4, 1e-5))
        << where << ": " << name << " after " << want.steps.size() << " steps (max |diff| "
        << (got.params.at(name) - p).abs().max().item<double>() << ")";
  }
}

struct TrainCase {
  std::string name;
  MoeConfig moe;
};

std::vector<TrainCase> train_cases() {
  MoeConfig aux;  // softmax, top-2 of 4, Switch's loss
  MoeConfig bias;
  bias.score = ScoreFunc::kSigmoid;
  bias.route_norm = true;
  bias.balance = Balance::kBias;
  bias.bias_rate = 1e-2;
  bias.z_coef = 1e-3;
  bias.shared = 1;
  return {{"softmax_aux", aux}, {"sigmoid_bias", bias}};
}

TEST(L13Training, ExpertParallelMatchesTheSingleDevice) {
  const int64_t steps = 3;
  for (const TrainCase& c : train_cases()) {
    const Trained one = train(1, 1, c.moe, steps);
    for (const auto& [world, ep] : std::vector<std::pair<int, int>>{{2, 2}, {4, 4}, {4, 2}}) {
      const std::string where =
          c.name + ", " + std::to_string(world) + " ranks, ep " + std::to_string(ep);
      const Trained par = train(world, ep, c.moe, steps);
      expect_same_training(par, one, where);
      // the work: each rank's experts computed the copies that chose them (the first forward)
      int64_t rows = 0;
      for (int64_t r : par.expert_rows) rows += r;
      int64_t choices = 0;
      for (const auto& layer : one.steps[0].counts) {
        for (int64_t n : layer) choices += n;
      }
      EXPECT_EQ(rows, choices)
          << where << ": the experts of all ranks computed each of the batch's copies once";
    }
  }
}

// Pure data parallelism (ep 1): the experts are replicated, and reduced like the rest.
TEST(L13Training, ReplicatedExpertsMatchTheSingleDevice) {
  const MoeConfig moe = train_cases()[0].moe;
  expect_same_training(train(2, 1, moe, 2), train(1, 1, moe, 2), "2 ranks, ep 1");
}

// ---------------------------------------------------------------------------------------------
// 7. The single-device MoE against PyTorch (tests/reference/lesson13_moe.py)
// ---------------------------------------------------------------------------------------------

nlohmann::json reference() {
  std::ifstream in(source_path("tests/reference/lesson13_moe.json"));
  EXPECT_TRUE(in.good()) << "tests/reference/lesson13_moe.json (tests/reference/lesson13_moe.py)";
  return nlohmann::json::parse(in);
}

MoeConfig moe_of(const nlohmann::json& c) {
  MoeConfig m;
  m.experts = c.at("experts");
  m.top_k = c.at("top_k");
  m.shared = c.at("shared");
  m.score = c.at("score") == "sigmoid" ? ScoreFunc::kSigmoid : ScoreFunc::kSoftmax;
  m.route_norm = c.at("route_norm");
  m.capacity_factor = c.at("capacity_factor");
  const std::string balance = c.at("balance");
  m.balance = balance == "bias"   ? Balance::kBias
              : balance == "none" ? Balance::kNone
                                  : Balance::kAux;
  m.aux_coef = c.at("aux_coef");
  m.z_coef = c.at("z_coef");
  m.bias_rate = c.at("bias_rate");
  return m;
}

torch::Tensor tensor_of(const nlohmann::json& values) {
  return torch::tensor(values.get<std::vector<double>>(), torch::kDouble);
}

// One MoE layer, its output, its choices, and the gradients of x and of every parameter.
TEST(L13LayerGiven, MatchesPyTorch) {
  const nlohmann::json ref = reference().at("layer");
  const nlohmann::json& c = ref.at("config");
  MoeConfig moe;
  moe.experts = c.at("experts");
  moe.top_k = c.at("top_k");
  MoeLayer layer = make_layer(c.at("hidden"), moe, c.at("seed"));
  const int64_t t = c.at("tokens"), h = c.at("hidden");
  const torch::Tensor x = field(t, h, 0.37, 0).requires_grad_(true);
  const torch::Tensor wgt = field(t, h, 0.23, M_PI / 2);  // cos
  const torch::Tensor out = layer->forward(x.unsqueeze(0));
  (out * wgt.unsqueeze(0)).sum().backward();
  EXPECT_TRUE(torch::equal(layer->stats.counts.sum(), torch::tensor(t * moe.top_k)));
  const auto chosen = ref.at("chosen").get<std::vector<int64_t>>();
  RouterStats again;
  const Routing r = route(x.detach(), layer->router->weight, layer->expert_bias, moe, again);
  EXPECT_EQ(std::vector<int64_t>(r.experts.data_ptr<int64_t>(),
                                 r.experts.data_ptr<int64_t>() + r.experts.numel()),
            chosen)
      << "the router's choices (token by token, then choice by choice)";
  EXPECT_TRUE(torch::allclose(out.detach().reshape({-1}).to(torch::kDouble),
                              tensor_of(ref.at("out")), 1e-4, 1e-7))
      << "the layer's output";
  EXPECT_TRUE(torch::allclose(x.grad().reshape({-1}).to(torch::kDouble),
                              tensor_of(ref.at("grad_x")), 1e-4, 1e-7))
      << "x's gradient";
  for (const auto& p : layer->named_parameters()) {
    const torch::Tensor want = tensor_of(ref.at("grads").at("h.0.mlp." + p.key()));
    EXPECT_TRUE(
        torch::allclose(p.value().grad().reshape({-1}).to(torch::kDouble), want, 1e-4, 1e-7))
        << p.key() << "'s gradient";
  }
}

// Training the single-device MoE GPT (the program on one rank) for 5 steps: each step's loss, the
// router's choices and drops, the first step's gradients and the final parameters.
TEST(L13Reference, TrainingMatchesPyTorch) {
  const nlohmann::json ref = reference();
  for (const auto& [name, want] : ref.at("cases").items()) {
    const nlohmann::json& c = want.at("config");
    RunConfig run = small_run();
    run.model.hidden = c.at("hidden");
    run.model.layers = c.at("layers");
    run.model.heads = c.at("heads");
    run.model.ctx = c.at("ctx");
    run.batch = c.at("batch");
    run.seed = c.at("seed");
    const int64_t steps = c.at("steps");
    const Trained got = [&] {
      Trained out;
      run_ranks(1, [&](RankContext& ctx) {
        MoeGroups g = make_moe_groups(ctx.store, 0, 1, 1, BackendKind::kGloo, kTimeout);
        MoeTrainer trainer(run, moe_of(c), g);
        trainer.after_reduce = [&] {
          if (!out.grads.empty()) return;
          for (const auto& [n, p] : trainer.named_parameters()) out.grads[n] = p.grad().clone();
        };
        for (int64_t s = 0; s < steps; ++s) out.steps.push_back(trainer.step(s));
        for (const auto& [n, p] : trainer.named_parameters()) out.params[n] = p.detach().clone();
      });
      return out;
    }();
    for (int64_t s = 0; s < steps; ++s) {
      const double loss = want.at("losses")[s];
      EXPECT_NEAR(got.steps[s].loss, loss, 2e-5 * std::abs(loss)) << name << " step " << s;
      EXPECT_EQ(nlohmann::json(got.steps[s].counts), want.at("counts")[s])
          << name << " step " << s << ": the router's choices per layer and expert";
      EXPECT_EQ(nlohmann::json(got.steps[s].kept), want.at("kept")[s])
          << name << " step " << s << ": the copies kept within capacity";
    }
    for (const auto& [n, g] : want.at("grads0").items()) {
      ASSERT_TRUE(got.grads.count(n)) << name << ": " << n;
      const torch::Tensor mine = got.grads.at(n).to(torch::kDouble);
      const double sumsq = g.at("sumsq"), absmax = g.at("absmax");
      EXPECT_NEAR(mine.pow(2).sum().item<double>(), sumsq, 1e-4 * sumsq) << name << ": " << n;
      EXPECT_NEAR(mine.abs().max().item<double>(), absmax, 1e-4 * absmax) << name << ": " << n;
      if (g.contains("first")) {
        EXPECT_TRUE(torch::allclose(mine.reshape({-1}).narrow(0, 0, 8), tensor_of(g.at("first")),
                                    1e-3, 1e-4 * absmax))
            << name << ": " << n << "'s first gradients";
      }
    }
    for (const auto& [n, f] : want.at("final").items()) {
      ASSERT_TRUE(got.params.count(n)) << name << ": " << n;
      const torch::Tensor mine = got.params.at(n).to(torch::kDouble);
      const double sum = f.at("sum"), sumsq = f.at("sumsq");
      EXPECT_NEAR(mine.sum().item<double>(), sum, 1e-4 * (1 + std::abs(sum))) << name << ": " << n;
      EXPECT_NEAR(mine.pow(2).sum().item<double>(), sumsq, 1e-4 * (1 + sumsq)) << name << ": " << n;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 8. The losses, in closed form
// ---------------------------------------------------------------------------------------------

// When the job's choices are balanced (f_i = 1/E) Switch's loss is aux_coef E sum_i (1/E) P_i =
// aux_coef, whatever the shares (Fedus et al. 2021, eq. 4). Rank 0 picks experts 0 and 1, rank 1
// experts 2 and 3: balanced only over both ranks, so f must count the whole job's choices.
TEST(L13Loss, SwitchLossCountsTheWholeJob) {
  run_ranks(
      2,
      [&](RankContext& ctx) {
        MoeConfig moe;
        moe.experts = 4;
        moe.top_k = 2;
        moe.aux_coef = 0.25;
        // each rank's tokens favour the experts it chose: rank 0 experts 0-1, rank 1 experts 2-3
        RouterStats s;
        s.logits = (ctx.rank == 0 ? torch::tensor({1.0f, 1.0f, 0.0f, 0.0f})
                                  : torch::tensor({0.0f, 0.0f, 1.0f, 1.0f}))
                       .repeat({3, 1})
                       .requires_grad_(true);
        s.shares = s.logits.softmax(-1);
        s.counts = ctx.rank == 0 ? torch::tensor({3, 3, 0, 0}, torch::kLong)
                                 : torch::tensor({0, 0, 3, 3}, torch::kLong);
        s.kept = s.counts.clone();
        const torch::Tensor ce = torch::tensor(1.5f);
        const torch::Tensor loss = moe_loss(ce, {s, s}, moe, *ctx.comm);
        // over the job f = 1/4 each, so aux_coef E sum_i f_i P_i = aux_coef sum_i P_i = aux_coef
        // whatever the shares; f from this rank alone (1/2, 1/2, 0, 0) would give aux_coef E
        // (e / (2e + 2)) = 1.46 aux_coef instead
        EXPECT_NEAR(loss.item<double>(), 1.5 + 2 * 0.25, 1e-6)
            << "cross-entropy + aux_coef per layer: balanced over the job (closed form), though "
               "not on either rank";
        moe.z_coef = 0.1;
        moe.balance = Balance::kNone;
        s.logits = torch::zeros({3, 4}).requires_grad_(true);
        s.shares = s.logits.softmax(-1);
        const torch::Tensor z = moe_loss(ce, {s}, moe, *ctx.comm);
        EXPECT_NEAR(z.item<double>(), 1.5 + 0.1 * std::pow(std::log(4.0), 2), 1e-6)
            << "z-loss of zero logits: z_coef log(E)^2, and no Switch loss with --balance none";
      },
      kTimeout);
}

// Switch's loss with different tokens on each rank, sigmoid scores: its value is the closed form
// from the stats (f over the job's choices, P from the shares, not a softmax of the logits), and
// each rank's gradient over W is the gradient of the whole batch's loss on one rank for its
// tokens (P local, f global).
TEST(L13Loss, SwitchLossGradientIsTheWholeBatchs) {
  const int world = 2;
  const int64_t n = 3, e = 4;
  MoeConfig moe;
  moe.experts = e;
  moe.top_k = 2;
  moe.aux_coef = 0.3;
  auto logits_of = [&](int r) { return field(n, e, 0.9, 1.7 * r) * 3; };
  auto counts_of = [&](int r) {
    return r == 0 ? torch::tensor({4, 1, 0, 1}, torch::kLong)
                  : torch::tensor({0, 2, 3, 1}, torch::kLong);
  };
  auto stats_of = [&](const torch::Tensor& logits, const torch::Tensor& counts) {
    RouterStats s;
    s.logits = logits;
    const torch::Tensor sg = logits.sigmoid();
    s.shares = sg / sg.sum(-1, true);
    s.counts = counts;
    s.kept = counts;
    return s;
  };
  // one rank, the whole batch
  torch::Tensor whole = torch::cat({logits_of(0), logits_of(1)}).requires_grad_(true);
  torch::Tensor whole_grad;
  double whole_loss = 0;
  run_ranks(1, [&](RankContext& ctx) {
    const torch::Tensor loss = moe_loss(
        torch::tensor(0.0f), {stats_of(whole, counts_of(0) + counts_of(1))}, moe, *ctx.comm);
    loss.backward();
    whole_loss = loss.item<double>();
    whole_grad = whole.grad();
  });
  // closed form: 0.3 * 4 * sum_i f_i P_i, f = (4, 3, 3, 2) / 12
  const torch::Tensor f = torch::tensor({4.0, 3.0, 3.0, 2.0}, torch::kDouble) / 12.0;
  const torch::Tensor sg = whole.detach().to(torch::kDouble).sigmoid();
  const torch::Tensor p = (sg / sg.sum(-1, true)).mean(0);
  EXPECT_NEAR(whole_loss, 0.3 * 4 * (f * p).sum().item<double>(), 1e-6)
      << "aux_coef E sum f_i P_i, P from the shares (sigmoid scores over their sum)";
  run_ranks(
      world,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        torch::Tensor mine = logits_of(r).requires_grad_(true);
        const torch::Tensor loss =
            moe_loss(torch::tensor(0.0f), {stats_of(mine, counts_of(r))}, moe, *ctx.comm);
        loss.backward();
        EXPECT_TRUE(
            torch::allclose(mine.grad() / world, whole_grad.narrow(0, r * n, n), 1e-5, 1e-7))
            << "rank " << r << ": its gradient / W is the whole batch's for its tokens";
        std::vector<torch::Tensor> sum{loss.detach().reshape({1})};
        ctx.comm->allreduce(sum)->wait();
        EXPECT_NEAR(sum[0].item<float>() / world, whole_loss, 1e-6)
            << "the ranks' losses average to the whole batch's";
      },
      kTimeout);
}

// The bias step from the whole job's load: rank 0 sees only experts 0-1, rank 1 only 2-3.
TEST(L13Bias, StepsFromTheWholeJobsLoad) {
  run_ranks(
      2,
      [&](RankContext& ctx) {
        const torch::Tensor buffer = torch::zeros({4});  // a module's registered buffer
        torch::Tensor bias = buffer;                     // the handle the trainer passes
        const torch::Tensor counts = ctx.rank == 0 ? torch::tensor({5, 1, 0, 0}, torch::kLong)
                                                   : torch::tensor({0, 0, 2, 0}, torch::kLong);
        update_expert_bias(bias, counts, 0.5, *ctx.comm);
        // load (5, 1, 2, 0), mean 2: down, up, unchanged, up
        EXPECT_TRUE(torch::equal(buffer, torch::tensor({-0.5f, 0.5f, 0.0f, 0.5f})))
            << "rank " << ctx.rank << ": got " << buffer
            << " (the bias must change in place: the layer's registered buffer is what routes)";
      },
      kTimeout);
}

// ---------------------------------------------------------------------------------------------
// 9. Bad input: an error naming the flag, before any networking
// ---------------------------------------------------------------------------------------------

TEST(L13ConfigGiven, ErrorsNameTheFlag) {
  auto subject = [](MoeConfig c, int world, int ep) -> std::string {
    try {
      check_moe(c, world, ep);
    } catch (const UsageError& e) {
      return e.subject();
    }
    return "(accepted)";
  };
  MoeConfig ok;
  EXPECT_EQ(subject(ok, 4, 2), "(accepted)");
  MoeConfig c = ok;
  c.experts = 6;
  EXPECT_EQ(subject(c, 4, 4), "--ep") << "6 experts over ep 4";
  EXPECT_EQ(subject(ok, 6, 4), "--ep") << "ep 4 does not divide 6 ranks";
  c = ok;
  c.top_k = 5;
  EXPECT_EQ(subject(c, 2, 2), "--top-k");
  c = ok;
  c.capacity_factor = -0.5;
  EXPECT_EQ(subject(c, 2, 2), "--capacity-factor");
  c = ok;
  c.aux_coef = -1;
  EXPECT_EQ(subject(c, 2, 2), "--aux-loss-coef");
  c = ok;
  c.shared = -1;
  EXPECT_EQ(subject(c, 2, 2), "--shared-experts");
}

}  // namespace
}  // namespace dtc::l13

// Lesson 06 tests of the DDP itself: broadcast, averaging (naive, flat, bucketed), no_sync
// accumulation and checkpoints, on 2 and 3 thread-ranks (dtc::run_ranks) against
//   - closed forms (the mean of 1, 2, ..., W is (W + 1) / 2; bucket boundaries), and
//   - a single-process baseline computed HERE with plain LibTorch on the whole global batch
//     (lesson 02's model, optimizer and batches; none of the learner's code), and
//   - PyTorch's own losses (tests/reference/lesson02_reference.json).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

#include "adamw_params.h"
#include "ddp.h"
#include "dtc/compare.h"
#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/observe.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "plain_baseline.h"
#include "program.h"

namespace dtc::l06 {
namespace {

using test::kTimeout;  // a TODO on one rank fails the others fast

// A tiny GPT: 1 layer, h 32, 2 heads, seq 16 (a few thousand parameters: fast on 3 ranks).
TrainConfig tiny(SyncMode sync, int64_t batch = 6) {
  TrainConfig c;
  c.model.layers = 1;
  c.model.hidden = 32;
  c.model.heads = 2;
  c.model.ctx = 16;
  c.batch = batch;
  c.sync = sync;
  c.bucket_bytes = 8 * 1024;  // several buckets for this model
  return c;
}

struct RankRun {
  std::vector<float> losses;
  std::vector<torch::Tensor> params;
};

// The baseline: one process, the whole global batch, plain LibTorch (lesson 02's step:
// tests/support/plain_baseline.h).
RankRun baseline(const TrainConfig& c, int64_t steps) {
  const test::BaselineRun base = test::plain_baseline(c, steps);
  return {base.losses, base.params};
}

// DDP on `world` thread-ranks; every rank's run.
std::vector<RankRun> ddp(const TrainConfig& c, int world, int64_t steps) {
  std::vector<RankRun> runs(static_cast<size_t>(world));
  const ByteDataset data = ByteDataset::builtin();
  run_ranks(
      world,
      [&](RankContext& ctx) {
        DdpTrainer trainer(c, ctx.comm, torch::kCPU, c.seed);
        RankRun& run = runs[static_cast<size_t>(ctx.rank)];
        for (int64_t step = 0; step < steps; ++step) {
          run.losses.push_back(trainer.step(rank_batches(data, c, step, ctx.rank, world)));
        }
        for (const auto& p : trainer.model()->parameters())
          run.params.push_back(p.detach().clone());
      },
      kTimeout);
  return runs;
}

void expect_matches_baseline(const TrainConfig& c, int world, int64_t steps) {
  const RankRun base = baseline(c, steps);
  const std::vector<RankRun> runs = ddp(c, world, steps);
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankRun& run = runs[static_cast<size_t>(r)];
    ASSERT_EQ(run.losses.size(), base.losses.size());
    EXPECT_TENSOR_CLOSE(torch::tensor(run.losses), torch::tensor(base.losses), kFp32Steps);
    ASSERT_EQ(run.params.size(), base.params.size());
    for (size_t i = 0; i < base.params.size(); ++i) {
      EXPECT_ADAMW_PARAMS_CLOSE(run.params[i], base.params[i], steps, c.lr);
    }
    // Every replica took the very same steps: bit for bit equal to rank 0's.
    for (size_t i = 0; i < run.params.size(); ++i) {
      EXPECT_TENSOR_CLOSE(run.params[i], runs[0].params[i], kExact);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Step 2: broadcast
// ---------------------------------------------------------------------------------------------

TEST(L06Broadcast, EveryReplicaEqualsRankZerosInit) {
  const TrainConfig c = tiny(SyncMode::kNaive);
  Gpt expected(c.model);
  init_weights(expected, c.seed);  // closed form: rank 0's seed
  const auto want = expected->parameters();
  run_ranks(
      3,
      [&](RankContext& ctx) {
        Gpt model(c.model);
        init_weights(model, c.seed + static_cast<uint64_t>(ctx.rank));  // different per rank
        broadcast_parameters(*model, *ctx.comm);
        const auto got = model->parameters();
        for (size_t i = 0; i < got.size(); ++i) {
          auto cmp = compare_tensors(got[i], want[i], kExact, "parameter");
          if (!cmp.ok) throw std::runtime_error(cmp.message);
        }
      },
      kTimeout);
}

// ---------------------------------------------------------------------------------------------
// Steps 3-5: the mean, not the sum
// ---------------------------------------------------------------------------------------------

// Rank r's gradient is r + 1 everywhere; the mean over W ranks is (W + 1) / 2 (closed form),
// the sum would be W (W + 1) / 2.
void expect_mean_gradient(SyncMode mode, int world) {
  run_ranks(
      world,
      [&](RankContext& ctx) {
        std::vector<torch::Tensor> params{torch::zeros({3, 4}, torch::requires_grad()),
                                          torch::zeros({5}, torch::requires_grad()),
                                          torch::zeros({2, 2}, torch::requires_grad())};
        std::unique_ptr<Reducer> reducer;
        if (mode == SyncMode::kBucketed) reducer = std::make_unique<Reducer>(params, ctx.comm, 40);
        auto loss = torch::zeros({});
        for (auto& p : params) loss = loss + (p * static_cast<double>(ctx.rank + 1)).sum();
        loss.backward();
        if (mode == SyncMode::kNaive) allreduce_gradients_naive(params, *ctx.comm);
        if (mode == SyncMode::kFlat) allreduce_gradients_flat(params, *ctx.comm);
        if (mode == SyncMode::kBucketed) reducer->finish();
        for (auto& p : params) {
          auto cmp = compare_tensors(p.grad(), torch::full_like(p, (world + 1) / 2.0), kExact,
                                     "mean gradient (closed form (W + 1) / 2)");
          if (!cmp.ok) throw std::runtime_error(cmp.message);
        }
      },
      kTimeout);
}

TEST(L06Naive, GradientIsTheMeanOverRanks) { expect_mean_gradient(SyncMode::kNaive, 3); }
TEST(L06Flat, GradientIsTheMeanOverRanks) { expect_mean_gradient(SyncMode::kFlat, 3); }
TEST(L06Bucketed, GradientIsTheMeanOverRanks) { expect_mean_gradient(SyncMode::kBucketed, 3); }

// ---------------------------------------------------------------------------------------------
// Same trajectory as the single-process baseline
// ---------------------------------------------------------------------------------------------

TEST(L06Naive, TwoRanksMatchBaseline) { expect_matches_baseline(tiny(SyncMode::kNaive), 2, 3); }
TEST(L06Naive, ThreeRanksMatchBaseline) { expect_matches_baseline(tiny(SyncMode::kNaive), 3, 3); }
TEST(L06Flat, TwoRanksMatchBaseline) { expect_matches_baseline(tiny(SyncMode::kFlat), 2, 3); }
TEST(L06Flat, ThreeRanksMatchBaseline) { expect_matches_baseline(tiny(SyncMode::kFlat), 3, 3); }
TEST(L06Bucketed, TwoRanksMatchBaseline) {
  expect_matches_baseline(tiny(SyncMode::kBucketed), 2, 3);
}
TEST(L06Bucketed, ThreeRanksMatchBaseline) {
  expect_matches_baseline(tiny(SyncMode::kBucketed), 3, 3);
}
TEST(L06Bucketed, UntiedTwelveRowsOnThreeRanksMatchBaseline) {
  TrainConfig c = tiny(SyncMode::kBucketed, 12);
  c.model.tied = false;
  expect_matches_baseline(c, 3, 2);
}

// Against PyTorch itself: lesson 02's reference case, 2 ranks of 2 rows each.
TEST(L06Bucketed, TwoRanksMatchPyTorchLosses) {
  const test::ReferenceCase ref = test::reference_case("tiny_tied");
  TrainConfig c(ref.config);
  c.sync = SyncMode::kBucketed;
  c.bucket_bytes = 64 * 1024;
  const std::vector<float>& want = ref.losses;
  const auto runs = ddp(c, 2, static_cast<int64_t>(want.size()));
  EXPECT_TENSOR_CLOSE(torch::tensor(runs[0].losses), torch::tensor(want), kFp32VsPyTorch);
}

TEST(L06Bucketed, ParameterWithoutGradientOnOneRankAveragesAZero) {
  // Step 1: every parameter gets r + 1 on rank r. Step 2 (gradients set to none first, as the
  // trainer does): rank 0 uses all three parameters, rank 1 leaves the middle one out. A rank
  // without a gradient contributes zeros, so the middle one's mean is (0 + 1 + 0 ...) / W = 1 / W
  // (closed form) on every rank, and the others' is (W + 1) / 2 again.
  constexpr int kWorld = 2;
  run_ranks(
      kWorld,
      [&](RankContext& ctx) {
        std::vector<torch::Tensor> params{torch::zeros({3, 4}, torch::requires_grad()),
                                          torch::zeros({5}, torch::requires_grad()),
                                          torch::zeros({2, 2}, torch::requires_grad())};
        Reducer reducer(params, ctx.comm, 1);  // one bucket per parameter
        const double mine = ctx.rank + 1;
        for (int step = 0; step < 2; ++step) {
          for (auto& p : params) p.mutable_grad().reset();
          auto loss = torch::zeros({});
          for (size_t i = 0; i < params.size(); ++i) {
            if (step == 1 && i == 1 && ctx.rank != 0) continue;  // unused on this rank
            loss = loss + (params[i] * mine).sum();
          }
          loss.backward();
          reducer.finish();
        }
        for (size_t i = 0; i < params.size(); ++i) {
          const double want = i == 1 ? 1.0 / kWorld : (kWorld + 1) / 2.0;
          auto cmp = compare_tensors(params[i].grad(), torch::full_like(params[i], want), kExact,
                                     fmt::format("parameter {}'s mean gradient in step 2", i));
          if (!cmp.ok) throw std::runtime_error(cmp.message);
        }
      },
      kTimeout);
}

// ---------------------------------------------------------------------------------------------
// Buckets and overlap
// ---------------------------------------------------------------------------------------------

TEST(L06Buckets, ReverseOrderCappedByBytes) {
  // fp32 sizes 400, 40, 80, 400, 16 bytes; cap 100: closed form from the rule in ddp.h.
  const std::vector<torch::Tensor> p{torch::zeros({100}), torch::zeros({10}), torch::zeros({20}),
                                     torch::zeros({100}), torch::zeros({4})};
  const std::vector<std::vector<size_t>> want{{4, 3}, {2, 1}, {0}};
  EXPECT_EQ(assign_buckets(p, 100), want);
  const std::vector<std::vector<size_t>> one{{4, 3, 2, 1, 0}};
  EXPECT_EQ(assign_buckets(p, 1 << 20), one);
  const std::vector<std::vector<size_t>> each{{4}, {3}, {2}, {1}, {0}};
  EXPECT_EQ(assign_buckets(p, 1), each);
}

// What the ranks did during one step, seen from outside the Reducer: a RecordingComm logs every
// allreduce, and hooks of the test's own, registered after the Reducer's (so they run after its
// hook on the same parameter), mark each parameter's gradient as it becomes ready.
struct StepLog {
  int64_t buckets = 0;
  int64_t in_backward = 0;            // allreduces issued before the last gradient's mark
  int64_t before_last_two_grads = 0;  // issued before the second-to-last gradient's mark
};

StepLog observe_step(const TrainConfig& c, RankContext& ctx, const ByteDataset& data) {
  auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
  DdpTrainer trainer(c, rec, torch::kCPU, c.seed);
  StepLog log;
  log.buckets = static_cast<int64_t>(trainer.reducer()->buckets().size());
  const auto params = trainer.model()->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].register_hook([rec, i](const torch::Tensor&) { rec->mark(std::to_string(i)); });
  }
  rec->clear();
  trainer.step(rank_batches(data, c, 0, ctx.rank, 2));
  std::vector<int64_t> grad_marks;
  for (const auto& e : rec->events("mark")) grad_marks.push_back(e.seq);
  if (grad_marks.size() < 2) throw std::runtime_error("backward marked fewer than 2 gradients");
  for (const auto& e : rec->events("allreduce")) {
    log.in_backward += e.seq < grad_marks.back();
    log.before_last_two_grads += e.seq < grad_marks[grad_marks.size() - 2];
  }
  return log;
}

TEST(L06Bucketed, AllreducesStartDuringBackward) {
  // Overlap: a bucket's allreduce starts as soon as its last gradient is ready, while backward
  // goes on. Buckets fill from the last parameter, whose gradient comes first, so every bucket
  // but the last one (which holds the embedding, ready last) has started before the last two
  // gradients are ready. A Reducer that waits for every gradient starts none by then.
  const TrainConfig c = tiny(SyncMode::kBucketed);
  const ByteDataset data = ByteDataset::builtin();
  run_ranks(
      2,
      [&](RankContext& ctx) {
        const StepLog log = observe_step(c, ctx, data);
        if (log.buckets < 3) throw std::runtime_error("expected several buckets for this test");
        if (log.in_backward != log.buckets) {
          throw std::runtime_error(fmt::format(
              "{} allreduce calls during backward with {} buckets: expected one per bucket",
              log.in_backward, log.buckets));
        }
        if (log.before_last_two_grads < log.buckets - 1) {
          throw std::runtime_error(fmt::format(
              "only {} of {} buckets' allreduces started before backward produced its last "
              "two gradients (expected {}): the buckets are launched too late, no overlap",
              log.before_last_two_grads, log.buckets, log.buckets - 1));
        }
      },
      kTimeout);
}

// find_unused_parameters: a model whose last parameter (the first one bucketed, the first
// bucket to fill) takes no part in the loss. Without prepare_for_backward() that bucket never
// completes in backward, and in-order launching holds every bucket back until finish(); with it
// the unused parameter is ready before backward starts and every bucket's allreduce is issued
// during backward (and one more, the used map's, before them). Seen by a RecordingComm (calls
// issued before backward() returns). The unused parameter: without find_unused nothing tells
// the Reducer that no rank used it, and it gets the mean of zeros; with it, no gradient at all,
// as PyTorch leaves it (AGloballyUnusedParameterIsLeftAlone, below, says why).
TEST(L06Bucketed, FindUnusedParametersKeepsTheOverlap) {
  run_ranks(
      2,
      [&](RankContext& ctx) {
        for (bool find_unused : {false, true}) {
          SCOPED_TRACE(testing::Message() << "find_unused " << find_unused);
          torch::manual_seed(3);
          torch::nn::Linear a(16, 16), b(16, 16), unused(16, 16);
          std::vector<torch::Tensor> params;
          for (auto* m : {&a, &b, &unused}) {
            for (const auto& p : (*m)->parameters()) params.push_back(p);
          }
          auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
          Reducer reducer(params, rec, 16 * 16 * 4);  // about one weight per bucket
          ASSERT_GE(reducer.buckets().size(), 3u);
          const torch::Tensor x = torch::randn({4, 16}) + static_cast<double>(ctx.rank);
          const torch::Tensor loss = b(a(x).relu()).pow(2).mean();
          rec->clear();
          if (find_unused) reducer.prepare_for_backward(loss);
          loss.backward();
          const auto during = static_cast<int64_t>(rec->events("allreduce").size());
          reducer.finish();
          const auto total = static_cast<int64_t>(rec->events("allreduce").size());
          EXPECT_EQ(total, static_cast<int64_t>(reducer.buckets().size()) + (find_unused ? 1 : 0))
              << "one allreduce per bucket, and the used map's with find_unused";
          if (find_unused) {
            EXPECT_EQ(during, total) << "every bucket launched before finish()";
            EXPECT_FALSE(unused->weight.grad().defined())
                << "no rank used it: its grad stays undefined, as PyTorch's Reducer leaves it";
          } else {
            EXPECT_EQ(during, 0) << "the unused parameter's bucket, first in line, holds all back";
            ASSERT_TRUE(unused->weight.grad().defined());
            EXPECT_TRUE(torch::equal(unused->weight.grad(), torch::zeros({16, 16})));
          }
        }
      },
      kTimeout);
}

// The buckets take the parameters' options (dtype and device): a float64 model on the CPU
// stands in for a bf16 model or a GPU one, whose buckets in the default dtype (fp32, the CPU)
// would round every gradient or fail. Gradients 1 + 2^-40 on rank 0 and 1 on rank 1: their mean
// 1 + 2^-41 is exact in float64 and rounds to 1 in fp32; and every rank's grad stays float64.
TEST(L06Bucketed, BucketsTakeTheParametersDtype) {
  run_ranks(
      2,
      [&](RankContext& ctx) {
        torch::nn::Linear a(4, 4), b(4, 4);
        a->to(torch::kDouble);
        b->to(torch::kDouble);
        std::vector<torch::Tensor> params;
        for (auto* m : {&a, &b}) {
          for (const auto& p : (*m)->parameters()) params.push_back(p);
        }
        Reducer reducer(params, ctx.comm, 4 * 4 * 8);
        const double g = ctx.rank == 0 ? 1.0 + std::ldexp(1.0, -40) : 1.0;
        torch::Tensor loss = torch::zeros({}, torch::kDouble);
        for (const auto& p : params) loss = loss + p.sum() * g;
        loss.backward();
        reducer.finish();
        for (const auto& p : params) {
          ASSERT_TRUE(p.grad().defined());
          EXPECT_EQ(p.grad().scalar_type(), torch::kDouble);
          SCOPED_TRACE("a float64 gradient must not go through a bucket of another dtype");
          EXPECT_TENSOR_CLOSE(p.grad(), torch::full_like(p, 1.0 + std::ldexp(1.0, -41)), kExact);
        }
      },
      kTimeout);
}

// A parameter that no rank uses (a frozen branch, a layer outside the loss) has no gradient in
// a single process, and AdamW skips it. A zero gradient is not the same: AdamW's decoupled
// weight decay shrinks it and its moments keep moving it. PyTorch's Reducer therefore leaves a
// globally unused parameter's grad untouched (copy_bucket_to_grad). Checked on 3 ranks with
// find_unused_parameters, AdamW with weight decay, 3 steps: the unused layer's parameters stay
// bit for bit what they were, and a layer that only rank 1 uses is averaged on every rank
// (rank 1's gradient / 3), against the test's own allreduce of each rank's local gradient.
TEST(L06Bucketed, AGloballyUnusedParameterIsLeftAlone) {
  constexpr int kWorld = 3;
  run_ranks(
      kWorld,
      [&](RankContext& ctx) {
        torch::manual_seed(4);
        torch::nn::Linear a(8, 8), partly(8, 8), unused(8, 8);
        std::vector<torch::Tensor> params;
        for (auto* m : {&a, &partly, &unused}) {
          for (const auto& p : (*m)->parameters()) params.push_back(p);
        }
        const torch::Tensor unused_before = unused->weight.detach().clone();
        Reducer reducer(params, ctx.comm, 8 * 8 * 4);
        torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        for (int step = 0; step < 3; ++step) {
          SCOPED_TRACE(testing::Message() << "rank " << ctx.rank << ", step " << step);
          zero_grad_to_none(optimizer);
          const torch::Tensor x = torch::randn({4, 8}) + static_cast<double>(ctx.rank + step);
          torch::Tensor loss = a(x).pow(2).mean();
          if (ctx.rank == 1) loss = loss + partly(x).pow(2).mean();
          // This rank's own gradient of partly's weight, for the reference mean (on a copy:
          // autograd::grad on the parameter itself would run the Reducer's hooks).
          torch::Tensor local = torch::zeros({8, 8});
          if (ctx.rank == 1) {
            const torch::Tensor w = partly->weight.detach().clone().requires_grad_();
            const torch::Tensor y = torch::nn::functional::linear(x, w, partly->bias.detach());
            local = torch::autograd::grad({y.pow(2).mean()}, {w})[0];
          }
          std::vector<torch::Tensor> sum{local.clone()};
          ctx.comm->allreduce(sum)->wait();
          reducer.prepare_for_backward(loss);
          loss.backward();
          reducer.finish();
          EXPECT_FALSE(unused->weight.grad().defined() || unused->bias.grad().defined())
              << "no rank used the layer: its gradients stay undefined";
          ASSERT_TRUE(partly->weight.grad().defined())
              << "rank 1 used partly: every rank gets the mean, zeros from those that did not";
          EXPECT_TENSOR_CLOSE(partly->weight.grad(), sum[0] / kWorld, kFp32Op);
          optimizer.step();
        }
        EXPECT_TRUE(torch::equal(unused->weight.detach(), unused_before))
            << "AdamW moved a parameter that no rank used: a zero gradient is not no gradient "
               "(weight decay and the moments still apply)";
      },
      kTimeout);
}

// The bucket rebuild (first_bucket_bytes > 0): four layers registered m0..m3 but used in another
// order, so that the constructor's buckets (reverse registration order, one layer each) fill out
// of turn: in-order launching holds ready buckets back behind one that is not. After step 1 the
// Reducer buckets the parameters again in the order their gradients arrived, on rank 0; rank 1
// runs the layers in yet another order and must take rank 0's buckets (one broadcast), or the
// two ranks' allreduces would pair different buckets. Seen from outside: a RecordingComm, and
// marks from hooks of the test's own after each gradient; the mean gradients against an
// allreduce of the test's own.
TEST(L06Bucketed, RebuiltBucketsFollowTheReadyOrderOfRankZero) {
  constexpr int kWorld = 2;
  std::vector<std::vector<std::vector<size_t>>> buckets_of(kWorld);
  run_ranks(
      kWorld,
      [&](RankContext& ctx) {
        for (bool rebuild : {false, true}) {
          SCOPED_TRACE(testing::Message() << "rebuild " << rebuild);
          torch::manual_seed(5);
          std::vector<torch::nn::Linear> m;
          std::vector<torch::Tensor> params;
          for (int k = 0; k < 4; ++k) {
            m.emplace_back(16, 16);
            for (const auto& p : m.back()->parameters()) params.push_back(p);
          }
          auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
          Reducer reducer(params, rec, 16 * 16 * 4, rebuild ? 64 : 0);  // one layer per bucket
          for (size_t i = 0; i < params.size(); ++i) {
            params[i].register_hook(
                [rec, i](const torch::Tensor&) { rec->mark(std::to_string(i)); });
          }
          const std::vector<int> use =
              ctx.rank == 0 ? std::vector<int>{1, 3, 0, 2} : std::vector<int>{2, 0, 3, 1};
          std::vector<int64_t> first_order;
          for (int step = 0; step < 2; ++step) {
            for (auto& p : params) p.mutable_grad().reset();
            torch::Tensor y = torch::randn({4, 16}) + static_cast<double>(ctx.rank);
            for (int k : use) y = torch::tanh(m[static_cast<size_t>(k)](y));
            const torch::Tensor loss = y.pow(2).mean();
            rec->clear();
            loss.backward();
            std::vector<int64_t> marks, order;
            for (const auto& e : rec->events("mark")) {
              marks.push_back(e.seq);
              order.push_back(std::stoll(e.label));
            }
            // Buckets launched on time: a bucket's allreduce (the b-th: in-order launching) before
            // the mark that follows its last gradient's, i.e. while backward goes on.
            const auto& buckets = reducer.buckets();
            const auto calls = rec->events("allreduce");
            std::vector<size_t> pos(params.size(), 0);
            for (size_t k = 0; k < order.size(); ++k) pos[static_cast<size_t>(order[k])] = k;
            int64_t on_time = 0;
            for (size_t b = 0; b < buckets.size() && b < calls.size(); ++b) {
              size_t last = 0;
              for (size_t i : buckets[b]) last = std::max(last, pos[i]);
              on_time += last + 1 >= marks.size() || calls[b].seq < marks[last + 1];
            }
            // The local gradients, before finish() overwrites them with the mean.
            std::vector<torch::Tensor> want;
            for (const auto& p : params) want.push_back(p.grad().clone());
            reducer.finish();
            for (auto& g : want) {
              std::vector<at::Tensor> v{g};
              ctx.comm->allreduce(v)->wait();
              g.div_(kWorld);
            }
            for (size_t i = 0; i < params.size(); ++i) {
              EXPECT_TRUE(torch::allclose(params[i].grad(), want[i], 1e-6, 1e-7))
                  << "parameter " << i << "'s mean gradient in step " << step + 1;
            }
            const auto n = static_cast<int64_t>(reducer.buckets().size());
            if (step == 0) {
              first_order = order;
              EXPECT_EQ(reducer.rebuilt(), rebuild);
              continue;
            }
            if (!rebuild) {
              EXPECT_LT(on_time, n)
                  << "the registration-order buckets fill out of turn: ready ones wait";
              continue;
            }
            // Step 2, rebuilt: the buckets, end to end, are rank 0's ready order of step 1.
            std::vector<int64_t> flat;
            for (const auto& b : reducer.buckets()) {
              for (size_t i : b) flat.push_back(static_cast<int64_t>(i));
            }
            buckets_of[static_cast<size_t>(ctx.rank)] = reducer.buckets();
            if (ctx.rank == 0) {
              EXPECT_EQ(flat, first_order) << "the buckets follow the order gradients arrived in";
              EXPECT_EQ(on_time, n) << "every rebuilt bucket launched as soon as it is full";
            }
            // The first bucket capped at 64 B (one parameter), the others at 1 KiB (a weight
            // closes one): 5 buckets whether a layer's weight or bias comes first; every bucket
            // at 64 B would make 8.
            EXPECT_EQ(reducer.buckets().front().size(), 1u) << "the first bucket: 64 B";
            EXPECT_EQ(n, 5) << "the others capped at bucket_bytes, not first_bucket_bytes";
          }
        }
      },
      kTimeout);
  EXPECT_EQ(buckets_of[0], buckets_of[1]) << "rank 1 takes rank 0's buckets";
}

// ---------------------------------------------------------------------------------------------
// The compression hook (--reduce-dtype): bf16/fp16 on the wire, pre-divided
// ---------------------------------------------------------------------------------------------

// Two ranks, three parameters, rank r's gradient g_r (the test's own formula), and a fourth
// parameter that the loss does not use: its bucket (the first) completes only in finish(), so
// finish()'s own launches go through the hook too. The Reducer with a compression hook to
// @p wire. Returns rank 0's mean gradients (the unused one's: zeros) and the allreduced bytes.
struct HookedStep {
  std::vector<torch::Tensor> grads;
  int64_t wire_bytes = 0;
};

HookedStep hooked_step(torch::ScalarType wire,
                       const std::function<torch::Tensor(int64_t, int)>& g) {
  HookedStep out;
  std::mutex m;
  run_ranks(
      2,
      [&](RankContext& ctx) {
        std::vector<torch::Tensor> params{torch::zeros({3, 4}, torch::requires_grad()),
                                          torch::zeros({5}, torch::requires_grad()),
                                          torch::zeros({2, 2}, torch::requires_grad()),
                                          torch::zeros({6}, torch::requires_grad())};
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        Reducer reducer(params, rec, 40);
        if (wire != torch::kFloat) reducer.register_compress_hook(wire);
        auto loss = torch::zeros({});
        for (size_t i = 0; i < 3; ++i) {
          loss = loss + (params[i] * g(params[i].numel(), ctx.rank).view_as(params[i])).sum();
        }
        loss.backward();
        reducer.finish();
        if (ctx.rank != 0) return;
        std::lock_guard<std::mutex> lock(m);
        for (auto& p : params) out.grads.push_back(p.grad().clone());
        out.wire_bytes = rec->bytes("allreduce");
      },
      kTimeout);
  return out;
}

// g_r[i] = 0.37 sin(i + 3r): values that 16 bits round.
torch::Tensor wavy(int64_t n, int rank) {
  return torch::arange(n, torch::kFloat).add_(3.0 * rank).sin_().mul_(0.37f);
}

TEST(L06CommHook, Bf16MeanIsThePreDividedSumInBf16WithHalfTheBytes) {
  // bf16_compress_hook's arithmetic, written out: each rank sends bf16(g_r) / 2, the two halves
  // are added in bf16 (two ranks: one rounding, in either order), the result cast to fp32.
  if (!kGlooBf16) GTEST_SKIP() << "this LibTorch's gloo has no bf16 allreduce";
  const HookedStep fp32 = hooked_step(torch::kFloat, wavy);
  const HookedStep bf16 = hooked_step(torch::kBFloat16, wavy);
  const int64_t numel = 12 + 5 + 4 + 6;
  EXPECT_EQ(fp32.wire_bytes, 4 * numel);
  EXPECT_EQ(bf16.wire_bytes, 2 * numel) << "the buckets go on the wire in bf16";
  const int64_t sizes[] = {12, 5, 4};
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    const auto half = [&](int r) { return wavy(sizes[i], r).to(torch::kBFloat16).div(2); };
    const auto expected = (half(0) + half(1)).to(torch::kFloat);
    EXPECT_TENSOR_CLOSE(bf16.grads[i].flatten(), expected, kExact);
    EXPECT_FALSE(torch::equal(bf16.grads[i].flatten(), fp32.grads[i].flatten()))
        << "bf16 rounding must show: the mean was not reduced in fp32";
  }
  EXPECT_TENSOR_CLOSE(bf16.grads[3], torch::zeros({6}), kExact);
}

TEST(L06CommHook, Fp16PreDivisionKeepsTheSumInRange) {
  // 40000 on each rank: their sum, 80000, is past fp16's largest value (65504), so dividing
  // after the allreduce would give inf; dividing before it gives the mean, 40000, exactly.
  const HookedStep r =
      hooked_step(torch::kHalf, [](int64_t n, int) { return torch::full({n}, 40000.0f); });
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TENSOR_CLOSE(r.grads[i], torch::full_like(r.grads[i], 40000.0f), kExact);
  }
  EXPECT_EQ(r.wire_bytes, 2 * (12 + 5 + 4 + 6));
}

// ---------------------------------------------------------------------------------------------
// Join: uneven inputs
// ---------------------------------------------------------------------------------------------

// Rank 0 trains 1 step and rank 1 three, each on its own batches; then both join().
void train_unevenly_and_join(DdpTrainer& trainer, const TrainConfig& c, const ByteDataset& data,
                             int rank) {
  const int64_t steps = rank == 0 ? 1 : 3;
  for (int64_t step = 0; step < steps; ++step) trainer.step(rank_batches(data, c, step, rank, 2));
  trainer.join();
}

// Join (given): rank 0 has batches for 1 step, rank 1 for 3. With join, rank 0 shadows steps 2
// and 3 with zeros, so their mean gradient is rank 1's / W (the initial world size, DDP's
// default), and both ranks end with the parameters of rank 1, the last joiner (rank 0's own
// stopped after step 1). The reference, outside the trainer: one process, the same model and
// AdamW, fed by hand the mean of both ranks' gradients for step 1 and half of rank 1's for
// steps 2 and 3. Every sync mode.
TEST(L06Join, UnevenStepsShadowedGiveTheMeanOverTheInitialWorld) {
  const ByteDataset data = ByteDataset::builtin();
  auto flatten = [](const std::vector<torch::Tensor>& params) {
    std::vector<torch::Tensor> flat;
    for (const auto& p : params) flat.push_back(p.detach().reshape({-1}).clone());
    return torch::cat(flat);
  };
  for (SyncMode sync : {SyncMode::kNaive, SyncMode::kFlat, SyncMode::kBucketed}) {
    SCOPED_TRACE(testing::Message() << "sync " << static_cast<int>(sync));
    TrainConfig c = tiny(sync, 4);
    c.join = true;
    // The reference.
    Gpt ref = make_model(c, c.seed, torch::kCPU);
    auto opt = make_optimizer(ref, c);
    const auto ref_params = ref->parameters();
    for (int64_t step = 0; step < 3; ++step) {
      std::vector<torch::Tensor> mean;
      for (int rank = 0; rank < 2; ++rank) {
        if (step > 0 && rank == 0) continue;  // rank 0 is out of batches: a zero gradient
        for (auto& p : ref_params) p.mutable_grad().reset();
        forward_loss(ref, rank_batches(data, c, step, rank, 2).front()).backward();
        for (size_t i = 0; i < ref_params.size(); ++i) {
          auto g = ref_params[i].grad().detach() / 2.0;
          if (mean.size() <= i) {
            mean.push_back(g.clone());
          } else {
            mean[i] += g;
          }
        }
      }
      for (size_t i = 0; i < ref_params.size(); ++i) ref_params[i].mutable_grad() = mean[i];
      opt->step();
    }
    std::vector<torch::Tensor> got(2);
    run_ranks(
        2,
        [&](RankContext& ctx) {
          DdpTrainer trainer(c, ctx.comm, torch::kCPU, c.seed);
          train_unevenly_and_join(trainer, c, data, ctx.rank);
          got[static_cast<size_t>(ctx.rank)] = flatten(trainer.model()->parameters());
        },
        kTimeout);
    const auto want = flatten(ref_params);
    for (int rank = 0; rank < 2; ++rank) {
      auto cmp = compare_tensors(got[static_cast<size_t>(rank)], want, kFp32Steps,
                                 fmt::format("rank {}'s parameters after Join", rank));
      EXPECT_TRUE(cmp.ok) << cmp.message;
    }
  }
}

// After Join the replicas must stay equal when training goes on (the next epoch): the early
// joiner's AdamW state, which missed the steps it shadowed, is the root's too. Rank 0 trains 1
// step and rank 1 three, both join, then both train one more step on their own batches.
TEST(L06Join, AStepAfterJoinKeepsTheReplicasEqual) {
  const ByteDataset data = ByteDataset::builtin();
  TrainConfig c = tiny(SyncMode::kBucketed, 4);
  c.join = true;
  run_ranks(
      2,
      [&](RankContext& ctx) {
        DdpTrainer trainer(c, ctx.comm, torch::kCPU, c.seed);
        train_unevenly_and_join(trainer, c, data, ctx.rank);
        EXPECT_EQ(replica_divergence(trainer.model(), *ctx.comm), 0.0) << "right after join()";
        trainer.step(rank_batches(data, c, 3, ctx.rank, 2));
        const double apart = replica_divergence(trainer.model(), *ctx.comm);
        if (ctx.rank == 0) std::cout << "    replicas apart after one more step: " << apart << "\n";
        EXPECT_EQ(apart, 0.0) << "one step after join() the replicas differ: the early joiner's "
                                 "optimizer state was not the root's";
      },
      kTimeout);
}

// ---------------------------------------------------------------------------------------------
// Step 6: accumulation without communication on the inner micro-steps
// ---------------------------------------------------------------------------------------------

TEST(L06NoSync, AccumulationMatchesBaselineAndSkipsCommunication) {
  TrainConfig c = tiny(SyncMode::kBucketed, 8);
  c.accum = 2;
  expect_matches_baseline(c, 2, 3);
  const ByteDataset data = ByteDataset::builtin();
  run_ranks(
      2,
      [&](RankContext& ctx) {
        // One micro-step of two communicates: one allreduce per bucket, not two (counted by a
        // RecordingComm, outside the Reducer).
        const StepLog log = observe_step(c, ctx, data);
        if (log.in_backward != log.buckets) {
          throw std::runtime_error(fmt::format(
              "{} allreduce calls during the backward passes of one step of 2 micro-steps with "
              "{} buckets; expected {} (no_sync on the first micro-step)",
              log.in_backward, log.buckets, log.buckets));
        }
      },
      kTimeout);
}

TEST(L06Naive, AccumulationOnThreeRanksMatchesBaseline) {
  TrainConfig c = tiny(SyncMode::kNaive, 6);
  c.accum = 2;
  expect_matches_baseline(c, 3, 2);
}

// ---------------------------------------------------------------------------------------------
// Step 7: rank-0 checkpoints, and an exact resume
// ---------------------------------------------------------------------------------------------

TEST(L06Checkpoint, OnlyRankZeroWritesAndNoTempFileRemains) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("l06_ck_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const TrainConfig c = tiny(SyncMode::kNaive);
  Gpt model = make_model(c, c.seed, torch::kCPU);
  auto opt = make_optimizer(model, c);
  save_checkpoint((dir / "r1.pt").string(), 1, *model, *opt, 5);
  EXPECT_FALSE(std::filesystem::exists(dir / "r1.pt")) << "rank 1 wrote a checkpoint";
  save_checkpoint((dir / "r0.pt").string(), 0, *model, *opt, 5);
  EXPECT_TRUE(std::filesystem::exists(dir / "r0.pt")) << "rank 0 wrote nothing";
  EXPECT_FALSE(std::filesystem::exists(dir / "r0.pt.tmp")) << "the temp file was not renamed";
  Gpt other = make_model(c, c.seed + 1, torch::kCPU);
  auto other_opt = make_optimizer(other, c);
  EXPECT_EQ(load_checkpoint((dir / "r0.pt").string(), *other, *other_opt), 5);
  const auto a = model->parameters(), b = other->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TENSOR_CLOSE(b[i], a[i], kExact);
  std::filesystem::remove_all(dir);
}

// "Never half a file": a save cut short (a full disk, a quota, a job killed mid-write) must leave
// the previous checkpoint whole, since a restart loads whatever the path holds. The save is cut
// short here deterministically, in a child process, by a file-size limit (RLIMIT_FSIZE) below
// the checkpoint's size, with SIGXFSZ ignored so that the write fails instead of the process
// (LibTorch's writer then ends the child from a destructor: the job dies mid-write). A
// checkpoint written in place at path is then half a file; one written beside it and renamed
// over it leaves path as it was.
TEST(L06Checkpoint, ASaveCutShortLeavesThePreviousCheckpointWhole) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("l06_cut_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "ck.pt").string();
  const TrainConfig c = tiny(SyncMode::kNaive);
  Gpt model = make_model(c, c.seed, torch::kCPU);
  auto opt = make_optimizer(model, c);
  save_checkpoint(path, 0, *model, *opt, 5);
  const auto size = static_cast<rlim_t>(std::filesystem::file_size(path));
  std::vector<torch::Tensor> saved;
  for (const auto& p : model->parameters()) saved.push_back(p.detach().clone());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.add_(1.0);  // the next checkpoint differs
  }
  const pid_t child = ::fork();
  ASSERT_GE(child, 0) << "fork failed";
  if (child == 0) {  // the job that dies mid-save
    ::alarm(30);
    if (std::freopen("/dev/null", "w", stderr) == nullptr) ::_exit(4);  // LibTorch's abort message
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit cut{};
    ::getrlimit(RLIMIT_FSIZE, &cut);
    cut.rlim_cur = size / 2;
    ::setrlimit(RLIMIT_FSIZE, &cut);
    try {
      save_checkpoint(path, 0, *model, *opt, 7);
    } catch (...) {
      ::_exit(3);  // the writer's error, as a full disk gives it
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the save returned as if it had written a file larger than the limit allowed";
  Gpt other = make_model(c, c.seed + 1, torch::kCPU);
  auto other_opt = make_optimizer(other, c);
  int64_t done = -1;
  try {
    done = load_checkpoint(path, *other, *other_opt);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the previous checkpoint no longer loads after a save was cut short: "
                  << e.what() << "\nwrite the new one beside it (path.tmp) and rename it over path";
  }
  EXPECT_EQ(done, 5) << "path must still hold the previous checkpoint";
  if (done == 5) {
    const auto got = other->parameters();
    for (size_t i = 0; i < saved.size(); ++i) EXPECT_TENSOR_CLOSE(got[i], saved[i], kExact);
  }
  std::filesystem::remove_all(dir);
}

TEST(L06Checkpoint, ResumeOnTwoRanksEqualsUninterruptedExactly) {
  const TrainConfig c = tiny(SyncMode::kBucketed, 4);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("l06_resume_" + std::to_string(::getpid()) + ".pt"))
                               .string();
  const auto full = ddp(c, 2, 4);
  const ByteDataset data = ByteDataset::builtin();
  std::vector<RankRun> resumed(2);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        {
          DdpTrainer first(c, ctx.comm, torch::kCPU, c.seed);
          for (int64_t step = 0; step < 2; ++step) {
            first.step(rank_batches(data, c, step, ctx.rank, 2));
          }
          save_checkpoint(path, ctx.rank, *first.model(), first.optimizer(), 2);
          ctx.comm->barrier()->wait();  // rank 0 has renamed the file before anyone reads it
        }
        DdpTrainer second(c, ctx.comm, torch::kCPU, c.seed + 100);  // other weights: overwritten
        const int64_t done = load_checkpoint(path, *second.model(), second.optimizer());
        RankRun& run = resumed[static_cast<size_t>(ctx.rank)];
        for (int64_t step = done; step < 4; ++step) {
          run.losses.push_back(second.step(rank_batches(data, c, step, ctx.rank, 2)));
        }
        for (const auto& p : second.model()->parameters()) run.params.push_back(p.detach().clone());
      },
      kTimeout);
  std::remove(path.c_str());
  const std::vector<float> tail(full[0].losses.begin() + 2, full[0].losses.end());
  EXPECT_TENSOR_CLOSE(torch::tensor(resumed[0].losses), torch::tensor(tail), kExact);
  for (size_t i = 0; i < full[0].params.size(); ++i) {
    EXPECT_TENSOR_CLOSE(resumed[1].params[i], full[0].params[i], kExact);
  }
}

}  // namespace
}  // namespace dtc::l06

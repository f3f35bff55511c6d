// Lesson 10 tests, part 4: Megatron's sequence parallelism on lesson 08's tensor parallelism.
// Its two operators against the gathered computation in closed form (2 and 4 thread-ranks),
// then tp x cp training runs against the single-process baseline's parameters (the digest of
// every full parameter, as lesson 08's tests), and the activation memory that sequence
// parallelism removes, measured by the counting allocator.
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtc/compare.h"
#include "dtc/data.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/observe.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "plain_baseline.h"
#include "program.h"
#include "sequence_parallel.h"
#include "sequence_parallel_given.h"

namespace dtc::l10 {
namespace {

using test::kTimeout;

class L10SeqPar : public ::testing::TestWithParam<int> {};

TEST_P(L10SeqPar, ReduceScatterSumsTheRanksRowsAndGathersTheGradient) {
  const int W = GetParam();
  const int64_t B = 2, T = 3 * W, h = 5, rows = T / W;
  run_ranks(
      W,
      [&](RankContext& ctx) {
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        // Rank r holds (r + 1) x 0, 1, 2, ...: the sum over the ranks is W(W+1)/2 x that. A
        // strided view, as a transposed tensor reaches it.
        const torch::Tensor base = torch::arange(B * T * h, torch::kFloat).view({B, T, h});
        auto x = (base * static_cast<float>(ctx.rank + 1)).requires_grad_();
        const torch::Tensor strided = x.transpose(1, 2).contiguous().transpose(1, 2);
        ASSERT_FALSE(strided.is_contiguous());
        const torch::Tensor y = reduce_scatter_sequence(strided, *rec);
        const float sum = static_cast<float>(W * (W + 1) / 2);
        EXPECT_TENSOR_CLOSE(y.detach(), base.narrow(1, ctx.rank * rows, rows) * sum, kExact);
        EXPECT_EQ(rec->events("alltoall").size(), 1u) << "one alltoall forward";
        rec->clear();
        // Rank r's upstream gradient is base's rows of rank r, every element distinct: the
        // input's gradient is every rank's, each row in its place, which is base itself.
        const torch::Tensor up = base.narrow(1, ctx.rank * rows, rows);
        (y.transpose(1, 2) * up.transpose(1, 2)).sum().backward();  // a strided gradient
        EXPECT_TENSOR_CLOSE(x.grad(), base, kExact);
        EXPECT_EQ(rec->events("allgather").size(), 1u) << "one allgather backward";
      },
      kTimeout);
}

TEST_P(L10SeqPar, GatherLinearIsTheGatheredColumnParallelLinear) {
  const int W = GetParam();
  const int64_t B = 2, T = 4 * W, in = 6, out = 4 * W, rows = T / W;
  torch::manual_seed(5);
  const torch::Tensor x_full = torch::randn({B, T, in}), w_full = torch::randn({out, in}),
                      b_full = torch::randn({out}), up = torch::randn({B, T, out});
  // The unsplit Linear, and its gradients, for loss = sum(y * up).
  auto xr = x_full.clone().requires_grad_(), wr = w_full.clone().requires_grad_(),
       br = b_full.clone().requires_grad_();
  const torch::Tensor yr = torch::nn::functional::linear(xr, wr, br);
  (yr * up).sum().backward();
  install_counting_allocator();
  run_ranks(
      W,
      [&](RankContext& ctx) {
        const int64_t cols = out / W;
        auto x = x_full.narrow(1, ctx.rank * rows, rows).clone().requires_grad_();
        auto w = w_full.narrow(0, ctx.rank * cols, cols).clone().requires_grad_();
        auto b = b_full.narrow(0, ctx.rank * cols, cols).clone().requires_grad_();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        const int64_t before = thread_cpu_memory().current;
        const torch::Tensor y = gather_linear(x, w, b, *ctx.comm);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        const int64_t held = thread_cpu_memory().current - before - y.numel() * 4;
        EXPECT_LT(held, B * T * in * 4)
            << "bytes kept between forward and backward besides the output: the gathered input "
               "(B, T, in) must not be among them";
        EXPECT_TENSOR_CLOSE(y.detach(), yr.detach().narrow(2, ctx.rank * cols, cols), kFp32Op);
        (y * up.narrow(2, ctx.rank * cols, cols)).sum().backward();
        EXPECT_TENSOR_CLOSE(x.grad(), xr.grad().narrow(1, ctx.rank * rows, rows), kFp32Op);
        EXPECT_TENSOR_CLOSE(w.grad(), wr.grad().narrow(0, ctx.rank * cols, cols), kFp32Op);
        EXPECT_TENSOR_CLOSE(b.grad(), br.grad().narrow(0, ctx.rank * cols, cols), kFp32Op);
        // Without a bias (the output head's case).
        auto x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
        const torch::Tensor y2 = gather_linear(x2, w2, torch::Tensor(), *ctx.comm);
        EXPECT_TENSOR_CLOSE(y2.detach(),
                            (yr.detach() - br.detach()).narrow(2, ctx.rank * cols, cols), kFp32Op);
        (y2 * up.narrow(2, ctx.rank * cols, cols)).sum().backward();
        EXPECT_TENSOR_CLOSE(x2.grad(), xr.grad().narrow(1, ctx.rank * rows, rows), kFp32Op);
      },
      kTimeout);
}

INSTANTIATE_TEST_SUITE_P(Ranks, L10SeqPar, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// ---------------------------------------------------------------------------------------------
// Whole runs
// ---------------------------------------------------------------------------------------------

struct SpCase {
  int tp, cp, dp;
  bool sequence_parallel;
  Attention attention;
  bool zigzag;
};

std::string name(const SpCase& k) {
  return "tp " + std::to_string(k.tp) + (k.sequence_parallel ? " (SP)" : "") + " x cp " +
         std::to_string(k.cp) + " x dp " + std::to_string(k.dp) + ", " +
         attention_name(k.attention) + (k.zigzag ? " zig-zag" : "");
}

// Trains on tp x cp x dp thread-ranks; the digest of the full model (the shards summed over the
// grid) must be the baseline's, each parameter's sum of squares within kFp32Steps' rtol and its
// sum within rtol of sqrt(numel x sumsq) (lesson 08's rule), and the losses the baseline's.
void expect_matches_baseline(const std::string& ref_name, const SpCase& k) {
  const test::ReferenceCase ref = test::reference_case(ref_name);
  CpConfig c;
  c.run = ref.config;
  c.attention = k.attention;
  c.zigzag = k.zigzag;
  c.sequence_parallel = k.sequence_parallel;
  const auto steps = static_cast<int64_t>(ref.losses.size());
  const test::BaselineRun base = test::plain_baseline(c.run, steps);
  const Mesh mesh = make_mesh(k.tp * k.cp * k.dp, k.dp, k.cp, k.tp);
  std::mutex mu;
  std::vector<float> losses;
  nlohmann::json digest;
  run_ranks(
      mesh.world(),
      [&](RankContext& ctx) {
        const Groups g = make_groups(ctx.store, mesh, ctx.rank, BackendKind::kGloo, kTimeout);
        nlohmann::json d;
        CpRunOptions run;
        run.steps = steps;
        run.digest = true;
        CpRunResult r = train_cp(c, *g.cp, *g.replicas, g.tp.get(), run);
        auto l = r.losses;
        d = r.digest;
        std::lock_guard<std::mutex> lock(mu);
        if (ctx.rank == 0) {
          losses = l;
          digest = d;
        }
      },
      kTimeout);
  SCOPED_TRACE(name(k));
  std::vector<std::string> names;
  std::vector<NamedPiece> pieces;
  size_t i = 0;
  for (const auto& item : Gpt(c.run.model)->named_parameters()) {
    names.push_back(item.key());
    pieces.emplace_back(item.key(), base.params[i++]);
  }
  const nlohmann::json want = param_digest(names, pieces);
  ASSERT_EQ(digest.size(), want.size()) << "param_digest: every parameter";
  for (size_t p = 0; p < want.size(); ++p) {
    SCOPED_TRACE(want[p]["name"].get<std::string>());
    const double sumsq = want[p]["sumsq"].get<double>();
    const double scale = std::sqrt(want[p]["numel"].get<double>() * sumsq);
    EXPECT_EQ(digest[p]["numel"], want[p]["numel"]);
    EXPECT_NEAR(digest[p]["sumsq"].get<double>(), sumsq, kFp32Steps.rtol * sumsq + kFp32Steps.atol);
    EXPECT_NEAR(digest[p]["sum"].get<double>(), want[p]["sum"].get<double>(),
                kFp32Steps.rtol * scale + kFp32Steps.atol);
  }
  EXPECT_TENSOR_CLOSE(torch::tensor(losses), torch::tensor(base.losses), kFp32Steps);
}

TEST(L10SeqParTraining, TensorParallelWithAndWithoutSequenceParallelism) {
  expect_matches_baseline("tiny_tied", {2, 1, 1, true, Attention::kRing, false});
  expect_matches_baseline("tiny_untied", {2, 1, 1, false, Attention::kRing, false});
}

TEST(L10SeqParTraining, SequenceAndContextParallelTogether) {
  expect_matches_baseline("tiny_tied", {2, 2, 1, true, Attention::kRing, true});
  expect_matches_baseline("tiny_untied", {2, 2, 1, true, Attention::kUlysses, false});
}

// Each rank's activation bytes of a tp x cp model of @p layers layers, three readings that must
// agree (measure_activation_bytes: the counting allocator, settled after gloo's buffers).
std::vector<int64_t> measure(const SpCase& k, int64_t layers) {
  install_counting_allocator();
  RunConfig run;
  run.model.layers = layers;
  run.model.hidden = 32;
  run.model.heads = 4;
  run.model.ctx = 64;
  run.batch = 2;
  const Mesh mesh = make_mesh(k.tp * k.cp * k.dp, k.dp, k.cp, k.tp);
  std::mutex mu;
  std::vector<int64_t> got(static_cast<size_t>(mesh.world()));
  run_ranks(
      mesh.world(),
      [&](RankContext& ctx) {
        const Groups g = make_groups(ctx.store, mesh, ctx.rank, BackendKind::kGloo, kTimeout);
        TpCpGpt model(make_gpt(run.model, run.seed), *g.tp, *g.cp, k.attention, k.zigzag,
                      k.sequence_parallel);
        const Batch batch = ByteDataset::builtin().batch(run.seed, 0, run.batch, run.model.ctx);
        Batch mine;
        mine.inputs = shard_sequence(batch.inputs, g.cp->getRank(), k.cp, k.zigzag);
        mine.targets = shard_sequence(batch.targets, g.cp->getRank(), k.cp, k.zigzag);
        const int64_t first = measure_activation_bytes(model, mine);
        EXPECT_EQ(measure_activation_bytes(model, mine), first) << "the same forward again";
        std::lock_guard<std::mutex> lock(mu);
        got[static_cast<size_t>(ctx.rank)] = first;
      },
      kTimeout);
  return got;
}

TEST(L10SeqParMemory, EachLayerKeepsTheClosedFormToTheByte) {
  // One layer's bytes = the 2-layer model's minus the 1-layer model's, on every rank: the
  // LayerNorm regions whole on each TP rank without sequence parallelism, split with it.
  for (const SpCase& k : {SpCase{2, 1, 1, false, Attention::kRing, false},
                          SpCase{2, 1, 1, true, Attention::kRing, false},
                          SpCase{2, 2, 1, true, Attention::kRing, true},
                          SpCase{2, 2, 1, false, Attention::kAllGather, true},
                          SpCase{2, 2, 1, true, Attention::kUlysses, false}}) {
    const auto one = measure(k, 1), two = measure(k, 2);
    const int64_t want = predict_layer_activation_bytes(k.attention, 2, 64, 32, 4, k.cp, 4, k.tp,
                                                        k.sequence_parallel);
    for (size_t r = 0; r < one.size(); ++r) {
      EXPECT_EQ(two[r] - one[r], want) << name(k) << ", rank " << r << ": one layer's bytes";
    }
  }
  // Sequence parallelism takes exactly the LayerNorm regions' (tp - 1)/tp: 4 n h + 4 n fp32
  // elements, n = 128 tokens, h = 32, tp 2.
  const int64_t no_sp = predict_layer_activation_bytes(Attention::kRing, 2, 64, 32, 4, 1, 4, 2);
  const int64_t sp =
      predict_layer_activation_bytes(Attention::kRing, 2, 64, 32, 4, 1, 4, 2, /*sp=*/true);
  EXPECT_EQ(no_sp - sp, 4 * (4 * 128 * 32 + 4 * 128) / 2);
}

TEST(L10SeqParBytes, TheSameBytesAsTensorParallelismPlusTheReGathers) {
  // One forward and backward on tp 2, the TP group recorded. On a ring, an allreduce of N bytes
  // sends 2(t-1)/t N a rank, a reduce-scatter of N (an alltoall here) (t-1)/t N, an all-gather
  // of a rank's N/t (t-1) N/t. Sequence parallelism turns each of tensor parallelism's
  // allreduces into a reduce-scatter and an all-gather, the same bytes, and adds one all-gather
  // per gather_linear in backward (its input gathered again): 2 a layer and the head's, of
  // N = B T h x 4 bytes each.
  const int t = 2;
  RunConfig run;
  run.model.layers = 2;
  run.model.hidden = 32;
  run.model.heads = 4;
  run.model.ctx = 16;
  run.batch = 2;
  const double n_bytes = 2.0 * 16 * 32 * 4;
  std::mutex mu;
  std::vector<double> wire(2, 0.0);  // [without SP, with SP], rank 0
  for (bool sp : {false, true}) {
    run_ranks(
        t,
        [&](RankContext& ctx) {
          auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
          auto cp = new_subgroup(ctx.store, "solo" + std::to_string(ctx.rank), {ctx.rank}, ctx.rank,
                                 BackendKind::kGloo, kTimeout);
          TpCpGpt model(make_gpt(run.model, run.seed), *rec, *cp, Attention::kRing, false, sp);
          const Batch batch = ByteDataset::builtin().batch(run.seed, 0, run.batch, run.model.ctx);
          rec->clear();
          model->loss(batch).backward();
          const double f = (t - 1.0) / t;
          const double w = 2 * f * static_cast<double>(rec->bytes("allreduce")) +
                           f * static_cast<double>(rec->bytes("alltoall")) +
                           (t - 1.0) * static_cast<double>(rec->bytes("allgather"));
          std::lock_guard<std::mutex> lock(mu);
          if (ctx.rank == 0) wire[sp ? 1 : 0] = w;
        },
        kTimeout);
  }
  const double regathers = (2.0 * run.model.layers + 1) * (t - 1.0) / t * n_bytes;
  EXPECT_DOUBLE_EQ(wire[1] - wire[0], regathers)
      << "bytes a rank sends in one step: tensor parallel " << wire[0] << ", with sequence "
      << "parallelism " << wire[1];
}

TEST(L10SeqParTrainingGiven, RefusesWhatDoesNotSplit) {
  CpConfig c;
  c.sequence_parallel = true;
  run_ranks(
      2,
      [&](RankContext& ctx) {
        try {
          train_cp(c, *ctx.comm, *ctx.comm, /*tp=*/nullptr, CpRunOptions{});  // no TP group
          ADD_FAILURE() << "--sequence-parallel without --tp must be refused";
        } catch (const UsageError& e) {
          EXPECT_EQ(e.subject(), "--sequence-parallel") << e.what();
        }
      },
      kTimeout);
  EXPECT_THROW(make_mesh(4, 0, 0, 3), UsageError) << "tp 3 does not divide 4 ranks";
  // --cp 3 started as one process: the error names the world size and what to launch.
  try {
    make_mesh(1, 0, 3, 1);
    ADD_FAILURE() << "--cp 3 on one rank must be refused";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.subject(), "--cp") << what;
    EXPECT_NE(what.find("needs a multiple of 3 ranks, but this run has 1"), std::string::npos)
        << what;
    EXPECT_NE(what.find("--nproc_per_node 3"), std::string::npos) << what;
    EXPECT_EQ(what.find("dp 0"), std::string::npos) << "no degree of 0 in the message: " << what;
  }
  const Mesh g = make_mesh(8, 0, 2, 2);
  EXPECT_EQ(g.size("dp_replicate"), 2);
  EXPECT_EQ(g.group(5, {"cp"}), (std::vector<int>{5, 7})) << "tp fastest, then cp";
  EXPECT_EQ(g.group(5, {"dp_replicate", "cp"}), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(g.group(5, {"tp"}), (std::vector<int>{4, 5}));
}

}  // namespace
}  // namespace dtc::l10

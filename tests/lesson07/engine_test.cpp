// Lesson 07 tests, part 2: the engine. Every stage, on 2 and 3 thread-ranks, tied and untied,
// must give the parameters and losses of plain single-process AdamW training (train_baseline:
// LibTorch's torch::optim::AdamW on the full batch) after 10 steps, within kFp32Steps; the losses
// of PyTorch's own run (tests/reference/lesson02_reference.json) within kFp32VsPyTorch; bytes per
// step by the ring's count; and sharded checkpoints saved by 2 ranks load on 3 (re-sharded) and
// consolidate to the unsharded model.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include <unistd.h>

#include "adamw_params.h"
#include "bf16_policy.h"
#include "dtc/compare.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/observe.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "program.h"
#include "zero.h"

namespace dtc::l07 {
namespace {

using test::kTimeout;

GptConfig tiny(bool tied) {
  GptConfig c;
  c.vocab = 256;
  c.ctx = 32;
  c.hidden = 64;
  c.layers = 2;
  c.heads = 4;
  c.tied = tied;
  return c;
}

// The baseline's parameters, flattened in the engine's unit order (names from the layout).
torch::Tensor flat_in_unit_order(Gpt& model, const FlatLayout& layout) {
  std::vector<torch::Tensor> parts;
  auto named = model->named_parameters();
  for (const Unit& unit : layout.units) {
    for (const auto& name : unit.names) parts.push_back(named[name].detach().reshape({-1}));
  }
  return torch::cat(parts);
}

struct RunResult {
  std::vector<float> losses;       // global batch: mean over ranks
  torch::Tensor params;            // full, unpadded, unit order (rank 0's view)
  std::vector<int64_t> bytes;      // bytes sent per step by rank 0, by the ring's count, observed
  std::vector<int64_t> counted;    // the same, as the engine's CountingComm counted them
  std::vector<double> grad_norms;  // rank 0's last_grad_norm() after each step (clipping)
  FlatLayout layout;
  torch::Tensor model_params;  // stages 0-2: the model's own parameters, flat in unit order
};

// The bytes a rank sends, by the ring's count (lesson 03), for the calls a RecordingComm saw:
// the course's reduce-scatter is an alltoall of W chunks ((W-1)/W of its input leaves), the
// all-gather sends its chunk to W-1 ranks, an allreduce is a reduce-scatter plus an all-gather.
int64_t ring_bytes(const std::vector<CommEvent>& events, int world) {
  int64_t bytes = 0;
  for (const auto& e : events) {
    if (e.op == "alltoall" || e.op == "reduce_scatter") bytes += e.bytes / world * (world - 1);
    if (e.op == "allgather") bytes += e.bytes * (world - 1);
    if (e.op == "allreduce") bytes += 2 * (e.bytes / world) * (world - 1);
  }
  return bytes;
}

// Trains @p steps steps at @p stage on @p world thread-ranks from the initial weights.
RunResult train(const GptConfig& config, int stage, int world, int64_t batch, int64_t steps,
                bool prefetch = false, bool recompute = false, bool reshard = true, double clip = 0,
                Precision precision = Precision::kFp32, Precision reduce = Precision::kFp32) {
  RunResult result;
  result.losses.assign(static_cast<size_t>(steps), 0.0f);
  std::mutex mu;
  const ByteDataset data = ByteDataset::builtin();
  run_ranks(
      world,
      [&](RankContext& ctx) {
        Gpt model(config);
        init_weights(model, 1);
        ZeroOptions o;
        o.stage = stage;
        o.prefetch = prefetch;
        o.recompute = recompute;
        o.reshard_after_forward = reshard;
        o.clip_norm = clip;
        o.precision = precision;
        o.reduce = reduce;
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        ZeroEngine engine(model, rec, o);
        const int64_t rows = batch / world;
        for (int64_t step = 0; step < steps; ++step) {
          const int64_t before = engine.comm().bytes_sent();
          rec->clear();
          const float loss =
              engine.forward_backward(data.batch(1, step, rows, config.ctx, ctx.rank * rows));
          engine.optimizer_step();
          std::lock_guard<std::mutex> lock(mu);
          result.losses[static_cast<size_t>(step)] += loss / static_cast<float>(world);
          if (ctx.rank == 0) result.grad_norms.push_back(engine.last_grad_norm());
          if (ctx.rank == 0) {
            result.bytes.push_back(ring_bytes(rec->events(), world));
            result.counted.push_back(engine.comm().bytes_sent() - before);
          }
        }
        auto params = engine.full_parameters();
        if (ctx.rank == 0) {
          result.params = params;
          result.layout = engine.layout();
          if (stage <= 2) result.model_params = flat_in_unit_order(engine.model(), engine.layout());
        }
      },
      kTimeout);
  return result;
}

// Compares full parameters in unit order. One documented exception: the key bias (the middle third
// of each block's c_attn.bias). Its gradient is exactly zero in exact arithmetic (adding a
// constant to every key adds the same q.b to every score of a query, and softmax ignores it), so
// what backward computes there is rounding noise, which AdamW normalises into steps of up to
// about lr. Those elements are compared with an absolute tolerance of steps * lr, AdamW's bound
// on how far an element can move (Kingma & Ba 2015, sec. 2.1); every other element with
// kFp32Steps.
void expect_params_close(const torch::Tensor& got, const torch::Tensor& expected,
                         const FlatLayout& layout, int64_t steps) {
  auto g = got.clone(), e = expected.clone();
  std::vector<torch::Tensor> gk, ek;
  int64_t off = 0;
  for (const Unit& unit : layout.units) {
    for (size_t k = 0; k < unit.names.size(); ++k) {
      const int64_t n = c10::multiply_integers(unit.shapes[k]);
      if (unit.names[k].find("attn.c_attn.bias") != std::string::npos) {
        const int64_t h = n / 3;
        gk.push_back(g.narrow(0, off + h, h).clone());
        ek.push_back(e.narrow(0, off + h, h).clone());
        g.narrow(0, off + h, h).zero_();
        e.narrow(0, off + h, h).zero_();
      }
      off += n;
    }
  }
  EXPECT_ADAMW_PARAMS_CLOSE(g, e, steps, AdamWOptions{}.lr);
  const double adamw_reach = static_cast<double>(steps) * AdamWOptions{}.lr;
  const Tolerance key_bias{0.0, adamw_reach,
                           "key bias: zero gradient in exact arithmetic, AdamW moves <= lr/step"};
  EXPECT_TENSOR_CLOSE(torch::cat(gk), torch::cat(ek), key_bias);
}

void expect_matches_baseline(const RunResult& got, const GptConfig& config, int64_t batch,
                             int64_t steps, double clip = 0) {
  Baseline base = train_baseline(config, 1, batch, steps, AdamWOptions{}, clip);
  expect_params_close(got.params, flat_in_unit_order(base.model, got.layout), got.layout, steps);
  EXPECT_TENSOR_CLOSE(torch::tensor(got.losses), torch::tensor(base.losses), kFp32Steps);
}

// The ledger's per-rank bytes (ZeRO paper Fig. 1 in fp32 + AdamW terms: 4 + 4 + 8 bytes per
// parameter) and the paper's communication volumes, in closed form. Given code.
TEST(L07LedgerGiven, StageFormulas) {
  const int64_t psi = 1200;
  const int w = 4;
  const auto s0 = predict_stage_memory(psi, 0, w), s1 = predict_stage_memory(psi, 1, w),
             s2 = predict_stage_memory(psi, 2, w), s3 = predict_stage_memory(psi, 3, w);
  EXPECT_DOUBLE_EQ(s0.total(), 16.0 * psi);
  EXPECT_DOUBLE_EQ(s1.total(), 4.0 * psi + 4.0 * psi + 8.0 * psi / w);
  EXPECT_DOUBLE_EQ(s2.total(), 4.0 * psi + 12.0 * psi / w);
  EXPECT_DOUBLE_EQ(s3.total(), 16.0 * psi / w);
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 0, w), 2.0 * 0.75 * 4 * psi);
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 2, w), 2.0 * 0.75 * 4 * psi);
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 3, w), 3.0 * 0.75 * 4 * psi);
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 3, w, false), 2.0 * 0.75 * 4 * psi);
}

class L07Stages : public testing::TestWithParam<int> {};

TEST_P(L07Stages, MatchTheBaselineOnTwoAndThreeRanks) {
  for (int world : {2, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << GetParam() << ", world " << world);
    const auto got = train(tiny(true), GetParam(), world, 6, 10);
    expect_matches_baseline(got, tiny(true), 6, 10);
  }
}

TEST_P(L07Stages, UntiedMatchesTheBaseline) {
  SCOPED_TRACE(testing::Message() << "stage " << GetParam());
  const auto got = train(tiny(false), GetParam(), 2, 4, 4, /*prefetch=*/GetParam() == 3);
  expect_matches_baseline(got, tiny(false), 4, 4);
}

// FSDP's reshard_after_forward=False (FSDP1 SHARD_GRAD_OP): a block's parameters stay gathered
// from its forward to its backward. One gather per unit and one reduce-scatter: 2 Psi a step by
// the ring's count on the padded buffers, not stage 3's 3 Psi; the same parameters as the
// baseline; and the rank holds every block's parameters at the end of forward.
TEST(L07ReshardAfterForward, FalseSendsTwoPsiAndKeepsTheBlocks) {
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(testing::Message() << "recompute " << recompute);
    const auto got = train(tiny(true), 3, 2, 6, 4, false, recompute, /*reshard=*/false);
    expect_matches_baseline(got, tiny(true), 6, 4);
    const auto& L = got.layout;
    EXPECT_EQ(got.bytes.front(), (2 - 1) * (2 * L.padded / 2) * 4)
        << "2 Psi: every unit gathered once, every gradient reduce-scattered once";
  }
}

// HSDP (FSDP's HYBRID_SHARD) on 4 ranks: shard groups {0, 1} and {2, 3} (what would be two
// nodes), replicate groups {0, 2} and {1, 3}. Each rank trains its own rows of the global batch;
// after each unit's reduce-scatter in its shard group, the shard's gradient is averaged over the
// replicas: the parameters are the single-process baseline's, at stage 2 and stage 3. Seen from
// outside, by RecordingComms on both groups: the shard group carries what ZeRO on 2 ranks does,
// and across the replicas one allreduce of the shard per step: 2 (R-1)/R x shard x 4 bytes.
// HSDP on 4 thread-ranks: shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}.
struct HsdpRun {
  RunResult got;
  double first_norm = 0;
  int64_t shard_bytes = 0, replicate_bytes = 0, replicate_counted = 0;  // rank 0, last step
};

HsdpRun hsdp_run(const GptConfig& config, int stage, int64_t batch, int64_t steps,
                 Precision precision = Precision::kFp32) {
  const ByteDataset data = ByteDataset::builtin();
  HsdpRun run;
  RunResult& got = run.got;
  got.losses.assign(static_cast<size_t>(steps), 0.0f);
  std::mutex mu;
  run_ranks(
      4,
      [&](RankContext& ctx) {
        const std::vector<int> shard =
            ctx.rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
        const std::vector<int> replicate =
            ctx.rank % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
        auto rec_shard = c10::make_intrusive<RecordingComm>(
            new_subgroup(ctx.store, fmt::format("shard{}", ctx.rank / 2), shard, ctx.rank,
                         BackendKind::kGloo, kTimeout));
        auto rec_replicate = c10::make_intrusive<RecordingComm>(
            new_subgroup(ctx.store, fmt::format("replicate{}", ctx.rank % 2), replicate, ctx.rank,
                         BackendKind::kGloo, kTimeout));
        Gpt model(config);
        init_weights(model, 1);
        ZeroOptions o;
        o.stage = stage;
        o.precision = precision;
        // A clip that never clips: the first step's global gradient norm, from the shards,
        // tells whether the replicas' allreduce averaged (AdamW alone would hide a sum).
        o.clip_norm = 1e9;
        ZeroEngine engine(model, rec_shard, o, rec_replicate);
        const int64_t rows = batch / 4;
        for (int64_t step = 0; step < steps; ++step) {
          rec_shard->clear();
          rec_replicate->clear();
          const int64_t before = engine.replicate_comm()->bytes_sent();
          const float loss =
              engine.forward_backward(data.batch(1, step, rows, config.ctx, ctx.rank * rows));
          engine.optimizer_step();
          {
            std::lock_guard<std::mutex> lock(mu);
            got.losses[static_cast<size_t>(step)] += loss / 4.0f;
          }
          if (ctx.rank == 0 && step == 0) run.first_norm = engine.last_grad_norm();
          if (ctx.rank == 0 && step == steps - 1) {
            run.shard_bytes = ring_bytes(rec_shard->events(), 2);
            run.replicate_bytes = ring_bytes(rec_replicate->events(), 2);
            run.replicate_counted = engine.replicate_comm()->bytes_sent() - before;
          }
        }
        auto params = engine.full_parameters();
        if (ctx.rank == 0) {
          got.params = params;
          got.layout = engine.layout();
        }
      },
      kTimeout);
  return run;
}

TEST(L07Hsdp, ShardGroupsOfTwoReplicatedTwiceMatchTheBaseline) {
  const GptConfig config = tiny(true);
  const int64_t batch = 8, steps = 4;
  const ByteDataset data = ByteDataset::builtin();
  for (int stage : {2, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    const HsdpRun run = hsdp_run(config, stage, batch, steps);
    const RunResult& got = run.got;
    const double first_norm = run.first_norm;
    const int64_t shard_bytes = run.shard_bytes, replicate_bytes = run.replicate_bytes,
                  replicate_counted = run.replicate_counted;
    expect_matches_baseline(got, config, batch, steps);
    Gpt model(config);
    init_weights(model, 1);
    const Batch x = data.batch(1, 0, batch, config.ctx);
    auto logits = model->forward(x.inputs);
    torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), x.targets.view({-1}))
        .backward();
    const double want = torch::nn::utils::clip_grad_norm_(model->parameters(), 1e9);
    EXPECT_NEAR(first_norm, want, 1e-4 * want)
        << "the first step's gradient is the mean over all 4 ranks (clip_grad_norm_ on one "
           "process): divided by W = G x R";
    const auto& L = got.layout;
    EXPECT_EQ(L.world, 2) << "the layout shards over the shard group";
    EXPECT_EQ(replicate_bytes, 2 * (2 - 1) * L.shard * 4 / 2)
        << "one allreduce of the shard across the 2 replicas per step";
    EXPECT_EQ(replicate_counted, replicate_bytes) << "the replicate group's CountingComm";
    const auto plain = train(config, stage, 2, 4, 1, false, false, true, /*clip=*/1e9);
    EXPECT_EQ(shard_bytes, plain.bytes.front())
        << "inside a shard group: ZeRO on 2 ranks (with the clip's 8-byte norm allreduce)";
  }
}

// A stage without sharded gradients cannot be HSDP here: a clear error, before any collective.
TEST(L07HsdpGiven, StageOneIsAUsageError) {
  run_ranks(
      1,
      [&](RankContext& ctx) {
        Gpt model(tiny(true));
        ZeroOptions o;
        o.stage = 1;
        EXPECT_THROW(ZeroEngine(model, ctx.comm, o, ctx.comm), UsageError);
      },
      kTimeout);
}

// Global-norm clipping on shards: each rank's squared norm of what it owns, summed over the
// ranks, is the unsharded gradient's; clipping by it gives the parameters of
// torch::nn::utils::clip_grad_norm_ on one process, at every stage, on 2 and 3 ranks. The norm
// 0.05 clips every step here (the first step's norm is printed by the check below).
TEST(L07Clip, ShardedClipEqualsTheUnshardedClip) {
  const double clip = 0.05;
  for (int stage : {0, 1, 2, 3}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE(testing::Message() << "stage " << stage << ", world " << world);
      const auto got = train(tiny(true), stage, world, 6, 4, false, false, true, clip);
      expect_matches_baseline(got, tiny(true), 6, 4, clip);
      // The first step's norm, against clip_grad_norm_'s on the unsharded gradient.
      Gpt model(tiny(true));
      init_weights(model, 1);
      const Batch x = ByteDataset::builtin().batch(1, 0, 6, tiny(true).ctx);
      auto logits = model->forward(x.inputs);
      torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), x.targets.view({-1}))
          .backward();
      const double want = torch::nn::utils::clip_grad_norm_(model->parameters(), 1e9);
      ASSERT_FALSE(got.grad_norms.empty());
      EXPECT_NEAR(got.grad_norms.front(), want, 1e-4 * want)
          << "the global norm, from the shards (clip_grad_norm_ on one process)";
      EXPECT_GT(got.grad_norms.front(), clip) << "the test must clip";
    }
  }
}

// Stage 3 with activation recomputation (each block's input kept, the block recomputed in
// backward) trains the same parameters as without it, with and without prefetch, and sends the
// same bytes: recomputation adds compute, not communication.
TEST(L07Stage3Recompute, MatchesTheBaselineAndSendsTheSameBytes) {
  for (bool prefetch : {false, true}) {
    SCOPED_TRACE(testing::Message() << "prefetch " << prefetch);
    const auto got = train(tiny(true), 3, 2, 6, 4, prefetch, /*recompute=*/true);
    expect_matches_baseline(got, tiny(true), 6, 4);
    const auto plain = train(tiny(true), 3, 2, 6, 1, prefetch, /*recompute=*/false);
    EXPECT_EQ(got.bytes.front(), plain.bytes.front()) << "observed bytes of one step";
  }
}

// Bytes per step, by the ring's definition, from the layout: DDP allreduces the padded buffer
// (2 (W-1)/W N), stages 1-2 reduce-scatter and all-gather it (the same), stage 3 gathers every
// block twice and the outer unit once, and reduce-scatters everything (3N minus the outer unit's
// second gather). Against the ZeRO paper's 2 Psi / 3 Psi, they differ by the padding and that one
// unit only.
TEST_P(L07Stages, BytesPerStepByTheRingCount) {
  const int stage = GetParam();
  for (int world : {2, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage << ", world " << world);
    const auto got = train(tiny(true), stage, world, 6, 2);
    const auto& L = got.layout;
    const int64_t units = stage == 3 ? 3 * L.padded - L.units[0].padded : 2 * L.padded;
    const int64_t expected = (world - 1) * (units / world) * 4;
    for (int64_t b : got.bytes) EXPECT_EQ(b, expected) << "bytes of the calls made, observed";
    EXPECT_EQ(got.counted, got.bytes) << "CountingComm's count differs from the calls it made";
    const double paper =
        (stage == 3 ? 3.0 : 2.0) * (world - 1.0) / world * 4.0 * static_cast<double>(L.numel);
    const double outer = stage == 3 ? (world - 1.0) / world * 4.0 * L.units[0].padded : 0.0;
    EXPECT_NEAR(static_cast<double>(got.bytes.front()), paper - outer,
                (stage == 3 ? 3.0 : 2.0) * 4.0 * static_cast<double>(L.padded - L.numel))
        << "ZeRO paper sec. 7: 2 Psi (DDP, stages 1-2), 3 Psi (stage 3)";
  }
}

INSTANTIATE_TEST_SUITE_P(AllStages, L07Stages, testing::Values(0, 1, 2, 3),
                         [](const testing::TestParamInfo<int>& info) {
                           return "stage" + std::to_string(info.param);
                         });

#define SKIP_WITHOUT_GLOO_BF16()                                             \
  if (!kGlooBf16)                                                            \
  GTEST_SKIP() << "LibTorch 1.13's gloo has no bf16 collectives (\"Invalid " \
                  "scalar type\"): bf16 ZeRO runs on LibTorch 2.x"

// What a rank holds, seen by the counting allocator (per thread) at each collective it calls:
// ZeRO's point is memory, so the learner suite measures it. A model whose blocks are much
// larger than their activations (h 64, 6 blocks, 1 row of 16 tokens): a block's unit is about
// 200 KB, the input a block keeps about 4 KB; the bound is two units, and keeping every unit
// adds five. The engine frees a released buffer's memory itself (release_unit and
// reduce_unit_gradient: free_storage), since gloo's worker thread drops its reference to a
// finished collective a moment after wait() returns: before it did, the bytes held at a
// collective depended on that thread (seen on 2 loaded cores: 1 run in 25 past the backward
// bound, 918,128 bytes). Now they are the same in every run: 50 of 50 under load.
struct Held {
  int64_t unit_bytes = 0;                  // one block's padded unit, fp32
  std::vector<int64_t> forward_gathers;    // stage 3: thread bytes at each block's gather, forward
  std::vector<int64_t> backward_gathers;   // stage 3: ... and at each block's gather, backward
  std::vector<int64_t> backward_scatters;  // thread bytes at each block's reduce-scatter
};

Held held_during_one_step(int stage, bool recompute = false, int64_t ctx = 4, bool reshard = true,
                          Precision precision = Precision::kFp32,
                          Precision reduce = Precision::kFp32) {
  GptConfig config = tiny(true);
  config.layers = 6;
  config.ctx = ctx;
  install_counting_allocator();
  Held held;
  run_ranks(
      2,
      [&](RankContext& ctx) {
        Gpt model(config);
        init_weights(model, 1);
        ZeroOptions o;
        o.stage = stage;
        o.recompute = recompute;
        o.reshard_after_forward = reshard;
        o.precision = precision;
        o.reduce = reduce;
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        ZeroEngine engine(model, rec, o);
        const Batch batch = ByteDataset::builtin().batch(1, 0, 1, config.ctx, ctx.rank);
        rec->clear();
        engine.forward_backward(batch);
        if (ctx.rank != 0) return;
        held.unit_bytes = engine.layout().units[1].padded * (precision == Precision::kBf16 ? 2 : 4);
        const auto gathers = rec->events("allgather");
        const auto scatters = rec->events("alltoall");
        const size_t blocks = static_cast<size_t>(config.layers);
        // Stage 3 gathers the outer unit, then blocks 1..L forward, then L..1 backward.
        for (size_t i = 1; stage == 3 && i <= blocks && i < gathers.size(); ++i) {
          held.forward_gathers.push_back(gathers[i].thread_bytes);
        }
        for (size_t i = blocks + 1; stage == 3 && i <= 2 * blocks && i < gathers.size(); ++i) {
          held.backward_gathers.push_back(gathers[i].thread_bytes);
        }
        // Stages 2-3 reduce-scatter each block's gradients as backward leaves it, last first.
        for (size_t i = 0; i < blocks && i < scatters.size(); ++i) {
          held.backward_scatters.push_back(scatters[i].thread_bytes);
        }
      },
      kTimeout);
  return held;
}

// The bytes rank 0 came to hold between the first and the last of @p samples (one per block),
// against @p units units (two by default: see Held).
void expect_held_under_two_units(const std::vector<int64_t>& samples, int64_t unit_bytes,
                                 const std::string& between, const std::string& rule,
                                 int64_t units = 2) {
  ASSERT_EQ(samples.size(), 6u) << "one sample per block, " << between;
  const int64_t growth = samples.back() - samples.front();
  EXPECT_LT(growth, units * unit_bytes)
      << between << ", rank 0 came to hold " << growth << " more bytes; a block's unit is "
      << unit_bytes << ": " << rule;
}

TEST(L07Memory, Stage3ReleasesEachGatheredUnit) {
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(testing::Message() << "recompute " << recompute);
    const Held h = held_during_one_step(3, recompute);
    expect_held_under_two_units(h.forward_gathers, h.unit_bytes,
                                "from the first block's gather in forward to the last one's",
                                "stage 3 must release a block's gathered parameters before it "
                                "gathers the next (keeping its activations is fine)");
    // In backward more is in flight at a gather than in forward: the block just done's full
    // gradient and its reduce-scatter's unit-sized receive buffer: measured 2.6 and 3.0 units of
    // growth (518,256 and 596,736 bytes, the two cases); keeping every block's parameters adds
    // five more.
    expect_held_under_two_units(h.backward_gathers, h.unit_bytes,
                                "from the last block's gather in backward to the first one's",
                                "stage 3 must release a block's parameters once its backward is "
                                "done",
                                /*units=*/4);
  }
}

// reshard_after_forward=false keeps each block's gathered parameters until its backward: from
// the first block's gather to the last one's the rank comes to hold the five earlier blocks.
TEST(L07Memory, NoReshardAfterForwardHoldsEveryBlock) {
  const Held h = held_during_one_step(3, false, 4, /*reshard=*/false);
  ASSERT_EQ(h.forward_gathers.size(), 6u);
  EXPECT_GE(h.forward_gathers.back() - h.forward_gathers.front(), 4 * h.unit_bytes)
      << "FSDP's reshard_after_forward=False: the parameters stay gathered through forward";
}

// Without recomputation stage 3 keeps each block's activations through forward, as stage 2
// does; with it, only each block's input. At 32 tokens of 64 features a block's activations are
// many times its input (Q, K, V, the 4 x 32 x 32 scores, the MLP's 4h-wide tensors), so the
// rank's growth between the first and the last forward gather, seen by the counting allocator,
// tells the two apart.
TEST(L07Memory, Stage3KeepsActivationsUnlessItRecomputes) {
  const Held kept = held_during_one_step(3, /*recompute=*/false, /*ctx=*/32);
  const Held recomputed = held_during_one_step(3, /*recompute=*/true, /*ctx=*/32);
  ASSERT_EQ(kept.forward_gathers.size(), 6u);
  ASSERT_EQ(recomputed.forward_gathers.size(), 6u);
  const int64_t with_activations = kept.forward_gathers.back() - kept.forward_gathers.front();
  const int64_t inputs_only =
      recomputed.forward_gathers.back() - recomputed.forward_gathers.front();
  // Five blocks' activations at 32 tokens x 64 features (fp32): far more than five inputs.
  const int64_t input_bytes = 32 * 64 * 4;
  EXPECT_LE(inputs_only, 5 * input_bytes + kept.unit_bytes)
      << "recompute keeps only each block's input (" << input_bytes << " bytes)";
  EXPECT_GT(with_activations, inputs_only + 5 * 4 * input_bytes)
      << "without recompute the blocks' activations (several inputs' worth each) are kept";
}

TEST(L07Memory, Stage2KeepsOnlyGradientShards) {
  const Held h = held_during_one_step(2);
  expect_held_under_two_units(h.backward_scatters, h.unit_bytes,
                              "from the last block's reduce-scatter to the first one's",
                              "stage 2 must free a unit's full gradient once it is "
                              "reduce-scattered");
}

// The same in bf16 with the reduction in fp32 (the paper's 2 + 2 + 12 with Megatron's fp32
// reduce): the bf16 gradient buffer and the fp32 copy that is reduce-scattered are two tensors,
// so freeing what was sent does not free the buffer. A unit here is its bf16 buffer's bytes.
TEST(L07Memory, Stage2KeepsOnlyGradientShardsInBf16WithAnFp32Reduce) {
  SKIP_WITHOUT_GLOO_BF16();
  const Held h = held_during_one_step(2, false, 4, true, Precision::kBf16, Precision::kFp32);
  expect_held_under_two_units(h.backward_scatters, h.unit_bytes,
                              "bf16, fp32 reduce: from the last block's reduce-scatter to the "
                              "first one's",
                              "stage 2 must let go of a unit's bf16 gradient buffer once its "
                              "fp32 copy is on its way");
}

// PyTorch's own training of the same model on the same batches (lesson 02's reference case).
TEST(L07PyTorch, ShardedStagesGivePyTorchsLosses) {
  std::ifstream in(source_path("tests/reference/lesson02_reference.json"));
  ASSERT_TRUE(in.good());
  const auto ref = nlohmann::json::parse(in).at("cases").at("tiny_tied");
  const auto& c = ref.at("config");
  GptConfig config = tiny(true);
  ASSERT_EQ(c.at("hidden").get<int64_t>(), config.hidden);
  ASSERT_EQ(c.at("layers").get<int64_t>(), config.layers);
  ASSERT_EQ(c.at("ctx").get<int64_t>(), config.ctx);
  const auto expected = ref.at("losses").get<std::vector<float>>();
  for (int stage : {1, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    const auto got = train(config, stage, 2, c.at("batch").get<int64_t>(),
                           static_cast<int64_t>(expected.size()));
    EXPECT_TENSOR_CLOSE(torch::tensor(got.losses), torch::tensor(expected), kFp32VsPyTorch);
  }
}

// Save with 2 ranks at stage 1 after 5 steps, load with 3 ranks at stage 3 (re-sharded: other
// chunk sizes, other padding), train 5 more: the parameters of 10 uninterrupted baseline steps.
// Then consolidate on rank 0 and compare the file with the baseline, parameter by parameter.
TEST(L07Checkpoint, SavedByTwoLoadedByThreeAndConsolidated) {
  const GptConfig config = tiny(true);
  const auto dir =
      std::filesystem::temp_directory_path() / ("l07_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const ByteDataset data = ByteDataset::builtin();
  const int64_t batch = 6;
  auto train_range = [&](ZeroEngine& engine, int rank, int world, int64_t from, int64_t to) {
    for (int64_t step = from; step < to; ++step) {
      const int64_t rows = batch / world;
      engine.forward_backward(data.batch(1, step, rows, config.ctx, rank * rows));
      engine.optimizer_step();
    }
  };
  run_ranks(
      2,
      [&](RankContext& ctx) {
        Gpt model(config);
        init_weights(model, 1);
        ZeroOptions o;
        o.stage = 1;
        ZeroEngine engine(model, ctx.comm, o);
        train_range(engine, ctx.rank, 2, 0, 5);
        save_sharded(engine, dir.string());
      },
      kTimeout);
  EXPECT_TRUE(std::filesystem::exists(dir / "shard-0-of-2.pt"));
  EXPECT_TRUE(std::filesystem::exists(dir / "shard-1-of-2.pt"));
  EXPECT_TRUE(std::filesystem::exists(dir / "COMPLETE")) << "the marker of a finished save";
  EXPECT_FALSE(std::filesystem::exists(dir / "shard-0-of-2.pt.tmp")) << "renamed, not left";
  const auto file = (dir / "consolidated.pt").string();
  RunResult got;
  run_ranks(
      3,
      [&](RankContext& ctx) {
        Gpt model(config);
        init_weights(model, 99);  // other weights: the checkpoint must replace them all
        ZeroOptions o;
        o.stage = 3;
        ZeroEngine engine(model, ctx.comm, o);
        load_sharded(engine, dir.string());
        EXPECT_EQ(engine.steps_done(), 5);
        train_range(engine, ctx.rank, 3, 5, 10);
        auto params = engine.full_parameters();
        consolidate(engine, file);
        if (ctx.rank == 0) {
          got.params = params;
          got.layout = engine.layout();
        }
      },
      kTimeout);
  Baseline base = train_baseline(config, 1, batch, 10, AdamWOptions{});
  expect_params_close(got.params, flat_in_unit_order(base.model, got.layout), got.layout, 10);
  torch::serialize::InputArchive archive;
  archive.load_from(file);
  for (const auto& item : base.model->named_parameters()) {
    torch::Tensor t;
    archive.read(item.key(), t);
    if (item.key().find("attn.c_attn.bias") != std::string::npos) continue;  // see above
    EXPECT_TENSOR_CLOSE(t, item.value().detach(), kFp32Steps);
  }
  std::filesystem::remove_all(dir);
}

// read_unit_range() on files made here: saved file j holds, for each unit in order, chunk j of
// the unit in the N-rank layout, each element its own index (10000 * unit + i; the padding -1),
// so that every range read back must be exactly its indices, and the files it asks for (which
// the test records, outside the code under test) exactly those whose chunk overlaps the range:
// a load that reads every file, or misplaces a unit's chunk, fails here.
TEST(L07Checkpoint, ReadUnitRangeReadsOnlyTheFilesItsRangeOverlaps) {
  FlatLayout layout;  // only the units' sizes matter: 10, 7, 1 and 5 elements
  for (int64_t n : {10, 7, 1, 5}) {
    Unit unit;
    unit.numel = n;
    layout.units.push_back(unit);
  }
  int wrong = 0;
  for (int saved : {1, 2, 3, 4}) {
    std::vector<torch::Tensor> files;
    for (int j = 0; j < saved; ++j) {
      std::vector<float> v;
      for (size_t k = 0; k < layout.units.size(); ++k) {
        const int64_t n = layout.units[k].numel, c = padded_size(n, saved) / saved;
        for (int64_t i = j * c; i < (j + 1) * c; ++i) {
          v.push_back(i < n ? 10000.f * static_cast<float>(k) + static_cast<float>(i) : -1.f);
        }
      }
      files.push_back(torch::tensor(v));
    }
    for (size_t k = 0; k < layout.units.size(); ++k) {
      const int64_t n = layout.units[k].numel, c = padded_size(n, saved) / saved;
      for (int64_t b = 0; b <= n; ++b) {
        for (int64_t e = b; e <= n; ++e) {
          std::set<int> asked, overlapping;
          for (int j = 0; j < saved; ++j) {
            if (std::max(b, j * c) < std::min(e, (j + 1) * c)) overlapping.insert(j);
          }
          auto got = read_unit_range(layout, k, b, e, saved, [&](int j) {
            asked.insert(j);
            return files.at(static_cast<size_t>(j));
          });
          auto want = torch::arange(b, e, torch::kFloat) + 10000.f * static_cast<float>(k);
          const bool values_ok = got.numel() == e - b && torch::equal(got.to(torch::kFloat), want);
          if ((!values_ok || asked != overlapping) && ++wrong <= 5) {
            ADD_FAILURE() << "unit " << k << " (" << n << " elements), range [" << b << ", " << e
                          << "), saved by " << saved << " ranks: got " << got.numel()
                          << " elements " << (values_ok ? "(right)" : "(wrong values)")
                          << ", asked for " << asked.size() << " files, " << overlapping.size()
                          << " hold a piece of the range (a rank reads only those)";
          }
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "ranges read wrong (the first five above)";
}

TEST(L07Checkpoint, MissingDirectoryIsAUsageError) {
  run_ranks(
      1,
      [&](RankContext& ctx) {
        Gpt model(tiny(true));
        ZeroEngine engine(model, ctx.comm, ZeroOptions{});
        EXPECT_THROW(load_sharded(engine, "/nonexistent/l07"), UsageError);
      },
      kTimeout);
}

// A save that died before it finished (every shard file there, but no COMPLETE marker, as when
// a rank is killed between its file and the marker) is refused with a clear error, not loaded.
TEST(L07Checkpoint, AnUnfinishedSaveIsRefused) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("l07_partial_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        Gpt model(tiny(true));
        init_weights(model, 1);
        ZeroOptions o;
        o.stage = 2;
        ZeroEngine engine(model, ctx.comm, o);
        save_sharded(engine, dir.string());
      },
      kTimeout);
  std::filesystem::remove(dir / "COMPLETE");
  run_ranks(
      1,
      [&](RankContext& ctx) {
        Gpt model(tiny(true));
        ZeroEngine engine(model, ctx.comm, ZeroOptions{});
        try {
          load_sharded(engine, dir.string());
          ADD_FAILURE() << "an unfinished save was loaded";
        } catch (const UsageError& e) {
          EXPECT_NE(std::string(e.what()).find("COMPLETE"), std::string::npos) << e.what();
        }
      },
      kTimeout);
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// bf16: ZeRO's own layout, 2 + 2 + 12 bytes per parameter
// ---------------------------------------------------------------------------------------------

// The ZeRO paper's formulas (sec. 5, Fig. 1) and communication volumes in bf16, closed forms.
// Given code.
TEST(L07LedgerGiven, Bf16StageFormulasAndThePapersFigureOne) {
  const int64_t psi = 1200;
  const int w = 4;
  const auto bf16 = Precision::kBf16, fp32 = Precision::kFp32;
  auto total = [&](int stage, int world, Precision reduce, int64_t n) {
    return predict_stage_memory(n, stage, world, bf16, reduce).total();
  };
  EXPECT_DOUBLE_EQ(total(0, w, bf16, psi), 16.0 * psi);
  EXPECT_DOUBLE_EQ(total(1, w, bf16, psi), 4.0 * psi + 12.0 * psi / w);
  EXPECT_DOUBLE_EQ(total(2, w, bf16, psi), 2.0 * psi + 14.0 * psi / w);
  EXPECT_DOUBLE_EQ(total(3, w, bf16, psi), 16.0 * psi / w);
  EXPECT_DOUBLE_EQ(total(2, w, fp32, psi), 2.0 * psi + 16.0 * psi / w);  // an fp32 shard gradient
  // Megatron's distributed optimizer table (docs, "Distributed Optimizer"): bf16 parameters with
  // fp32 gradients take 18 bytes a parameter unsharded and 6 + 12/d as its ZeRO-1.
  EXPECT_DOUBLE_EQ(total(0, w, fp32, psi), 18.0 * psi);
  EXPECT_DOUBLE_EQ(total(1, w, fp32, psi), 6.0 * psi + 12.0 * psi / w);
  const auto s1 = predict_stage_memory(psi, 1, w, bf16);
  EXPECT_DOUBLE_EQ(s1.master, 4.0 * psi / w);
  EXPECT_DOUBLE_EQ(s1.optimizer, 8.0 * psi / w);
  EXPECT_DOUBLE_EQ(predict_stage_memory(psi, 1, w).master, 0.0) << "fp32: no separate copy";
  // Fig. 1: Psi = 7.5B, N_d = 64: 120, 31.4, 16.6 and 1.9 GB per device.
  const int64_t big = 7'500'000'000;
  const std::vector<double> fig1 = {120, 31.4, 16.6, 1.9};
  for (int stage = 0; stage <= 3; ++stage) {
    EXPECT_NEAR(total(stage, 64, bf16, big) / 1e9, fig1[static_cast<size_t>(stage)], 0.05)
        << "stage " << stage;
  }
  // Bytes sent a step: the working dtype's gathers, the reduce dtype's reduce-scatters.
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 0, w, true, bf16, bf16), 2.0 * 0.75 * 2 * psi);
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 1, w, true, bf16, bf16), 2.0 * 0.75 * 2 * psi);
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 1, w, true, bf16, fp32), 0.75 * (4 + 2) * psi)
      << "stage 1 reduce-scatters in the reduce dtype, gathers in the working dtype";
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 0, w, true, bf16, fp32), 0.75 * (4 + 4) * psi)
      << "stage 0 allreduces in the reduce dtype";
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 2, w, true, bf16, fp32), 0.75 * (4 + 2) * psi);
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 3, w, true, bf16, bf16), 3.0 * 0.75 * 2 * psi);
  EXPECT_DOUBLE_EQ(predict_stage_comm(psi, 3, w, false, bf16, fp32), 0.75 * (4 + 2) * psi);
}

// The key bias is left out of rho (see expect_params_close: its gradient is rounding noise in
// any precision): a mask of ones with zeros there, flat in unit order.
torch::Tensor key_bias_mask(const FlatLayout& layout, int64_t numel) {
  auto mask = torch::ones({numel});
  int64_t off = 0;
  for (const Unit& unit : layout.units) {
    for (size_t k = 0; k < unit.names.size(); ++k) {
      const int64_t n = c10::multiply_integers(unit.shapes[k]);
      if (unit.names[k].find("attn.c_attn.bias") != std::string::npos) {
        mask.narrow(0, off + n / 3, n / 3).zero_();
      }
      off += n;
    }
  }
  return mask;
}

// The tolerance policy for bf16 (README section 5, "In bf16"), as in lesson 02's and
// tests/support/bf16_policy.h: the noise floor is how far bf16 training lands from fp32
// training, rho(bf16 baseline, fp32 baseline); a bf16 ZeRO run must land within kSameScheme of
// the floor from the single-process bf16 baseline (the same scheme: only the reductions'
// rounding differs), and at least test::kAwayFromFp32 of it from the fp32 baseline (so that an
// fp32 run cannot pass). Weights are the fp32 master weights, flat in unit order. On 3 ranks the
// mean divides a bf16 sum by 3, which rounds (by 2 it is exact), and gloo's ring adds in its own
// order: another bf16 rounding of the same training, held to test::kOtherRounding (measured
// 0.77).
constexpr double kSameScheme = 0.5;
using test::kOtherRounding;

struct Bf16References {
  torch::Tensor init, fp32, bf16, mask;  // flat in unit order
  std::vector<float> bf16_losses;
  double floor = 0;
};

Bf16References bf16_references(const GptConfig& config, const FlatLayout& layout, int64_t batch,
                               int64_t steps, double clip = 0) {
  Bf16References r;
  Gpt init(config);
  init_weights(init, 1);
  r.init = flat_in_unit_order(init, layout);
  Baseline fp32 = train_baseline(config, 1, batch, steps, AdamWOptions{}, clip);
  Baseline bf16 = train_baseline(config, 1, batch, steps, AdamWOptions{}, clip, Precision::kBf16);
  r.fp32 = flat_in_unit_order(fp32.model, layout);
  r.bf16 = flat_in_unit_order(bf16.model, layout);
  r.mask = key_bias_mask(layout, r.init.numel());
  r.bf16_losses = bf16.losses;
  test::RhoSums between;
  between.add(r.bf16 * r.mask, r.fp32 * r.mask, r.fp32 * r.mask, r.init * r.mask);
  r.floor = between.rho_bf16();
  return r;
}

void expect_within_policy(const RunResult& got, const Bf16References& ref,
                          double bound = kSameScheme) {
  test::RhoSums sums;
  const auto& m = ref.mask;
  sums.add(got.params * m, ref.bf16 * m, ref.fp32 * m, ref.init * m);
  test::expect_bf16_policy(sums, ref.floor, bound, got.losses, ref.bf16_losses,
                           "the ZeRO run (AdamW on the fp32 master weights from the averaged "
                           "gradient, the parameters their rounding)");
}

// Stage 0 in bf16 on 2 ranks lands where the single-process bf16 baseline does, by the policy
// above, with and without clipping (0.05: every step clips), and stage 3 on 3 ranks (where the
// division by 3 and gloo's sums round differently from stage 0's); the other stages must equal
// stage 0 bit for bit at W = 2 (L07Bf16.ShardedStagesEqualStageZeroBitForBit).
TEST(L07Bf16, StageZeroAndThreeRanksMatchTheBf16Baseline) {
  SKIP_WITHOUT_GLOO_BF16();
  const GptConfig config = tiny(true);
  const int64_t steps = 6;
  const auto bf16 = Precision::kBf16;
  auto layout_for = [&](int world) {
    Gpt m(config);
    return make_layout(m, world);
  };
  for (double clip : {0.0, 0.05}) {
    SCOPED_TRACE(testing::Message() << "stage 0, clip " << clip);
    const Bf16References ref = bf16_references(config, layout_for(2), 4, steps, clip);
    expect_within_policy(train(config, 0, 2, 4, steps, false, false, true, clip, bf16, bf16), ref);
  }
  {
    SCOPED_TRACE("stage 2 clipping, 2 ranks");
    const Bf16References ref = bf16_references(config, layout_for(2), 4, steps, 0.05);
    expect_within_policy(train(config, 2, 2, 4, steps, false, false, true, 0.05, bf16, bf16), ref);
  }
  SCOPED_TRACE("stage 3, 3 ranks");
  const Bf16References ref = bf16_references(config, layout_for(3), 6, steps);
  expect_within_policy(train(config, 3, 3, 6, steps, true, false, true, 0, bf16, bf16), ref,
                       kOtherRounding);
}

// At W = 2 the two ranks' bf16 gradients add up the same way in every stage (one addition, then
// an exact halving), and AdamW is elementwise: every sharded stage, with prefetch, recomputation
// or without resharding, gives stage 0's master weights bit for bit; reducing in fp32, every
// stage gives every other's (stages 0-1 through Megatron's main_grad, 2-3 through a cast copy of
// each unit's gradient: the same fp32 sums of the same bf16 gradients).
TEST(L07Bf16, ShardedStagesEqualStageZeroBitForBit) {
  SKIP_WITHOUT_GLOO_BF16();
  const GptConfig config = tiny(true);
  const int64_t batch = 4, steps = 4;
  const auto bf16 = Precision::kBf16, fp32 = Precision::kFp32;
  const auto zero = train(config, 0, 2, batch, steps, false, false, true, 0, bf16, bf16);
  struct Case {
    int stage;
    bool prefetch, recompute, reshard;
    const char* what;
  };
  for (const Case& c :
       {Case{1, false, false, true, "stage 1"}, Case{2, false, false, true, "stage 2"},
        Case{3, true, false, true, "stage 3 prefetch"},
        Case{3, false, true, true, "stage 3 recompute"},
        Case{3, false, false, false, "stage 3 no reshard"}}) {
    const auto got =
        train(config, c.stage, 2, batch, steps, c.prefetch, c.recompute, c.reshard, 0, bf16, bf16);
    EXPECT_TRUE(torch::equal(got.params, zero.params)) << c.what << ": not stage 0's weights";
  }
  const auto two = train(config, 2, 2, batch, steps, false, false, true, 0, bf16, fp32);
  const auto three = train(config, 3, 2, batch, steps, false, true, true, 0, bf16, fp32);
  EXPECT_TRUE(torch::equal(two.params, three.params)) << "reducing in fp32: stage 3 != stage 2";
  for (int stage : {0, 1}) {
    const auto got = train(config, stage, 2, batch, steps, false, false, true, 0, bf16, fp32);
    EXPECT_TRUE(torch::equal(got.params, two.params))
        << "reducing in fp32: stage " << stage << " != stage 2";
  }
  EXPECT_FALSE(torch::equal(two.params, zero.params)) << "an fp32 reduce-scatter rounds less";
}

// A bf16 checkpoint holds the fp32 master weights and both moments: saved by stage 1 after 3
// steps and loaded by stage 3 (from other initial weights), 3 more steps give the master weights
// of 6 uninterrupted steps bit for bit (at W = 2 the stages agree bit for bit, above), and the
// bf16 parameters are their rounding. A checkpoint of the bf16 parameters would resume from
// weights rounded to 8 bits and fail here.
TEST(L07Bf16, CheckpointResumesBitForBit) {
  SKIP_WITHOUT_GLOO_BF16();
  const GptConfig config = tiny(true);
  const auto bf16 = Precision::kBf16;
  const int64_t batch = 4;
  const auto dir =
      std::filesystem::temp_directory_path() / ("l07_bf16_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const ByteDataset data = ByteDataset::builtin();
  auto engine_run = [&](int stage, uint64_t seed, int64_t from, int64_t to, bool save,
                        torch::Tensor* out) {
    run_ranks(
        2,
        [&](RankContext& ctx) {
          Gpt model(config);
          init_weights(model, seed);
          ZeroOptions o;
          o.stage = stage;
          o.precision = bf16;
          ZeroEngine engine(model, ctx.comm, o);
          if (from > 0) {
            load_sharded(engine, dir.string());
            EXPECT_EQ(engine.steps_done(), from);
          }
          for (int64_t step = from; step < to; ++step) {
            const int64_t rows = batch / 2;
            engine.forward_backward(data.batch(1, step, rows, config.ctx, ctx.rank * rows));
            engine.optimizer_step();
          }
          if (save) save_sharded(engine, dir.string());
          auto params = engine.full_parameters();
          if (ctx.rank == 0 && out != nullptr) *out = params;
        },
        kTimeout);
  };
  engine_run(1, 1, 0, 3, /*save=*/true, nullptr);
  torch::Tensor resumed;
  engine_run(3, 99, 3, 6, /*save=*/false, &resumed);
  const auto whole = train(config, 0, 2, batch, 6, false, false, true, 0, bf16, bf16);
  ASSERT_TRUE(resumed.defined());
  EXPECT_EQ(resumed.scalar_type(), torch::kFloat) << "the master weights";
  EXPECT_TRUE(torch::equal(resumed, whole.params))
      << "saved at step 3 by stage 1 and resumed by stage 3: not the uninterrupted run's weights";
  std::filesystem::remove_all(dir);
}

// HSDP in bf16, stages 2 and 3 on 4 ranks (shard groups of 2, replicated twice): the replicas'
// allreduce moves the bf16 shard gradient, half of fp32's bytes, and the run lands within
// kOtherRounding of the floor from the bf16 baseline (four bf16 gradients summed in pairs, then
// the pairs: another rounding of the same training).
TEST(L07Bf16, HsdpReplicatesTheBf16ShardGradient) {
  SKIP_WITHOUT_GLOO_BF16();
  const GptConfig config = tiny(true);
  const int64_t batch = 8, steps = 4;
  const FlatLayout layout = [&] {
    Gpt m(config);
    return make_layout(m, 2);
  }();
  const Bf16References ref = bf16_references(config, layout, batch, steps);
  for (int stage : {2, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    const HsdpRun run = hsdp_run(config, stage, batch, steps, Precision::kBf16);
    expect_within_policy(run.got, ref, kOtherRounding);
    EXPECT_EQ(run.replicate_bytes, 2 * (2 - 1) * run.got.layout.shard * 2 / 2)
        << "one allreduce of the bf16 shard gradient across the 2 replicas per step";
    EXPECT_EQ(run.replicate_counted, run.replicate_bytes);
  }
}

// The model computes with bf16 parameters that are exactly the fp32 master weights rounded
// (stages 0-2 keep them between steps).
TEST(L07Bf16, ParametersAreTheMasterWeightsRounded) {
  SKIP_WITHOUT_GLOO_BF16();
  for (int stage : {0, 1, 2}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    const auto got = train(tiny(true), stage, 2, 4, 3, false, false, true, 0, Precision::kBf16,
                           Precision::kBf16);
    ASSERT_EQ(got.model_params.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(got.model_params, got.params.to(torch::kBFloat16)))
        << "each parameter must be its master weight rounded to bf16 after the step";
  }
}

// On the wire (RecordingComm, from outside the engine): bf16 halves every stage's bytes; reducing
// in fp32, every stage's reductions travel in fp32 and its gathers in bf16 (stage 2: (4 + 2) /
// (4 + 4) of fp32's; stage 0, whose allreduce is all reduction, fp32's). The engine's own count
// agrees.
TEST(L07Bf16, BytesOnTheWireFollowTheDtypes) {
  SKIP_WITHOUT_GLOO_BF16();
  const auto bf16 = Precision::kBf16, fp32 = Precision::kFp32;
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    const auto full = train(tiny(true), stage, 2, 4, 2);
    const auto half = train(tiny(true), stage, 2, 4, 2, false, false, true, 0, bf16, bf16);
    EXPECT_EQ(2 * half.bytes.back(), full.bytes.back());
    EXPECT_EQ(half.counted.back(), half.bytes.back()) << "CountingComm counts element_size()";
    const auto mixed = train(tiny(true), stage, 2, 4, 2, false, false, true, 0, bf16, fp32);
    if (stage == 0) {
      EXPECT_EQ(mixed.bytes.back(), full.bytes.back()) << "an fp32 allreduce";
    } else {
      // The reduce-scatters in fp32, the gathers in bf16: 2 more bytes for each of the (W-1)/W
      // of the padded elements a rank sends in the reduce-scatters.
      EXPECT_EQ(mixed.bytes.back() - half.bytes.back(), half.layout.padded / 2 * 2);
      if (stage <= 2) EXPECT_EQ(4 * mixed.bytes.back(), 3 * full.bytes.back());
    }
    EXPECT_EQ(mixed.counted.back(), mixed.bytes.back());
  }
}

// gloo's worker drops its references a moment after wait() returns: read this thread's counter
// once it has stopped moving (as the program does).
int64_t settled_thread_current() {
  int64_t last = thread_cpu_memory().current;
  for (int same = 0, i = 0; i < 100 && same < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const int64_t now = thread_cpu_memory().current;
    same = now == last ? same + 1 : 0;
    last = now;
  }
  return last;
}

// The done-when table: each rank's parameters, gradients, master weights and moments, measured
// by the counting allocator (this rank thread's storage), are the ledger's bf16 formulas on the
// padded count, to the byte, at every stage, and with an fp32 reduce dtype.
TEST(L07Bf16, StatesPerRankAreTheLedgersToTheByte) {
  SKIP_WITHOUT_GLOO_BF16();
  install_counting_allocator();
  const GptConfig config = tiny(true);
  const auto bf16 = Precision::kBf16, fp32 = Precision::kFp32;
  for (const auto& c : std::vector<std::pair<int, Precision>>{{0, bf16},
                                                              {1, bf16},
                                                              {2, bf16},
                                                              {3, bf16},
                                                              {0, fp32},
                                                              {1, fp32},
                                                              {2, fp32},
                                                              {3, fp32}}) {
    const int stage = c.first;
    const Precision reduce = c.second;
    SCOPED_TRACE(testing::Message() << "stage " << stage << ", reduce " << precision_name(reduce));
    std::array<int64_t, 4> got{};  // params, grads, master, optimizer
    FlatLayout layout;
    run_ranks(
        2,
        [&](RankContext& ctx) {
          const Batch batch = ByteDataset::builtin().batch(1, 0, 2, config.ctx, 2 * ctx.rank);
          const int64_t before = settled_thread_current();
          Gpt model(config);
          init_weights(model, 1);
          ZeroOptions o;
          o.stage = stage;
          o.precision = bf16;
          o.reduce = reduce;
          ZeroEngine engine(model, ctx.comm, o);
          model = nullptr;
          const int64_t built = settled_thread_current();
          engine.forward_backward(batch);
          const int64_t backward = settled_thread_current();
          engine.optimizer_step();
          const int64_t stepped = settled_thread_current();
          if (ctx.rank != 0) return;
          const auto master = static_cast<int64_t>(engine.master().storage().nbytes());
          got = {built - before - master, backward - built, master, stepped - backward};
          layout = engine.layout();
        },
        kTimeout);
    const auto want = predict_stage_memory(layout.padded, stage, 2, bf16, reduce);
    EXPECT_EQ(got[0], want.params) << "bf16 parameters";
    EXPECT_EQ(got[1], want.grads)
        << "gradients, in the reduce dtype (stages 0-1: the whole buffer, Megatron's main_grad "
           "in fp32, no bf16 gradient left; stages 2-3: the shard's)";
    EXPECT_EQ(got[2], want.master) << "fp32 master weights";
    EXPECT_EQ(got[3], want.optimizer) << "AdamW's two fp32 moments";
  }
}

// fp16 needs a loss scaler (lesson 02), an fp32 model reduces in fp32, and bf16 checkpoints are
// not this lesson's: usage errors naming the flag. On 1.13, bf16 itself.
TEST(L07Bf16, UnsupportedCombinationsAreUsageErrors) {
  auto flag_of = [](const ZeroOptions& o, const std::string& dir = "/nonexistent-l07-dir") {
    std::string flag;
    run_ranks(
        1,
        [&](RankContext& ctx) {
          try {
            Gpt model(tiny(true));
            ZeroEngine engine(model, ctx.comm, o);
            save_sharded(engine, dir);
          } catch (const UsageError& e) {
            flag = e.subject();
          }
        },
        kTimeout);
    return flag;
  };
  ZeroOptions fp16;
  fp16.precision = Precision::kFp16;
  EXPECT_EQ(flag_of(fp16), "--precision");
  ZeroOptions reduce;
  reduce.reduce = Precision::kBf16;
  EXPECT_EQ(flag_of(reduce), "--reduce-dtype");
  ZeroOptions bf16;
  bf16.precision = Precision::kBf16;
  bf16.reduce = Precision::kBf16;
  if (!kGlooBf16) {
    EXPECT_EQ(flag_of(bf16), "--precision");
  } else {  // a bf16 engine saves its master weights (L07Bf16.CheckpointResumesBitForBit)
    const auto dir =
        std::filesystem::temp_directory_path() / ("l07_bf16_save_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    EXPECT_EQ(flag_of(bf16, dir.string()), "") << "bf16 checkpoints are not refused";
    EXPECT_TRUE(std::filesystem::exists(dir / "COMPLETE"));
    std::filesystem::remove_all(dir);
  }
}

}  // namespace
}  // namespace dtc::l07

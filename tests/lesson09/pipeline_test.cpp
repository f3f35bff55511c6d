// Lesson 09 tests: the stage split on real modules, send/recv, and pipelined training on thread-
// ranks against the single-process baseline, computed here with plain LibTorch (the course's
// GPT, untied, the same AdamW and the same batches as lesson 02), never by the code under test.
// Tolerance: dtc::kFp32Steps (the sum of m scaled micro-batch gradients differs from the full
// batch's gradient only by the order of fp32 additions, compounded over a few steps).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "adamw_params.h"
#include "bf16_policy.h"
#include "dtc/compare.h"
#include "dtc/data.h"
#include "dtc/memory.h"
#include "dtc/observe.h"
#include "dtc/ranks.h"
#include "dtc/trace.h"
#include "dtc_test.h"
#include "pipeline.h"
#include "plain_baseline.h"
#include "program.h"

namespace dtc::l09 {
namespace {

constexpr std::chrono::milliseconds kTimeout{5000};

// A small model so that a few steps on 4 thread-ranks take well under a second.
PipelineOptions small_run(ScheduleKind schedule, int64_t micro_batches) {
  PipelineOptions o;
  o.model.layers = 4;
  o.model.hidden = 32;
  o.model.heads = 2;
  o.model.ctx = 16;
  o.model.tied = false;
  o.batch = 8;
  o.steps = 3;
  o.micro_batches = micro_batches;
  o.schedule = schedule;
  o.sweep.clear();
  return o;
}

// The single-process baseline: whole batch, one model, one AdamW (lesson 02's hyperparameters;
// tests/support/plain_baseline.h). The pipeline, driven by the test: each rank cuts its stage out
// of its own full model
// (make_stage), runs the schedule (run_schedule) and steps an AdamW over the stage's
// parameters, as the program does. Each rank then hands back its stage's final parameters by
// their name in the full model, so that the test compares parameters, not only losses: AdamW's
// update hardly changes when every gradient is k times too large (the 1/m forgotten), the
// parameters do (by up to lr per step and element).
struct PipelineRun {
  std::vector<float> losses;                    // rank 0's copy: the last stage's, summed
  std::map<std::string, torch::Tensor> params;  // every stage's, by full-model name
};

PipelineRun run_pipeline_here(const PipelineOptions& o, int stages) {
  PipelineRun run;
  std::mutex mu;
  run_ranks(
      stages,
      [&](RankContext& ctx) {
        Gpt full(o.model);
        init_weights(full, o.seed);
        std::vector<Stage> chunks = make_chunks(full, stages, o.chunks, ctx.rank);
        const auto params = parameters_of(chunks);
        torch::optim::AdamW optimizer(params, adamw_options(o));
        const auto ops = make_schedule(o.schedule, stages, o.micro_batches, ctx.rank, o.chunks);
        const ByteDataset data = ByteDataset::builtin();
        std::vector<float> losses;
        for (int64_t step = 0; step < o.steps; ++step) {
          for (auto p : params) p.mutable_grad().reset();
          const StepStats stats =
              run_schedule(chunks, *ctx.comm, ops, data.batch(o.seed, step, o.batch, o.model.ctx),
                           o.micro_batches);
          optimizer.step();
          auto loss = torch::full({1}, ctx.rank == stages - 1 ? stats.loss : 0.0f);
          std::vector<at::Tensor> v{loss};
          ctx.comm->allreduce(v)->wait();
          losses.push_back(loss.item<float>());
        }
        std::set<const void*> mine;
        for (const auto& p : params) mine.insert(p.unsafeGetTensorImpl());
        std::lock_guard<std::mutex> lock(mu);
        if (ctx.rank == 0) run.losses = losses;
        for (const auto& item : full->named_parameters()) {
          if (mine.count(item.value().unsafeGetTensorImpl()) == 0) continue;
          if (!run.params.emplace(item.key(), item.value().detach().clone()).second) {
            throw std::runtime_error(item.key() + " is in two stages");
          }
        }
      },
      kTimeout);
  return run;
}

void expect_baseline(ScheduleKind schedule, int stages, int64_t micro_batches, int chunks = 1) {
  PipelineOptions o = small_run(schedule, micro_batches);
  o.chunks = chunks;
  o.model.layers = std::max<int64_t>(o.model.layers, int64_t{stages} * chunks);
  const test::BaselineRun base = test::plain_baseline(o, o.steps);
  const PipelineRun got = run_pipeline_here(o, stages);
  ASSERT_EQ(got.losses.size(), base.losses.size());
  EXPECT_TENSOR_CLOSE(torch::tensor(got.losses), torch::tensor(base.losses), kFp32Steps);
  // The program's own loop (train_pipeline) gives the same losses.
  std::vector<float> program_losses;
  run_ranks(
      stages,
      [&](RankContext& ctx) {
        auto l = train_pipeline(o, *ctx.comm).losses;
        if (ctx.rank == 0) program_losses = l;
      },
      kTimeout);
  EXPECT_TENSOR_CLOSE(torch::tensor(program_losses), torch::tensor(base.losses), kFp32Steps);
  const auto names = Gpt(o.model)->named_parameters();
  ASSERT_EQ(names.size(), base.params.size());
  size_t i = 0;
  for (const auto& item : names) {
    SCOPED_TRACE(item.key());
    auto it = got.params.find(item.key());
    if (it == got.params.end()) {
      ADD_FAILURE() << item.key() << " is in no stage";
    } else {
      EXPECT_ADAMW_PARAMS_CLOSE(it->second, base.params[i], o.steps, o.lr);
    }
    ++i;
  }
}

TEST(L09Pipeline, GpipeTwoStagesMatchesBaseline) { expect_baseline(ScheduleKind::kGpipe, 2, 4); }
TEST(L09Pipeline, GpipeFourStagesMatchesBaseline) { expect_baseline(ScheduleKind::kGpipe, 4, 4); }
TEST(L09Pipeline, OneFOneBTwoStagesMatchesBaseline) { expect_baseline(ScheduleKind::k1f1b, 2, 4); }
TEST(L09Pipeline, OneFOneBFourStagesMatchesBaseline) { expect_baseline(ScheduleKind::k1f1b, 4, 8); }
// Interleaved 1F1B: v = 2 chunks per rank (rank 0 holds virtual stages 0 and p), m a multiple
// of p; the chunks' messages wrap from the last rank to rank 0.
TEST(L09Chunks, InterleavedTwoRanksTwoChunksMatchesBaseline) {
  expect_baseline(ScheduleKind::kInterleaved, 2, 4, 2);
}
TEST(L09Chunks, InterleavedFourRanksTwoChunksMatchesBaseline) {
  expect_baseline(ScheduleKind::kInterleaved, 4, 4, 2);
}
TEST(L09Chunks, InterleavedTwoRanksThreeChunksMatchesBaseline) {
  expect_baseline(ScheduleKind::kInterleaved, 2, 4, 3);
}
// ZB-H1: each backward split into I and W.
TEST(L09SplitBackward, ZbH1TwoStagesMatchesBaseline) { expect_baseline(ScheduleKind::kZbH1, 2, 4); }
TEST(L09SplitBackward, ZbH1FourStagesMatchesBaseline) {
  expect_baseline(ScheduleKind::kZbH1, 4, 8);
}

// Every schedule adds each parameter's micro-batch gradients in the same order (0 .. m-1): the
// same weights as GPipe's, bit for bit, after several steps.
TEST(L09SplitBackward, EverySchedulesWeightsEqualGpipesBitForBit) {
  for (int stages : {2, 4}) {
    SCOPED_TRACE(testing::Message() << stages << " stages");
    PipelineOptions o = small_run(ScheduleKind::kGpipe, 4);
    o.model.layers = 2 * stages;  // room for 2 chunks per rank
    const PipelineRun gpipe = run_pipeline_here(o, stages);
    for (ScheduleKind kind : {ScheduleKind::kInterleaved, ScheduleKind::kZbH1}) {
      SCOPED_TRACE(schedule_name(kind));
      o.schedule = kind;
      o.chunks = kind == ScheduleKind::kInterleaved ? 2 : 1;
      const PipelineRun got = run_pipeline_here(o, stages);
      ASSERT_EQ(got.params.size(), gpipe.params.size());
      for (const auto& [name, value] : gpipe.params) {
        ASSERT_TRUE(got.params.count(name)) << name << " is in no stage";
        EXPECT_TRUE(torch::equal(got.params.at(name), value)) << name;
      }
      EXPECT_EQ(got.losses, gpipe.losses);
    }
  }
}

// Interleaved with the output of each forward freed once sent (the send holds its values) or
// with each chunk recomputed: the same losses as lesson 02's.
TEST(L09Chunks, InterleavedDeallocatingOrRecomputingMatchesBaseline) {
  for (const bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute" : "deallocate_outputs");
    PipelineOptions o = small_run(ScheduleKind::kInterleaved, 4);
    o.chunks = 2;
    o.deallocate_outputs = !recompute;
    o.recompute = recompute ? Recompute::kFull : Recompute::kNone;
    const test::BaselineRun base = test::plain_baseline(o, o.steps);
    std::vector<float> losses;
    run_ranks(
        2,
        [&](RankContext& ctx) {
          auto l = train_pipeline(o, *ctx.comm).losses;
          if (ctx.rank == 0) losses = l;
        },
        kTimeout);
    EXPECT_TENSOR_CLOSE(torch::tensor(losses), torch::tensor(base.losses), kFp32Steps);
  }
}

// The program's loop (train_pipeline) with each new schedule: lesson 02's losses.
TEST(L09SplitBackward, TrainPipelineRunsEverySchedule) {
  for (ScheduleKind kind : {ScheduleKind::kInterleaved, ScheduleKind::kZbH1}) {
    SCOPED_TRACE(schedule_name(kind));
    PipelineOptions o = small_run(kind, 4);
    o.chunks = kind == ScheduleKind::kInterleaved ? 2 : 1;
    const test::BaselineRun base = test::plain_baseline(o, o.steps);
    std::vector<float> losses;
    run_ranks(
        2,
        [&](RankContext& ctx) {
          auto l = train_pipeline(o, *ctx.comm).losses;
          if (ctx.rank == 0) losses = l;
        },
        kTimeout);
    EXPECT_TENSOR_CLOSE(torch::tensor(losses), torch::tensor(base.losses), kFp32Steps);
  }
}

// dp x pp: 2 stages x 2 replicas (4 thread-ranks), through the program's loop
// (train_pipeline), each replica on half of every batch: lesson 02's parameters after 3 steps
// (the replicas' average is the whole batch's mean gradient), and every replica of a stage
// with the same weights, bit for bit. Returns each rank's weights by the full model's names.
struct ReplicaRun {
  std::vector<float> losses;
  std::vector<std::map<std::string, torch::Tensor>> params;  // by rank
};

ReplicaRun run_replicas(const PipelineOptions& o, int stages, int world,
                        std::vector<std::vector<TracedSpan>>* spans = nullptr) {
  ReplicaRun run;
  run.params.resize(static_cast<size_t>(world));
  if (spans) spans->assign(static_cast<size_t>(world), {});
  std::mutex mu;
  run_ranks(
      world,
      [&](RankContext& ctx) {
        PipelineGroups g = pipeline_groups(ctx.store, world, ctx.rank, stages, BackendKind::kGloo,
                                           std::chrono::milliseconds(5000));
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        c10::intrusive_ptr<Comm> pp = g.pipeline, dp = g.replicas;
        if (spans) {
          tracer->set_clock(sync_clock(*ctx.store, ctx.rank, ctx.world));
          pp = c10::make_intrusive<TracingComm>(g.pipeline, tracer, "pipeline");
          dp = c10::make_intrusive<TracingComm>(g.replicas, tracer, "replicas");
        }
        PipelineOptions mine = o;
        mine.weights = true;
        PipelineResult r;
        {
          TraceScope scope(spans ? tracer.get() : nullptr);
          r = train_pipeline(mine, *pp, nullptr, dp.get());
        }
        // The names of this rank's chunks' parameters, in parameters_of() order.
        Gpt named(o.model);
        const auto chunks = make_chunks(named, stages, o.chunks, pp->getRank());
        std::map<const void*, std::string> name_of;
        for (const auto& item : named->named_parameters())
          name_of[item.value().unsafeGetTensorImpl()] = item.key();
        const auto params = parameters_of(chunks);
        std::lock_guard<std::mutex> lock(mu);
        if (ctx.rank == 0) run.losses = r.losses;
        for (size_t i = 0; i < params.size(); ++i)
          run.params[static_cast<size_t>(ctx.rank)][name_of.at(params[i].unsafeGetTensorImpl())] =
              r.weights.at(i);
        if (spans) (*spans)[static_cast<size_t>(ctx.rank)] = traced_spans(tracer->to_json());
      },
      kTimeout);
  return run;
}

// Every schedule, and 1F1B with recomputation and with its sent outputs freed: the replicas'
// averaging must see each micro-batch's weight gradients however the backward gets them.
TEST(L09Replicas, TwoStagesTimesTwoReplicasMatchBaseline) {
  struct Case {
    ScheduleKind kind;
    int chunks;
    Recompute recompute;
    bool deallocate;
  };
  for (const Case& c : {Case{ScheduleKind::k1f1b, 1, Recompute::kNone, false},
                        Case{ScheduleKind::kInterleaved, 2, Recompute::kNone, false},
                        Case{ScheduleKind::kZbH1, 1, Recompute::kNone, false},
                        Case{ScheduleKind::k1f1b, 1, Recompute::kFull, false},
                        Case{ScheduleKind::k1f1b, 1, Recompute::kNone, true}}) {
    SCOPED_TRACE(fmt::format("{}, recompute {}, deallocate {}", schedule_name(c.kind),
                             recompute_name(c.recompute), c.deallocate));
    PipelineOptions o = small_run(c.kind, 2);
    o.chunks = c.chunks;
    o.recompute = c.recompute;
    o.deallocate_outputs = c.deallocate;
    o.replicas = 2;
    const test::BaselineRun base = test::plain_baseline(o, o.steps);
    const ReplicaRun run = run_replicas(o, 2, 4);
    EXPECT_TENSOR_CLOSE(torch::tensor(run.losses), torch::tensor(base.losses), kFp32Steps);
    size_t i = 0;
    for (const auto& item : Gpt(o.model)->named_parameters()) {
      SCOPED_TRACE(item.key());
      // Ranks 0 and 1 are stage 0's replicas, 2 and 3 stage 1's (pp slowest).
      const int stage_rank = run.params[0].count(item.key()) ? 0 : 2;
      ASSERT_TRUE(run.params[static_cast<size_t>(stage_rank)].count(item.key())) << "in no stage";
      const torch::Tensor got = run.params[static_cast<size_t>(stage_rank)].at(item.key());
      EXPECT_ADAMW_PARAMS_CLOSE(got, base.params[i], o.steps, o.lr);
      EXPECT_TRUE(torch::equal(got, run.params[static_cast<size_t>(stage_rank + 1)].at(item.key())))
          << "the two replicas of a stage disagree";
      ++i;
    }
  }
}

// The overlap (Megatron-LM's with --overlap-grad-reduce --no-align-grad-reduce): a stage starts
// averaging its gradients with its replicas as soon as its last backward pass is done, while the
// stages before it are still in their cool-down, and waits for it only after its last send,
// before the optimizer step. On the
// trace: under 1F1B the last stage's allreduce over the replicas is issued before the send of its
// last input gradient, the one stage 0's last backward waits for (so stage 0's cool-down runs
// beside it); interleaved, on every rank, the chunk that finishes first (chunk 1) is averaged
// while chunk 0 still has backwards to run and send. Averaging after the step would issue it only
// after those sends: run_schedule waits for its sends before it returns. (ZB-H1 puts the last
// stage's last W after its last I: its average starts after its last send, by design.)
TEST(L09Replicas, GradientsAreAveragedDuringTheCoolDown) {
  for (const auto& [kind, chunks] :
       {std::pair{ScheduleKind::k1f1b, 1}, std::pair{ScheduleKind::kInterleaved, 2}}) {
    SCOPED_TRACE(schedule_name(kind));
    PipelineOptions o = small_run(kind, 4);
    o.chunks = chunks;
    o.steps = 1;
    o.replicas = 2;
    std::vector<std::vector<TracedSpan>> spans;
    run_replicas(o, 2, 4, &spans);
    for (int rank = chunks > 1 ? 0 : 2; rank < 4; ++rank) {  // 1F1B: stage 1's ranks
      SCOPED_TRACE(fmt::format("rank {}", rank));
      double last_send = -1, allreduce = -1, waited = -1;
      for (const auto& s : spans[static_cast<size_t>(rank)]) {
        if (s.track != TraceTrack::kComm) continue;
        if (s.name == "send") last_send = std::max(last_send, s.begin_us);
        const bool replicas = s.args.value("group", "") == "replicas";
        if (s.name.find("allreduce") != std::string::npos && replicas && allreduce < 0) {
          allreduce = s.begin_us;
          waited = s.args.value("wait_us", -1.0);
        }
      }
      ASSERT_GE(last_send, 0) << "no send";
      ASSERT_GE(allreduce, 0) << "no allreduce over the replicas";
      EXPECT_LT(allreduce, last_send)
          << "the first gradients must start to be averaged before the rank's last gradient "
             "leaves for the stage before, whose cool-down then runs beside the averaging";
      EXPECT_GE(waited, last_send)
          << "the first averaging must still be in flight when the rank's last gradient is "
             "sent: waited for after it (an allreduce waited for at once overlaps nothing)";
    }
  }
}

// m = 1: no overlap at all, the pipeline is a model split over ranks.
TEST(L09Pipeline, OneMicroBatchMatchesBaseline) { expect_baseline(ScheduleKind::k1f1b, 2, 1); }

// 1F1B's point: a stage holds at most p - s micro-batches' activations, GPipe all m. Measured
// from outside the executor: the bytes this rank's thread allocated and has not freed, at their
// peak during one step (the counting allocator, per thread), on stage 0 of 4 with m = 8: GPipe
// stores 8 micro-batches, 1F1B 4. The rest of the peak (the gradients, one micro-batch's
// temporaries) is the same in both, so 1F1B's peak is well under GPipe's; an executor that
// keeps every micro-batch's tensors until the end of the step has GPipe's peak under 1F1B.
int64_t stage_zero_step_peak(ScheduleKind schedule, bool deallocate = false, bool recompute = false,
                             int rank = 0, int64_t micro_batches = 8) {
  PipelineOptions o = small_run(schedule, micro_batches);
  o.batch = 4 * micro_batches;  // 4 rows per micro-batch: activations dominate the step's memory
  install_counting_allocator();
  int64_t peak = 0;
  run_ranks(
      4,
      [&](RankContext& ctx) {
        Gpt full(o.model);
        init_weights(full, o.seed);
        Stage stage = make_stage(full, 4, ctx.rank);
        const Batch batch = ByteDataset::builtin().batch(o.seed, 0, o.batch, o.model.ctx);
        const auto ops = make_schedule(schedule, 4, o.micro_batches, ctx.rank);
        reset_thread_cpu_peak();
        const int64_t start = thread_cpu_memory().current;
        run_schedule(stage, *ctx.comm, ops, batch, o.micro_batches, deallocate, recompute);
        if (ctx.rank == rank) peak = thread_cpu_memory().peak - start;
      },
      kTimeout);
  return peak;
}

TEST(L09Memory, OneFOneBHoldsFewerActivationsThanGpipe) {
  const int64_t gpipe = stage_zero_step_peak(ScheduleKind::kGpipe);
  const int64_t one_f_one_b = stage_zero_step_peak(ScheduleKind::k1f1b);
  ASSERT_GT(gpipe, 0);
  // 4 of 8 micro-batches' activations plus the same rest: measured 0.62 here (771,200 of
  // 1,248,384 bytes); keeping all 8 gives about 1.
  EXPECT_LT(static_cast<double>(one_f_one_b), 0.75 * static_cast<double>(gpipe))
      << "stage 0's peak during one step: 1F1B " << one_f_one_b << " bytes, GPipe " << gpipe
      << " bytes. 1F1B must free a micro-batch's activations after its backward";
}

// The closed form, stage by stage: 1F1B keeps at most p - s micro-batches in flight on stage s
// whatever m is (Narayanan et al. 2021 sec. 2.2.1), so once m >= p its peak does not grow with
// m at all, while GPipe's grows by a micro-batch's activations with every micro-batch. Measured
// with micro-batches of a fixed size (4 rows) at m = 8 and m = 12, on every stage: 1F1B's peaks
// are equal to the byte here. An executor that keeps any part of a finished micro-batch (its
// received input, its output, their gradients) until the end of the step grows by that part
// four times over, and fails, whatever fraction of GPipe's peak it stays under.
class L09MemoryStage : public ::testing::TestWithParam<int> {};

TEST_P(L09MemoryStage, OneFOneBPeakDoesNotGrowWithMicroBatches) {
  const int s = GetParam();
  const int64_t gpipe8 = stage_zero_step_peak(ScheduleKind::kGpipe, false, false, s, 8);
  const int64_t gpipe12 = stage_zero_step_peak(ScheduleKind::kGpipe, false, false, s, 12);
  const int64_t f8 = stage_zero_step_peak(ScheduleKind::k1f1b, false, false, s, 8);
  const int64_t f12 = stage_zero_step_peak(ScheduleKind::k1f1b, false, false, s, 12);
  const PipelineOptions o = small_run(ScheduleKind::k1f1b, 8);
  const int64_t one_output = 4 * o.model.ctx * o.model.hidden * 4;  // (4, T, h) fp32
  std::cout << "    stage " << s << "'s step peak, m = 8 and 12: GPipe " << gpipe8 << ", "
            << gpipe12 << "; 1F1B " << f8 << ", " << f12 << " bytes\n";
  EXPECT_GT(gpipe12 - gpipe8, 4 * one_output) << "GPipe holds every micro-batch: it grows with m";
  EXPECT_LE(std::abs(f12 - f8), one_output / 2)
      << "stage " << s << ": 1F1B's step peak grew from " << f8 << " bytes at m = 8 to " << f12
      << " at m = 12 (one micro-batch's output is " << one_output << " bytes): something of "
      << "each micro-batch outlives its backward";
}

INSTANTIATE_TEST_SUITE_P(Stages, L09MemoryStage, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

// Every stage's step peak (bytes its thread allocated above the step's start, the counting
// allocator), for @p schedule on 4 thread-ranks, m = @p micro_batches of 4 rows each, @p chunks
// per rank over a model of @p layers blocks.
std::vector<int64_t> step_peaks(ScheduleKind schedule, int64_t micro_batches, int chunks = 1,
                                int64_t layers = 4) {
  PipelineOptions o = small_run(schedule, micro_batches);
  o.batch = 4 * micro_batches;
  o.model.layers = layers;
  install_counting_allocator();
  std::vector<int64_t> peaks(4);
  run_ranks(
      4,
      [&](RankContext& ctx) {
        Gpt full(o.model);
        init_weights(full, o.seed);
        std::vector<Stage> stage = make_chunks(full, 4, chunks, ctx.rank);
        const Batch batch = ByteDataset::builtin().batch(o.seed, 0, o.batch, o.model.ctx);
        const auto ops = make_schedule(schedule, 4, o.micro_batches, ctx.rank, chunks);
        reset_thread_cpu_peak();
        const int64_t start = thread_cpu_memory().current;
        run_schedule(stage, *ctx.comm, ops, batch, o.micro_batches);
        peaks[static_cast<size_t>(ctx.rank)] = thread_cpu_memory().peak - start;
      },
      kTimeout);
  return peaks;
}

// ZB-H1's memory claim (Qi et al. 2024, sec. 2.1): the peak of 1F1B's first stage on every
// stage. Stage s keeps the graph of each micro-batch from its forward to its W, at most p of
// them (W of j runs after I of j + s), where 1F1B keeps p - s; and nothing grows with m. Measured
// per stage, with one micro-batch's stored activations on that stage (GPipe's growth from m = 8
// to 12, over 4) as the unit: ZB-H1's peak at most 1F1B's plus s units and the s output
// gradients kept from I to W, and the same at m = 8 and m = 12. Deferring every W to the end
// keeps all m graphs, and grows.
TEST(L09Memory, ZbH1HoldsAtMostPGraphsOnEveryStage) {
  const auto gpipe8 = step_peaks(ScheduleKind::kGpipe, 8);
  const auto gpipe12 = step_peaks(ScheduleKind::kGpipe, 12);
  const auto f8 = step_peaks(ScheduleKind::k1f1b, 8);
  const auto zb8 = step_peaks(ScheduleKind::kZbH1, 8);
  const auto zb12 = step_peaks(ScheduleKind::kZbH1, 12);
  const PipelineOptions o = small_run(ScheduleKind::kZbH1, 8);
  const int64_t one_output = 4 * o.model.ctx * o.model.hidden * 4;  // (4, T, h) fp32
  for (int s = 0; s < 4; ++s) {
    SCOPED_TRACE(fmt::format("stage {}", s));
    const auto k = static_cast<size_t>(s);
    const int64_t unit = (gpipe12[k] - gpipe8[k]) / 4;
    std::cout << "    stage " << s << ": one micro-batch's activations " << unit
              << " bytes; step peak 1F1B " << f8[k] << ", ZB-H1 " << zb8[k] << " (m = 8), "
              << zb12[k] << " (m = 12)\n";
    EXPECT_LE(std::abs(zb12[k] - zb8[k]), one_output / 2)
        << "ZB-H1's step peak grew with m: a micro-batch's graph outlives its W";
    EXPECT_LE(zb8[k], f8[k] + s * (unit + one_output) + unit / 2)
        << "ZB-H1 holds more than p micro-batches' graphs";
  }
}

// Interleaved 1F1B's price, derived from its warm-up count: rank s runs 2 (p - s - 1) + (v - 1) p
// forwards of chunks of 1/v of its layers before its first backward, so it holds up to warm-up + 1
// such pieces, (warm-up + 1) / v of a stage's micro-batch, where 1F1B holds p - s. On 4 ranks x 2
// chunks (8 blocks) that is 11, 9, 7, 5 halves against 4, 3, 2, 1 whole micro-batches: 1.5
// micro-batches more on every rank. Measured with one micro-batch's activations on the rank
// (GPipe's growth from m = 8 to 12, over 4, on the same 8 blocks) as the unit: interleaved's
// peak above 1F1B's on rank 0, at most 1F1B's plus the predicted extra units and pieces / 2
// messages (a unit holds one received input; each piece may hold its own, a message the size of
// a stage's output: at most pieces - (p - s) - extra = pieces / 2 more of them), and the same at
// m = 8 and 12. Measured: 1.5 units plus 2.5 messages on every rank, under the bound on ranks
// 0-2 (a piece's input stands in for activations the whole stage would have kept anyway).
TEST(L09Memory, InterleavedHoldsItsWarmUpAndNoMore) {
  const auto gpipe8 = step_peaks(ScheduleKind::kGpipe, 8, 1, 8);
  const auto gpipe12 = step_peaks(ScheduleKind::kGpipe, 12, 1, 8);
  const auto f8 = step_peaks(ScheduleKind::k1f1b, 8, 1, 8);
  const auto i8 = step_peaks(ScheduleKind::kInterleaved, 8, 2, 8);
  const auto i12 = step_peaks(ScheduleKind::kInterleaved, 12, 2, 8);
  const PipelineOptions o = small_run(ScheduleKind::kInterleaved, 8);
  const int64_t one_output = 4 * o.model.ctx * o.model.hidden * 4;  // (4, T, h) fp32
  for (int s = 0; s < 4; ++s) {
    SCOPED_TRACE(fmt::format("rank {}", s));
    const auto k = static_cast<size_t>(s);
    const int64_t unit = (gpipe12[k] - gpipe8[k]) / 4;
    const int pieces = std::min(2 * (4 - s - 1) + 4 + 1, 16);  // warm-up + 1, at most v m
    const double extra = pieces / 2.0 - (4 - s);               // micro-batches beyond 1F1B's
    std::cout << "    rank " << s << ": one micro-batch's activations " << unit
              << " bytes; step peak 1F1B " << f8[k] << ", interleaved " << i8[k] << " (m = 8), "
              << i12[k] << " (m = 12); predicted extra " << extra << " micro-batches\n";
    EXPECT_LE(std::abs(i12[k] - i8[k]), one_output / 2)
        << "interleaved's step peak grew with m: a micro-batch outlives its backward";
    EXPECT_LE(static_cast<double>(i8[k]), static_cast<double>(f8[k]) +
                                              extra * static_cast<double>(unit) +
                                              pieces / 2.0 * static_cast<double>(one_output))
        << "interleaved holds more than its warm-up predicts";
  }
  EXPECT_GT(i8[0], f8[0])
      << "rank 0 holds 5.5 micro-batches' worth under interleaving, 4 under 1F1B";
}

// Megatron's deallocate_output_tensor: stage 0 of 4 under 1F1B keeps 4 micro-batches in flight;
// with deallocation each keeps its graph but not the (b/m, T, h) output it sent on, so the
// step's peak falls by those outputs: measured 4 of 8,192 bytes here (763,008 -> 730,256, the
// rest one-element placeholders); the test asks for 3. The training is the same (the
// parameters of L09Pipeline's baseline, below).
TEST(L09Memory, DeallocatingSentOutputsSavesTheirBytes) {
  const int64_t kept = stage_zero_step_peak(ScheduleKind::k1f1b, false);
  const int64_t freed = stage_zero_step_peak(ScheduleKind::k1f1b, true);
  const PipelineOptions o = small_run(ScheduleKind::k1f1b, 8);
  const int64_t output_bytes = 32 / 8 * o.model.ctx * o.model.hidden * 4;  // (b/m, T, h) fp32
  EXPECT_GE(kept - freed, 3 * output_bytes)
      << "1F1B stage 0's step peak: " << kept << " bytes keeping its sent outputs, " << freed
      << " freeing them; one output is " << output_bytes << " bytes";
}

TEST(L09Pipeline, DeallocatingOutputsTrainsTheSameModel) {
  const PipelineOptions o = small_run(ScheduleKind::k1f1b, 4);
  const test::BaselineRun base = test::plain_baseline(o, o.steps);
  std::vector<float> losses;
  std::map<std::string, torch::Tensor> params;
  std::mutex mu;
  run_ranks(
      4,
      [&](RankContext& ctx) {
        Gpt full(o.model);
        init_weights(full, o.seed);
        Stage stage = make_stage(full, 4, ctx.rank);
        const auto mine = stage.parameters();
        torch::optim::AdamW optimizer(mine, adamw_options(o));
        const auto ops = make_schedule(o.schedule, 4, o.micro_batches, ctx.rank);
        const ByteDataset data = ByteDataset::builtin();
        for (int64_t step = 0; step < o.steps; ++step) {
          for (auto p : mine) p.mutable_grad().reset();
          run_schedule(stage, *ctx.comm, ops, data.batch(o.seed, step, o.batch, o.model.ctx),
                       o.micro_batches, /*deallocate_outputs=*/true);
          optimizer.step();
        }
        std::lock_guard<std::mutex> lock(mu);
        for (const auto& item : full->named_parameters()) {
          for (const auto& p : mine) {
            if (p.unsafeGetTensorImpl() == item.value().unsafeGetTensorImpl()) {
              params.emplace(item.key(), item.value().detach().clone());
            }
          }
        }
      },
      kTimeout);
  size_t i = 0;
  for (const auto& item : Gpt(o.model)->named_parameters()) {
    SCOPED_TRACE(item.key());
    ASSERT_TRUE(params.count(item.key())) << "in no stage";
    EXPECT_ADAMW_PARAMS_CLOSE(params[item.key()], base.params[i], o.steps, o.lr);
    ++i;
  }
}

// make_stage keeps the full model's own modules: the same tensors, the model's order.
TEST(L09Split, StagesShareTheFullModelsWeights) {
  GptConfig c;
  c.layers = 5;
  c.hidden = 32;
  c.heads = 2;
  c.ctx = 16;
  c.tied = false;
  Gpt full(c);
  init_weights(full, 1);
  const auto all = full->parameters();
  std::vector<torch::Tensor> joined;
  for (int s = 0; s < 2; ++s) {
    Stage stage = make_stage(full, 2, s);
    EXPECT_EQ(static_cast<int64_t>(stage.blocks.size()), s == 0 ? 3 : 2);  // 5 = 3 + 2
    for (const auto& p : stage.parameters()) joined.push_back(p);
  }
  ASSERT_EQ(joined.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_TRUE(joined[i].is_same(all[i])) << "parameter " << i << " is not the model's own";
  }
  // The stages chained give the full model's logits.
  const Batch b = ByteDataset::builtin().batch(1, 0, 2, 16);
  auto x = make_stage(full, 2, 0).forward(b.inputs);
  x = make_stage(full, 2, 1).forward(x);
  EXPECT_TENSOR_CLOSE(x, full->forward(b.inputs), kExact);
}

// NCCL's rules, replayed on what each stage's communicator saw. A RecordingComm around each
// stage logs every send, receive and group (outside the executor); the replay then runs the
// recorded calls as NCCL would (its ncclSend/ncclRecv reference and its point-to-point guide):
//   - every point-to-point call must be a group (dtc::batch_isend_irecv): on NCCL a lone call
//     runs on a communicator of its two ranks, a group on the whole group's, and a message sent
//     on one is never received on the other;
//   - a rank's groups run one after the other; a group completes once each of its ops has met
//     its peer's, and the ops of one group progress together;
//   - the k-th send from rank r to q meets the k-th receive posted on q from r: NCCL has no
//     tags, so their tags must agree, or NCCL would deliver another micro-batch's tensor.
// A replay that stops with groups left is a deadlock on NCCL. gloo never shows it: its sends and
// receives are matched by tag, and the executor never waits for a send before its receive.
struct P2pCall {
  bool send = false;
  int peer = -1;
  int tag = -1;
  int64_t bytes = 0;
  int64_t nth = 0;  // among this rank's calls of the same kind with the same peer
  bool met = false;
};

// Each rank's groups of calls, in the order they were issued; "" when every call is in a group,
// else what is not.
std::string group_calls(const std::vector<std::vector<CommEvent>>& events,
                        std::vector<std::vector<std::vector<P2pCall>>>& groups) {
  std::string lone;
  groups.assign(events.size(), {});
  for (size_t r = 0; r < events.size(); ++r) {
    std::map<std::pair<bool, int>, int64_t> count;
    bool open = false;
    for (const CommEvent& e : events[r]) {
      if (e.op == "group_start") {
        open = true;
        groups[r].emplace_back();
      } else if (e.op == "group_end") {
        open = false;
      } else if (e.op == "send" || e.op == "recv") {
        const bool send = e.op == "send";
        P2pCall c{send, e.peer, e.tag, e.bytes, count[{send, e.peer}]++, false};
        if (!open) {
          lone += fmt::format("stage {}: {} stage {} (tag {}) outside any group\n", r,
                              send ? "send to" : "receive from", e.peer, e.tag);
          groups[r].emplace_back();
        }
        groups[r].back().push_back(c);
      }
    }
  }
  return lone;
}

// Replays the groups under NCCL's rules. @return "" when every group completes, else why not.
std::string replay_as_nccl(std::vector<std::vector<std::vector<P2pCall>>> groups) {
  const size_t n = groups.size();
  std::vector<size_t> head(n, 0);
  std::string wrong;
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < n; ++r) {
      if (head[r] >= groups[r].size()) continue;
      for (P2pCall& c : groups[r][head[r]]) {
        if (c.met) continue;
        const auto q = static_cast<size_t>(c.peer);
        if (q >= n || head[q] >= groups[q].size()) continue;
        for (P2pCall& d : groups[q][head[q]]) {
          if (d.met || d.send == c.send || d.peer != static_cast<int>(r) || d.nth != c.nth)
            continue;
          if (d.tag != c.tag || d.bytes != c.bytes) {
            wrong += fmt::format(
                "stage {}'s message {} to stage {} is tag {} ({} bytes), but stage {}'s receive "
                "{} from {} expects tag {} ({} bytes): NCCL, which has no tags, would deliver it\n",
                c.send ? r : q, c.nth, c.send ? q : r, c.send ? c.tag : d.tag,
                c.send ? c.bytes : d.bytes, c.send ? q : r, c.nth, c.send ? r : q,
                c.send ? d.tag : c.tag, c.send ? d.bytes : c.bytes);
          }
          c.met = d.met = true;
          progress = true;
          break;
        }
      }
      const auto& g = groups[r][head[r]];
      if (std::all_of(g.begin(), g.end(), [](const P2pCall& c) { return c.met; })) {
        ++head[r];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (size_t r = 0; r < n; ++r) {
    if (head[r] >= groups[r].size()) continue;
    stuck +=
        fmt::format("  stage {} waits in its group {} of {}:", r, head[r] + 1, groups[r].size());
    for (const P2pCall& c : groups[r][head[r]]) {
      if (!c.met)
        stuck +=
            fmt::format(" {} {} (tag {});", c.send ? "send to" : "receive from", c.peer, c.tag);
    }
    stuck += "\n";
  }
  if (!stuck.empty()) wrong += "deadlock on NCCL:\n" + stuck;
  return wrong;
}

// One step of @p schedule on @p stages thread-ranks, every rank's communication recorded (a
// RecordingComm under run_schedule): events[rank].
std::vector<std::vector<CommEvent>> recorded_step(const PipelineOptions& o, ScheduleKind schedule,
                                                  int stages, int64_t m, int chunks = 1) {
  std::vector<std::vector<CommEvent>> events(static_cast<size_t>(stages));
  run_ranks(
      stages,
      [&](RankContext& ctx) {
        auto rec = c10::make_intrusive<RecordingComm>(ctx.comm);
        Gpt full(o.model);
        init_weights(full, o.seed);
        std::vector<Stage> parts = make_chunks(full, stages, chunks, ctx.rank);
        const auto ops = make_schedule(schedule, stages, m, ctx.rank, chunks);
        run_schedule(parts, *rec, ops,
                     ByteDataset::builtin().batch(o.seed, 0, o.batch, o.model.ctx), m);
        events[static_cast<size_t>(ctx.rank)] = rec->events();
      },
      kTimeout);
  return events;
}

TEST(L09NcclSafe, EveryTransferIsAGroupAndNothingDeadlocksUnderNcclRules) {
  int checked = 0;
  for (ScheduleKind schedule : {ScheduleKind::kGpipe, ScheduleKind::k1f1b}) {
    for (int stages : {2, 3, 4}) {
      for (int64_t m : {1, 2, 3, 4, 8}) {  // fewer micro-batches than stages too (no steady phase)
        SCOPED_TRACE(fmt::format("{}, {} stages, {} micro-batches",
                                 schedule == ScheduleKind::kGpipe ? "gpipe" : "1f1b", stages, m));
        PipelineOptions o = small_run(schedule, m);
        o.batch = 24;  // divisible by every m above
        const auto events = recorded_step(o, schedule, stages, m);
        std::vector<std::vector<std::vector<P2pCall>>> groups;
        const std::string lone = group_calls(events, groups);
        EXPECT_EQ(lone, "") << "every send and receive goes through dtc::batch_isend_irecv:\n"
                            << lone;
        const std::string replay = replay_as_nccl(groups);
        EXPECT_EQ(replay, "") << replay;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 30);
}

// The same replay for the new schedules: interleaved (v = 2, 3; its messages wrap from the last
// rank to rank 0) and ZB-H1 (I sends as B does, W sends nothing).
TEST(L09NcclSafe, InterleavedAndZeroBubbleStepsAreSafeUnderNcclRules) {
  int checked = 0;
  for (int stages : {2, 3, 4}) {
    for (int chunks : {1, 2, 3}) {
      for (int64_t m : {int64_t{stages}, int64_t{2} * stages, int64_t{1}, int64_t{5}}) {
        const ScheduleKind kind = chunks == 1 ? ScheduleKind::kZbH1 : ScheduleKind::kInterleaved;
        if (kind == ScheduleKind::kInterleaved && m % stages != 0) continue;
        SCOPED_TRACE(fmt::format("{}, {} stages x {} chunks, {} micro-batches", schedule_name(kind),
                                 stages, chunks, m));
        PipelineOptions o = small_run(kind, m);
        o.model.layers = int64_t{stages} * chunks;
        o.batch = 120;  // divisible by every m above
        const auto events = recorded_step(o, kind, stages, m, chunks);
        std::vector<std::vector<std::vector<P2pCall>>> groups;
        const std::string lone = group_calls(events, groups);
        EXPECT_EQ(lone, "") << "every send and receive goes through dtc::batch_isend_irecv:\n"
                            << lone;
        EXPECT_EQ(replay_as_nccl(groups), "");
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 24);
}

// A send that no receive of the next op pairs with (GPipe's forwards on every stage but the
// last, 1F1B's warm-up) is waited for at the end of the step, not at once: the stage computes
// its next micro-batch while the message travels. Seen by a RecordingComm: between such a
// send's group and the first wait() on its Work, the stage issues the next op's send (which it
// does only after computing that op; a receive it may post before). A send waited for at once gives
// the same values and never deadlocks on gloo, so nothing else sees it.
TEST(L09Overlap, ALoneSendStaysInFlightWhileTheNextMicroBatchComputes) {
  constexpr int kStagesHere = 4;
  for (ScheduleKind schedule : {ScheduleKind::kGpipe, ScheduleKind::k1f1b}) {
    const int64_t m = 4;
    PipelineOptions o = small_run(schedule, m);
    const auto events = recorded_step(o, schedule, kStagesHere, m);
    int lone_sends = 0;
    for (int rank = 0; rank < kStagesHere; ++rank) {
      const auto& ev = events[static_cast<size_t>(rank)];
      SCOPED_TRACE(
          fmt::format("{}, stage {}", schedule == ScheduleKind::kGpipe ? "gpipe" : "1f1b", rank));
      for (size_t i = 0; i < ev.size(); ++i) {
        if (ev[i].op != "group_start") continue;
        size_t end = i + 1;
        int sends = 0, recvs = 0;
        for (; end < ev.size() && ev[end].op != "group_end"; ++end) {
          sends += ev[end].op == "send";
          recvs += ev[end].op == "recv";
        }
        if (end >= ev.size() || sends != 1 || recvs != 0) continue;  // paired, or no group
        // The Work waited on is the group's (LibTorch 2.x) or the send's own (1.13).
        const int64_t ids[2] = {ev[i + 1].seq, ev[end].seq};
        size_t wait = end + 1;
        while (wait < ev.size() &&
               !(ev[wait].op == "wait" && (ev[wait].id == ids[0] || ev[wait].id == ids[1]))) {
          ++wait;
        }
        ASSERT_LT(wait, ev.size()) << "a send at event " << i + 1 << " is never waited for";
        // Sends only: a stage posts the next op's receive before computing it, its send after.
        int between = 0, later = 0;
        for (size_t j = end + 1; j < ev.size(); ++j) {
          const bool sent = ev[j].op == "send";
          later += sent;
          between += sent && j < wait;
        }
        if (later == 0) continue;  // the step's last send: nothing left to compute beside it
        ++lone_sends;
        EXPECT_GT(between, 0) << "the send at event " << i + 1
                              << " is waited for before the stage's next send: start it, "
                                 "compute the next op, and wait for it at the end of the step";
      }
    }
    EXPECT_GT(lone_sends, 0) << "a schedule with sends that nothing pairs";
  }
}

TEST(L09P2p, SendAndRecvMoveActivationsBothWays) {
  run_ranks(
      2,
      [](RankContext& ctx) {
        const auto act = torch::arange(24, torch::kFloat).reshape({2, 3, 4});
        if (ctx.rank == 0) {
          send_tensor(*ctx.comm, act, 1, activation_tag(5))->wait();
          auto g = recv_tensor(*ctx.comm, {2, 3, 4}, 1, gradient_tag(5));
          EXPECT_TENSOR_CLOSE(g, -act, kExact);
        } else {
          auto a = recv_tensor(*ctx.comm, {2, 3, 4}, 0, activation_tag(5));
          EXPECT_TENSOR_CLOSE(a, act, kExact);
          send_tensor(*ctx.comm, -a, 0, gradient_tag(5))->wait();
        }
      },
      kTimeout);
}

// bf16 (the tolerance policy of lessons 02, 07 and 08): a bf16 model with fp32 master weights,
// 2 and 4 stages under 1F1B, lands within kOtherRounding of the noise floor from the
// single-process bf16 baseline and at least kAwayFromFp32 of it from the fp32 baseline. The
// floor is rho(bf16 baseline, fp32 baseline), rho = |w - r| / |r - w0| on the fp32 master
// weights; each stage compares its own weights with the same stage cut from the baselines'
// weights (make_stage). The pipeline accumulates each micro-batch's bf16 gradient into the
// parameter's bf16 gradient, where the baseline computes the whole batch's at once: another
// rounding of the same training, measured at 0.48 of the floor (the same for 2 and 4 stages:
// the fp32 messages between stages are exact). Bound 1.5, lesson 08's and lesson 02's for
// another bf16 scheme.
TEST(L09Bf16, PipelineMatchesTheBf16BaselineWithinThePolicy) {
  PipelineOptions o = small_run(ScheduleKind::k1f1b, 4);
  o.steps = 6;
  const test::BaselineRun fp32 = test::plain_baseline(o, o.steps);
  o.precision = Precision::kBf16;
  const test::BaselineRun bf16 = test::plain_baseline(o, o.steps);
  Gpt init(o.model);
  init_weights(init, o.seed);
  std::vector<torch::Tensor> w0;
  for (const auto& p : init->parameters()) w0.push_back(p.detach().clone());
  test::RhoSums between;  // the floor, from the full weights in one process
  for (size_t i = 0; i < w0.size(); ++i) {
    between.add(bf16.params[i], fp32.params[i], fp32.params[i], w0[i]);
  }
  const double floor = between.rho_bf16();
  for (int stages : {2, 4}) {
    SCOPED_TRACE(testing::Message() << stages << " stages");
    std::mutex mu;
    test::RhoSums sums;
    std::vector<float> losses;
    run_ranks(
        stages,
        [&](RankContext& ctx) {
          PipelineOptions run = o;
          run.weights = true;
          const PipelineResult r = train_pipeline(run, *ctx.comm);
          const std::vector<torch::Tensor>& w = r.weights;
          const std::vector<float>& l = r.losses;
          // The same stage of the baselines' weights, cut by make_stage.
          auto cut = [&](const std::vector<torch::Tensor>& weights) {
            return make_stage(test::gpt_with(o.model, weights), stages, ctx.rank).parameters();
          };
          const auto rb = cut(bf16.params), rf = cut(fp32.params), r0 = cut(w0);
          test::RhoSums mine;
          for (size_t i = 0; i < w.size(); ++i) mine.add(w[i], rb[i], rf[i], r0[i]);
          std::lock_guard<std::mutex> lock(mu);
          sums.add(mine);
          if (ctx.rank == 0) losses = l;
        },
        kTimeout);
    test::expect_bf16_policy(sums, floor, test::kOtherRounding, losses, bf16.losses,
                             "the pipeline");
  }
}

// Full recomputation per stage: the same gradients bit for bit (the CPU runs the same
// operations on the same values twice), so the same master weights after several steps, for
// GPipe and 1F1B on 2 and 4 stages.
TEST(L09Recompute, SameWeightsBitForBit) {
  for (ScheduleKind schedule : {ScheduleKind::kGpipe, ScheduleKind::k1f1b}) {
    for (int stages : {2, 4}) {
      SCOPED_TRACE(testing::Message() << schedule_name(schedule) << ", " << stages << " stages");
      PipelineOptions o = small_run(schedule, 4);
      std::vector<std::vector<torch::Tensor>> plain(static_cast<size_t>(stages)),
          again(static_cast<size_t>(stages));
      for (bool recompute : {false, true}) {
        o.recompute = recompute ? Recompute::kFull : Recompute::kNone;
        auto& out = recompute ? again : plain;
        run_ranks(
            stages,
            [&](RankContext& ctx) {
              PipelineOptions run = o;
              run.weights = true;
              out[static_cast<size_t>(ctx.rank)] = train_pipeline(run, *ctx.comm).weights;
            },
            kTimeout);
      }
      for (size_t r = 0; r < plain.size(); ++r) {
        ASSERT_EQ(plain[r].size(), again[r].size());
        ASSERT_FALSE(plain[r].empty());
        for (size_t i = 0; i < plain[r].size(); ++i) {
          EXPECT_TRUE(torch::equal(plain[r][i], again[r][i]))
              << "stage " << r << ", parameter " << i << ": recomputing changed the weights";
        }
      }
    }
  }
}

// What recomputation is for: 1F1B stage 1 of 4 (m = 8, 3 micro-batches in flight) keeps, per
// micro-batch, its (b/m, T, h) input instead of its layer's saved tensors, measured by the
// counting allocator (this rank thread's peak during one step): measured 289,664 of 570,752
// bytes (0.51); the rest is the step's gradients and one micro-batch being recomputed.
TEST(L09Recompute, AStageKeepsOnlyItsInputs) {
  const int64_t kept = stage_zero_step_peak(ScheduleKind::k1f1b, false, false, 1);
  const int64_t recomputed = stage_zero_step_peak(ScheduleKind::k1f1b, false, true, 1);
  ASSERT_GT(kept, 0);
  std::cout << "    stage 1's step peak: " << kept << " bytes keeping activations, " << recomputed
            << " recomputing\n";
  EXPECT_LT(static_cast<double>(recomputed), 0.6 * static_cast<double>(kept))
      << "stage 1's step peak: " << kept << " bytes keeping the activations, " << recomputed
      << " recomputing; a recomputing forward must record no graph";
}

// Every stage, the last included (whose forward ends in the loss and the (b/m, T, V) logits):
// under GPipe a stage holds all m = 8 micro-batches before the first backward, so keeping the
// activations costs 8 graphs and recomputing 8 inputs and one graph. A stage that records its
// graph anyway (the last one's loss kept with its graph, say) keeps 8 graphs and passes every
// value test.
class L09RecomputeStage : public ::testing::TestWithParam<int> {};

TEST_P(L09RecomputeStage, EveryStageKeepsOnlyItsInputsUnderGpipe) {
  const int rank = GetParam();
  const int64_t kept = stage_zero_step_peak(ScheduleKind::kGpipe, false, false, rank);
  const int64_t recomputed = stage_zero_step_peak(ScheduleKind::kGpipe, false, true, rank);
  ASSERT_GT(kept, 0);
  std::cout << "    stage " << rank << "'s GPipe step peak: " << kept
            << " bytes keeping activations, " << recomputed << " recomputing\n";
  EXPECT_LT(static_cast<double>(recomputed), 0.6 * static_cast<double>(kept))
      << "stage " << rank << "'s GPipe step peak: " << kept << " bytes keeping the activations, "
      << recomputed << " recomputing; a recomputing forward must record no graph and keep "
      << "nothing but its input, on every stage";
}

INSTANTIATE_TEST_SUITE_P(Stages, L09RecomputeStage, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });
}  // namespace
}  // namespace dtc::l09

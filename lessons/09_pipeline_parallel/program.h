// Lesson 09's program, as functions so that tests can run it in-process: train_pipeline() trains
// the pipelined GPT on a connected job (the tests call it on thread-ranks), run_pipeline() adds
// the measurements (bubble fraction, activation memory), run_program() reads the flags and the
// launch environment and connects the ranks. Given in full (program.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "dtc/launch.h"
#include "dtc/program.h"
#include "pipeline.h"

namespace dtc::l09 {

/// Everything that decides a pipelined training run: lesson 02's (dtc::RunConfig: the model,
/// whose tied = false is forced, the pipeline needing its own head; the batch, the seed,
/// AdamW's hyperparameters), plus the pipeline's own.
struct PipelineOptions : RunConfig {
  int64_t steps = 20;                           ///< optimizer steps (--steps)
  int64_t micro_batches = 4;                    ///< m (--micro-batches)
  ScheduleKind schedule = ScheduleKind::k1f1b;  ///< --schedule
  int chunks = 1;  ///< v, model chunks per rank (--virtual-stages; interleaved only, else 1)
  /// Pipelines side by side (dp x pp: --stages S on S x replicas ranks): replica r trains on
  /// rows [r b / replicas, (r + 1) b / replicas) of each batch, and each stage averages its
  /// gradients with the same stage of the other replicas.
  int replicas = 1;
  /// Micro-batch counts for the bubble measurement (only those that divide the batch); empty:
  /// no measurement.
  std::vector<int64_t> sweep{1, 2, 4, 8};
  int64_t sweep_steps = 3;             ///< timed steps per (schedule, m); the fastest one counts
  bool json = false;                   ///< rank 0 prints one JSON object on the last line of stdout
  bool deallocate_outputs = false;     ///< --deallocate-outputs: run_schedule()'s option
  torch::Device device = torch::kCPU;  ///< where this rank computes
  bool digest = false;                 ///< train_pipeline fills PipelineResult::digest
  bool weights = false;                ///< train_pipeline fills PipelineResult::weights
};

/// What a train_pipeline run gives back.
struct PipelineResult {
  std::vector<float> losses;  ///< the loss of every step, on every rank (sent from the last stage)
  /// the full model's parameter digest after the last step (dtc/digest.h; every stage adds its
  /// own parameters: collective), on every rank; in bf16, of the fp32 master weights; when
  /// PipelineOptions::digest
  nlohmann::json digest;
  /// this stage's fp32 weights after the last step (the master weights in bf16), in
  /// Stage::parameters() order; when PipelineOptions::weights
  std::vector<torch::Tensor> weights;
};

/// The communicators of a dp x pp job (a dtc::Mesh of pp = @p stages by dp_replicate = world /
/// stages, torchtitan's order, pp slowest: the replicas of a stage are neighbouring ranks):
/// this rank's pipeline (its rank there is its stage) and its stage's replicas.
struct PipelineGroups {
  c10::intrusive_ptr<Comm> pipeline;  ///< pp: one rank per stage of this replica
  c10::intrusive_ptr<Comm> replicas;  ///< dp_replicate: this stage in every replica
};
/// @throws dtc::UsageError("--stages") when @p stages does not divide the world.
PipelineGroups pipeline_groups(const c10::intrusive_ptr<c10d::Store>& store, int world, int rank,
                               int stages, BackendKind backend, std::chrono::milliseconds timeout,
                               const std::string& master_addr = "127.0.0.1");

/// Trains on every rank of @p comm, one stage per rank (stages = comm size; the replica's
/// pipeline when there are several), from the
/// baseline's initial weights (dtc::init_weights with the seed) on the baseline's batches
/// (ByteDataset::builtin(), rows 0..batch-1 of each step).
/// In bf16: a bf16 model, AdamW over fp32 master weights (dtc::MasterAdamW).
/// With @p replicas (options.replicas of them, this stage in each pipeline): this pipeline takes
/// its replica's rows, and each chunk's gradients are averaged over the replicas (an fp32
/// allreduce), started as soon as the chunk's last backward pass is done (Stage::begin_step's
/// callback), so that it runs while the stages before are still in their cool-down (Megatron-LM
/// with --overlap-grad-reduce --no-align-grad-reduce starts it about there too; its default
/// aligned mode starts it after the stage's last send); the step waits for it before the
/// optimizer.
/// @param log when not null, records every step's loss and wall time on this rank (and prints
///   the progress lines it is set up to print).
/// @throws dtc::UsageError for a pipeline that does not fit (check_pipeline()), and for fp16.
PipelineResult train_pipeline(const PipelineOptions& options, Comm& comm, StepLog* log = nullptr,
                              Comm* replicas = nullptr);

/// One schedule at one micro-batch count, measured on every stage.
struct BubbleRow {
  ScheduleKind schedule = ScheduleKind::kGpipe;
  int64_t micro_batches = 1;
  int stages = 1;  ///< p
  int chunks = 1;  ///< v (interleaved; else 1)
  /// per stage: idle / window (empty on CUDA: not measured, see measure_bubbles), where the window
  /// is the same for every stage: from a barrier
  /// before the step to a barrier after it (so the window ends when the last stage is done)
  std::vector<double> bubble;
  std::vector<double> idle_per_compute;  ///< per stage: idle / compute in the same window
  std::vector<int64_t> in_flight;        ///< per stage: most micro-batches stored at once
  std::vector<int64_t> peak_bytes;       ///< per stage: allocator peak above the step's start, or
                                         ///< -1 when the counting allocator is not installed
  /// idle / window: (p - 1) / (m + p - 1), the zero-bubble paper's measure; interleaved
  /// (p - 1) / (v m + p - 1); ZB-H1 (p - 1) / (3 m + p - 1), its bubble (p - 1)(F + B - W) when
  /// F, B and W take the same time
  double theory() const;
  /// idle / compute, Narayanan et al.'s measure: (p - 1) / m; interleaved (p - 1) / (v m);
  /// ZB-H1 (p - 1) / (3 m)
  double theory_per_compute() const;
  double mean_bubble() const;  ///< the mean over stages
};

/// Runs options.sweep_steps forward-backward steps (no optimizer step) for each schedule and
/// each m of options.sweep that divides the batch, each between two barriers (one window for
/// every stage), and gathers every stage's numbers from the step with the shortest window. On
/// CUDA the bubble is not measured (the executor's CPU clock around asynchronous kernels times
/// their launch): bubble and idle_per_compute stay empty.
std::vector<BubbleRow> measure_bubbles(const PipelineOptions& options, Comm& comm);

/// Trains, measures, and prints the report on rank 0 (tables, or one JSON line with "losses",
/// "tokens_per_s", "bubble", "memory"). @return 0.
int run_pipeline(const PipelineOptions& options, Comm& comm, std::ostream& out, std::ostream& err,
                 Comm* replicas = nullptr);

/// Runs `lesson09` with @p argv. A single process (no launcher) runs a one-stage pipeline.
/// @return the exit code: 0, 1 for a runtime failure, 2 for bad input (the message names the
///   flag), 3 while a TODO(L09) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
                const EnvLookup& env = process_env);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l09

// Lesson 08's program, and the given pieces around your tensor-parallel modules: the dp x tp rank
// grid (a dtc::Mesh), its subgroups, the training loop with data-parallel gradient
// averaging, and the communication volume per layer (so that tests can run them in-process).
#pragma once

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "dtc/compat.h"
#include "dtc/dist.h"
#include "dtc/mesh.h"
#include "tensor_parallel.h"

namespace dtc::l08 {

// ---------------------------------------------------------------------------------------------
// The rank grid (given): a dtc::Mesh of dp_replicate x tp
// ---------------------------------------------------------------------------------------------

/// @brief The dp x tp mesh for @p world ranks from --dp and --tp (0 = not given): neither given
///   -> tp = world, dp = 1; one given -> the other is world / it. tp is the fastest dimension, as
///   in Megatron-LM: rank = tp_rank + tp * dp_rank, a TP group is tp consecutive ranks (one node,
///   NVLink), a DP group (dimension "dp_replicate": each replica holds the whole TP-split model)
///   strides by tp.
/// @throws UsageError (--dp or --tp) when a degree is below 1 or dp * tp != world.
Mesh make_mesh(int world, int dp, int tp);

/// This rank's two communicators.
struct Groups {
  c10::intrusive_ptr<Comm> tp;  ///< this rank's TP group
  c10::intrusive_ptr<Comm> dp;  ///< this rank's DP group
};

/// Builds @p rank's TP and DP groups over @p store (dtc::MeshGroups, TP first, then DP).
Groups make_groups(const c10::intrusive_ptr<c10d::Store>& store, const Mesh& mesh, int rank,
                   BackendKind backend, std::chrono::milliseconds timeout,
                   const std::string& master_addr = "127.0.0.1");

// ---------------------------------------------------------------------------------------------
// Training (given)
// ---------------------------------------------------------------------------------------------

/// Everything that decides a training run: lesson 02's TrainConfig (dtc::RunConfig), the same
/// defaults; its batch is the global batch, split over the dp replicas.
using TrainConfig = RunConfig;

/// Averages every gradient of @p module over @p dp: allreduce SUM, then divide by dp's size
/// (gloo in LibTorch 1.13 has no ReduceOp::AVG).
void average_gradients(torch::nn::Module& module, Comm& dp);

/// What train_tp is given besides its configuration and its groups.
struct TpRunOptions {
  int64_t steps = 1;                            ///< optimizer steps
  torch::Device device = torch::kCPU;           ///< where the model and the batches live
  std::function<void(int64_t, float)> on_step;  ///< after every step, with (step, loss)
  /// TpGpt::set_overlap_dgrad(): backward overlaps each column-parallel layer's input-gradient
  /// allreduce with its weight-gradient matmul
  bool overlap_dgrad = false;
  bool digest = false;   ///< fill TpRunResult::digest
  bool weights = false;  ///< fill TpRunResult::weights
};

/// What a train_tp run gives back.
struct TpRunResult {
  std::vector<float> losses;  ///< the global batch's mean loss of every step, on every rank
  /// the full model's parameter digest after the last step (dtc/digest.h; the shards summed
  /// over tp, then dp: collective), on every rank; in bf16, of the fp32 master weights; when
  /// TpRunOptions::digest
  nlohmann::json digest;
  /// this rank's fp32 weights after the last step (the master weights in bf16), in
  /// TpGpt::parameters() order; when TpRunOptions::weights
  std::vector<torch::Tensor> weights;
};

/// @brief Trains @p config's model, split over @p tp and replicated over @p dp.
///
/// Builds the full GPT with init_weights (on the CPU, then the device), shards it (TpGpt),
/// AdamW over the shards (elementwise: the same update as the baseline's, slice by slice); with
/// config.precision bf16, a bf16 model and AdamW over fp32 master shards (dtc::MasterAdamW). DP
/// replica d trains on rows [d * B/dp, (d+1) * B/dp) of the global batch, and averages its
/// gradients over @p dp before each step, so the update is the baseline's.
/// @throws UsageError when dp does not divide the batch (or tp the model: validate_tp), for
///   fp16, and for bf16 on LibTorch 1.13 (its gloo has no bf16 collectives)
TpRunResult train_tp(const TrainConfig& config, Comm& tp, Comm& dp, const TpRunOptions& options);

// ---------------------------------------------------------------------------------------------
// Communication volume (given)
// ---------------------------------------------------------------------------------------------

/// What one transformer layer sends per training step under tensor parallelism.
struct CommVolume {
  int64_t allreduces = 0;          ///< per layer per step: 2 forward (g) + 2 backward (f)
  int64_t bytes_each = 0;          ///< one allreduce's tensor: b * s * h elements
  int64_t bytes_per_layer = 0;     ///< allreduces * bytes_each
  double wire_bytes_per_rank = 0;  ///< ring allreduce: each rank sends 2(tp-1)/tp x the tensor
  double nvlink_s = 0;             ///< wire bytes at NVLink 4: 450 GB/s each way (900 both ways)
  double infiniband_s = 0;         ///< wire bytes at InfiniBand NDR: 400 Gb/s = 50 GB/s each way
};

/// @brief Megatron's count: 4 allreduces of b*s*h elements per layer and step.
CommVolume tp_comm_volume(int64_t batch, int64_t seq, int64_t hidden, int tp,
                          int64_t bytes_per_element);

/// Runs `lesson08` with @p argv on this process's rank (torchrun's environment); prints on
/// @p out (rank 0), progress and errors on @p err.
/// @return the exit code: 0, 2 for bad input, 3 while a TODO(L08) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l08

// Lesson 02's program, and the given pieces around your training step: the ledger's prediction
// for this model, the memory measurement, and the training loop (so that tests can run them
// in-process).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "baseline.h"
#include "mixed.h"

namespace dtc::l02 {

/// Lesson 01's ledger for AdamW training of the course's GPT, on one device.
struct LedgerPrediction {
  int64_t params = 0;           ///< lesson 01's GPT count: L(12h^2 + 13h) + Vh + ctx*h + 2h
  int64_t param_bytes = 0;      ///< 4 bytes per parameter in fp32, 2 in bf16/fp16
  int64_t grad_bytes = 0;       ///< 4 bytes per parameter in fp32 (or with fp32 gradients), else 2
  int64_t master_bytes = 0;     ///< 4 bytes per parameter in bf16/fp16 (fp32 master), else 0
  int64_t optimizer_bytes = 0;  ///< 8 bytes per parameter: AdamW's two fp32 moments
  /// One transformer block's stored activations, lesson 01's per-tensor list (Korthikanti et
  /// al. 2022) without dropout, at e bytes per element (4 in fp32, 2 in bf16/fp16):
  /// e(16sbh + as^2b) with no recomputation, e 16sbh selective (no s x s scores), e sbh full
  /// (the block's input).
  int64_t activation_bytes_per_layer = 0;
  int64_t activation_bytes = 0;  ///< L blocks' worth
};

/// The ledger's numbers for @p model trained on @p batch sequences of model.ctx tokens in
/// @p precision (fp32 gradients when @p fp32_grads) with @p recompute. Given: it applies lesson
/// 01's formulas (README sections 2, 4 and 5) to this model.
LedgerPrediction predict_memory(const GptConfig& model, int64_t batch,
                                Precision precision = Precision::kFp32, bool fp32_grads = false,
                                Recompute recompute = Recompute::kNone);

/// Bytes measured by the counting CPU allocator (dtc/memory.h) during one training step.
struct MeasuredMemory {
  int64_t params = 0;       ///< allocated by building and initialising the model
  int64_t grads = 0;        ///< left after backward, once the graph is freed
  int64_t master = 0;       ///< allocated for the fp32 master weights (0 in fp32 training)
  int64_t optimizer = 0;    ///< left after the first optimizer.step(): AdamW's lazily made state
  int64_t activations = 0;  ///< held after forward_loss(): what forward saved for backward
  int64_t step_peak = 0;    ///< the highest point of forward + backward, above what was held
                            ///< before forward (activations, their gradients, the new grads)
  bool stepped = true;      ///< false when the loss scaler skipped the step (no AdamW state yet)
};

/// Runs the first training step in its pieces (zero_grad_to_none, forward_loss, backward,
/// step) and measures each: on the CPU with the counting allocator (installed before the model
/// was built), on a CUDA device with the caching allocator's own statistics (bytes of live
/// tensors, rounded up to its 512-byte blocks). The model must be fresh (no optimizer state
/// yet); MeasuredMemory::params is left for the caller, who saw the model being built.
/// @param loss receives the step's loss.
MeasuredMemory measure_step(Gpt& model, torch::optim::AdamW& optimizer, const Batch& batch,
                            float& loss, const torch::Device& device = torch::kCPU);

/// measure_step() for a bf16/fp16 run: zero_grad, forward_loss, backward from the loss (scaled
/// by @p scaler when there is one), master.step(scaler). MeasuredMemory::params and ::master are
/// left for the caller, who saw the model and the master weights being built.
/// @param loss receives the step's loss.
MeasuredMemory measure_mixed_step(Gpt& model, MasterWeights& master, LossScaler* scaler,
                                  const Batch& batch, float& loss,
                                  const torch::Device& device = torch::kCPU);

/// Bytes of live tensors on @p device now: the counting allocator's on the CPU, the CUDA
/// caching allocator's on a GPU.
int64_t device_bytes_now(const torch::Device& device);

/// A finished training run (train_run()).
struct TrainedRun {
  Gpt model{nullptr};         ///< the model after the last step (working dtype)
  std::vector<float> losses;  ///< every step's loss
  /// The fp32 weights AdamW stepped, in model->parameters() order: the master weights in
  /// bf16/fp16, the model's own parameters in fp32.
  std::vector<torch::Tensor> weights;
  std::vector<bool> stepped;   ///< per step: false where the loss scaler skipped it
  std::vector<double> scales;  ///< per step: the loss scale the step ran with (fp16), else 1
};

/// Trains @p config's model (its precision and recompute included) from its initial weights for
/// @p steps steps on the built-in corpus, on the CPU, with your train_step() (fp32) or
/// train_step_mixed() and a LossScaler with @p scaler_options (fp16).
TrainedRun train_run(const TrainConfig& config, int64_t steps,
                     const LossScalerOptions& scaler_options = {});

/// train_run(config, steps).losses.
std::vector<float> train_losses(const TrainConfig& config, int64_t steps);

/// Runs `lesson02` with @p argv; prints the run and the memory table on @p out, progress and
/// errors on @p err.
/// @return the exit code: 0, 2 for bad input (the message names the flag and the fix), 3 while
///   a TODO(L02) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l02

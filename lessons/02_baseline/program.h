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

namespace dtc::l02 {

/// Lesson 01's ledger for fp32 + AdamW training of the course's GPT, on one device.
struct LedgerPrediction {
  int64_t params = 0;           ///< lesson 01's GPT count: L(12h^2 + 13h) + Vh + ctx*h + 2h
  int64_t param_bytes = 0;      ///< 4 bytes per parameter (fp32)
  int64_t grad_bytes = 0;       ///< 4 bytes per parameter (fp32)
  int64_t optimizer_bytes = 0;  ///< 8 bytes per parameter: AdamW's two fp32 moments
  /// The transformer blocks' stored activations, lesson 01's per-tensor list (Korthikanti et
  /// al. 2022) in fp32 and without dropout: L * (64sbh + 4as^2b).
  int64_t activation_bytes = 0;
};

/// The ledger's numbers for @p model trained on @p batch sequences of model.ctx tokens.
/// Given: it applies lesson 01's formulas (README sections 2, 4 and 5) to this model.
LedgerPrediction predict_memory(const GptConfig& model, int64_t batch);

/// Bytes measured by the counting CPU allocator (dtc/memory.h) during one training step.
struct MeasuredMemory {
  int64_t params = 0;       ///< allocated by building and initialising the model
  int64_t grads = 0;        ///< left after backward, once the graph is freed
  int64_t optimizer = 0;    ///< left after the first optimizer.step(): AdamW's lazily made state
  int64_t activations = 0;  ///< held after forward_loss(): what forward saved for backward
  int64_t step_peak = 0;    ///< the highest point of forward + backward, above what was held
                            ///< before forward (activations, their gradients, the new grads)
};

/// Runs the first training step in its pieces (zero_grad_to_none, forward_loss, backward,
/// step) and measures each: on the CPU with the counting allocator (installed before the model
/// was built), on a CUDA device with the caching allocator's own statistics (bytes of live
/// tensors, rounded up to its 512-byte blocks). The model must be fresh (no optimizer state
/// yet); MeasuredMemory::params is left for the caller, who saw the model being built.
/// @param loss receives the step's loss.
MeasuredMemory measure_step(Gpt& model, torch::optim::AdamW& optimizer, const Batch& batch,
                            float& loss, const torch::Device& device = torch::kCPU);

/// Bytes of live tensors on @p device now: the counting allocator's on the CPU, the CUDA
/// caching allocator's on a GPU.
int64_t device_bytes_now(const torch::Device& device);

/// Trains @p config's model from its initial weights for @p steps steps on the built-in corpus,
/// on the CPU, with your train_step().
/// @return the loss of every step.
std::vector<float> train_losses(const TrainConfig& config, int64_t steps);

/// Runs `lesson02` with @p argv; prints the run and the memory table on @p out, progress and
/// errors on @p err.
/// @return the exit code: 0, 2 for bad input (the message names the flag and the fix), 3 while
///   a TODO(L02) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace dtc::l02

// Lesson 02 contract, parts 4 and 5: activation recomputation and mixed precision.
//
// Real training runs in 16 bits: bf16 (or fp16 with loss scaling) weights and activations, with
// an fp32 master copy of the weights that AdamW updates, so that updates smaller than a 16-bit
// weight's rounding step are not lost. That is the layout lesson 01's ledger counts: 2 + 2 + 12
// bytes per parameter (ZeRO's 16), or 2 + 4 + 12 with fp32 gradients (Megatron-LM's 18).
// Recomputation trades compute for activation memory: keep less in forward, run it again in
// backward. This header is the specification of what you implement in mixed.cpp; README.md
// sections 9-11 teach it. `make test-lesson02` checks it against PyTorch and the ledger.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "baseline.h"

namespace dtc::l02 {

// ---------------------------------------------------------------------------------------------
// Recomputation (yours)
// ---------------------------------------------------------------------------------------------

/// Runs @p body on @p inputs and returns its output, keeping only @p inputs for backward; the
/// backward pass runs @p body again, with gradients on, and backpropagates through that second
/// run (torch.utils.checkpoint, which LibTorch's C++ API does not have).
///
/// What must hold: the forward pass stores nothing of @p body's insides (no graph is recorded
/// while it runs the first time); backward yields the same gradients, for @p inputs and for every
/// parameter @p body uses, as running @p body without a checkpoint (bit for bit on the CPU: the
/// same operations run on the same values). @p body must be a pure function of its inputs and
/// parameters (no dropout here, so no random state to replay). Like PyTorch's reentrant
/// checkpoint (use_reentrant=True): backward through it works with backward() (not
/// torch::autograd::grad), and at least one input must require grad, else nothing is recorded
/// and the body's parameters get no gradients. (PyTorch recommends use_reentrant=False, which
/// is built on saved-tensor hooks; those are Python objects that the C++ API cannot install:
/// README section 9.)
/// @param inputs floating-point tensors; the ones that require grad get gradients
torch::Tensor checkpoint(const CheckpointBody& body, const std::vector<torch::Tensor>& inputs);

// ---------------------------------------------------------------------------------------------
// Dynamic loss scaling for fp16 (yours, except scale())
// ---------------------------------------------------------------------------------------------

/// PyTorch's GradScaler defaults (torch/amp/grad_scaler.py).
struct LossScalerOptions {
  double init_scale = 65536.0;  ///< 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;  ///< good steps in a row before the scale grows
};

/// fp16 keeps full precision only down to 6.1e-5 (its smallest normal number); below that it
/// loses bits, down to its smallest subnormal, 2^-24 (6e-8). Rounding to nearest, anything
/// above 2^-25 (3e-8) rounds up to at least 2^-24, and 2^-25 itself ties to the even 0: a
/// gradient of 2^-25 or less becomes zero. The scaler multiplies the loss by a large scale so
/// that the gradients land in fp16's range, divides them again in fp32 before the step, and
/// adapts the scale: an inf or NaN gradient means the scale overflowed fp16 (max 65504), so the
/// step is skipped and the scale halved; growth_interval good steps in a row double it. The same
/// state machine as torch.amp.GradScaler.
class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});
  /// @p loss times the current scale (GradScaler.scale): backward from this.
  torch::Tensor scale(const torch::Tensor& loss) const;

  /// Unscales @p grads in place, and reports whether any of them holds an inf or a NaN
  /// (GradScaler.unscale_, which the step consults).
  ///
  /// What must hold, as in GradScaler's kernel (_amp_foreach_non_finite_check_and_unscale_):
  /// the result is true exactly when some element of some gradient is inf or NaN as it comes in
  /// (still scaled); each defined gradient (fp32) is then multiplied in place by the fp32
  /// reciprocal of the scale, 1/scale computed in double and rounded to float; undefined ones
  /// are skipped.
  bool unscale(const std::vector<torch::Tensor>& grads) const;

  /// Adapts the scale after a step on which unscale() found @p found_inf (GradScaler.update).
  ///
  /// What must hold: on an inf/NaN the scale is multiplied by backoff_factor and the count of
  /// good steps restarts at 0; otherwise the count grows by one, and when it reaches
  /// growth_interval the scale is multiplied by growth_factor (if the result is finite) and the
  /// count restarts at 0.
  void update(bool found_inf);

  double scale_value() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  const LossScalerOptions& options() const { return options_; }

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Master weights (given, except step())
// ---------------------------------------------------------------------------------------------

/// The fp32 master weights and AdamW over them, for a model that trains in bf16 or fp16.
///
///   model parameters (bf16/fp16, 2 B)  --forward/backward-->  gradients (2 B, or fp32 4 B)
///   master weights (fp32, 4 B) + AdamW's two moments (fp32, 8 B)  <--step--  the gradients
///   model parameters  <--rounded copy--  master weights
class MasterWeights {
 public:
  /// Casts @p model to config.precision's working dtype, copies every parameter to fp32 (the
  /// master weights, which start equal to the fp32 initial weights the cast rounded), and builds
  /// AdamW over the copies with @p config's hyperparameters. With config.fp32_grads, each
  /// parameter's gradient goes into an fp32 buffer as soon as autograd has it, and the 16-bit
  /// gradient is freed (Megatron-LM's main_grad, through a hook on the gradient accumulator).
  /// @param model the fp32 model, cast here to the working dtype
  /// @param config its precision, fp32_grads and AdamW's hyperparameters
  /// @param after_copy called once the fp32 copies exist and before the cast (the program
  ///   measures the master weights' bytes between the two)
  /// @throws std::invalid_argument for config.precision fp32 (use make_optimizer)
  MasterWeights(Gpt& model, const TrainConfig& config,
                const std::function<void()>& after_copy = {});
  ~MasterWeights();
  MasterWeights(const MasterWeights&) = delete;
  MasterWeights& operator=(const MasterWeights&) = delete;

  /// The model's parameters (working dtype), in model->parameters() order.
  const std::vector<torch::Tensor>& params() const { return params_; }
  /// The fp32 master weights, one per parameter, same order; AdamW steps these.
  const std::vector<torch::Tensor>& master() const { return master_; }
  /// Parameter @p i's gradient as backward left it: the fp32 buffer with fp32_grads, else
  /// params()[i].grad(); undefined before the first backward and after zero_grad().
  torch::Tensor grad(size_t i) const;
  /// Sets every gradient to none (the model's and the fp32 buffers).
  void zero_grad();
  torch::optim::AdamW& optimizer() { return *optimizer_; }

  /// One optimizer step from the gradients backward left, through the master weights (yours).
  ///
  /// What must hold: AdamW updates the fp32 master weights from the fp32 values of the
  /// gradients (unscaled by @p scaler when there is one); each model parameter is then its master
  /// weight rounded to the working dtype; the fp32 copies of the gradients made for the step are
  /// gone afterwards (only the states of MasterWeights stay). With a @p scaler: when unscale()
  /// finds an inf or NaN the step is skipped (master weights, moments and step counts untouched),
  /// and the scaler is updated either way. With @p max_norm > 0 the gradients AdamW reads are the
  /// unscaled fp32 ones clipped to that global 2-norm (torch::nn::utils::clip_grad_norm_'s
  /// coefficient, min(1, max_norm / (norm + 1e-6))): GradScaler's documented order, unscale, then
  /// clip, then step. A skipped step clips nothing (an inf's norm would make every gradient NaN).
  /// @return whether the step was taken
  bool step(LossScaler* scaler = nullptr, double max_norm = 0);

 private:
  struct Hooks;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> master_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<Hooks> hooks_;  ///< the fp32 gradient buffers and their hooks (fp32_grads)
};

/// One training step in mixed precision (given; part 1's train_step with the scaler): every
/// gradient to none, forward_loss, backward from the scaled loss (from the loss itself without
/// a @p scaler), master.step(scaler).
/// @param stepped receives whether the step was taken (false when the scaler skipped it)
/// @return the loss before the update
float train_step_mixed(Gpt& model, MasterWeights& master, LossScaler* scaler, const Batch& batch,
                       bool* stepped = nullptr);

}  // namespace dtc::l02

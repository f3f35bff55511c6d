// Lesson 02, parts 4 and 5: recomputation and mixed precision. Implements
// lessons/02_baseline/mixed.h.
//
// Fill in every TODO(L02) below; `make test-lesson02` checks the checkpoint's gradients and
// memory, the loss scaler against torch.amp.GradScaler on the same overflows, and bf16/fp16
// training against PyTorch. The scaler's constructor and scale, the master weights' construction
// and gradients, and train_step_mixed are given, in mixed_given.cpp.
#include "mixed.h"

#include <cmath>

#include "dtc/compat.h"
#include "dtc/todo.h"

namespace dtc::l02 {

// ---------------------------------------------------------------------------------------------
// Recomputation
// ---------------------------------------------------------------------------------------------

namespace {

// The body travels through the autograd context as a capsule (saved_data holds IValues).
struct BodyHolder : torch::CustomClassHolder {
  explicit BodyHolder(CheckpointBody b) : body(std::move(b)) {}
  CheckpointBody body;
};

// A custom autograd function (lesson 08 writes more): LibTorch runs forward() with gradients off
// and calls backward() with the gradient of the output.
struct Checkpoint : public torch::autograd::Function<Checkpoint> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const c10::intrusive_ptr<BodyHolder>& holder,
                               torch::TensorList inputs) {
    ctx->saved_data["body"] = c10::IValue::make_capsule(holder);
    // BEGIN SOLUTION: keep the inputs, and nothing else, for backward, and return the body's
    //   output; autograd records no graph here. Tests: L02Recompute.*; hints: README section 9
    ctx->save_for_backward(inputs.vec());
    return holder->body(inputs.vec());
    // END SOLUTION
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto holder =
        c10::static_intrusive_pointer_cast<BodyHolder>(ctx->saved_data["body"].toCapsule());
    torch::autograd::variable_list grads{torch::Tensor()};  // the body is not a tensor
    // BEGIN SOLUTION: run the body again on the saved inputs with gradients on, backpropagate
    //   grad_outputs through that run (which also fills the gradients of the body's parameters),
    //   and append each input's gradient to grads, in order. Tests: L02Recompute.*; hints:
    //   README section 9
    std::vector<torch::Tensor> inputs;
    for (const auto& saved : ctx->get_saved_variables()) {
      inputs.push_back(saved.detach().requires_grad_(saved.requires_grad()));
    }
    torch::Tensor output;
    {
      torch::AutoGradMode enable(true);
      output = holder->body(inputs);
    }
    torch::autograd::backward({output}, {grad_outputs[0]});
    for (const auto& input : inputs) grads.push_back(input.grad());
    // END SOLUTION
    return grads;
  }
};

}  // namespace

torch::Tensor checkpoint(const CheckpointBody& body, const std::vector<torch::Tensor>& inputs) {
  return Checkpoint::apply(c10::make_intrusive<BodyHolder>(body), torch::TensorList(inputs));
}

// ---------------------------------------------------------------------------------------------
// Loss scaling
// ---------------------------------------------------------------------------------------------

bool LossScaler::unscale(const std::vector<torch::Tensor>& grads) const {
  bool found_inf = false;
  // BEGIN SOLUTION: say whether any element of the (still scaled) gradients is inf or NaN, and
  //   multiply every defined gradient in place by 1/scale (computed in double, rounded to float).
  //   Tests: L02LossScaler.*; hints: README section 10
  const auto inv_scale = static_cast<float>(1.0 / scale_);
  torch::NoGradGuard no_grad;
  // One flag on the gradients' device, read once: GradScaler's fused kernel syncs once a step,
  // not once a tensor (an item() per tensor is a host-device sync each, thousands on a GPU).
  torch::Tensor nonfinite;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    const torch::Tensor bad = torch::isfinite(g).all().logical_not();
    nonfinite = nonfinite.defined() ? nonfinite.logical_or(bad) : bad;
    g.mul_(inv_scale);
  }
  found_inf = nonfinite.defined() && nonfinite.item<bool>();
  // END SOLUTION
  return found_inf;
}

void LossScaler::update(bool found_inf) {
  // BEGIN SOLUTION: back off on an overflow; grow after growth_interval good steps in a row, as
  //   GradScaler.update does. Tests: L02LossScaler.*; hints: README section 10
  if (found_inf) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
    return;
  }
  if (++growth_tracker_ == options_.growth_interval) {
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(static_cast<float>(grown))) scale_ = grown;
    growth_tracker_ = 0;
  }
  // END SOLUTION
}

// ---------------------------------------------------------------------------------------------
// Master weights
// ---------------------------------------------------------------------------------------------

bool MasterWeights::step(LossScaler* scaler, double max_norm) {
  // BEGIN SOLUTION: give each master weight the fp32 value of its parameter's gradient, unscale
  //   and check them when there is a scaler (skip the step on inf/NaN, update the scaler either
  //   way), clip the unscaled ones to max_norm when it is > 0, step AdamW, round the master
  //   weights into the model's parameters, and free the fp32 gradient copies.
  //   Tests: L02MasterWeights.*, L02Mixed.*; hints: README section 10
  std::vector<torch::Tensor> grads;
  for (size_t i = 0; i < master_.size(); ++i) {
    const torch::Tensor g = grad(i);
    master_[i].mutable_grad() = g.defined() ? g.to(torch::kFloat) : torch::Tensor();
    grads.push_back(master_[i].grad());
  }
  bool stepped = true;
  if (scaler != nullptr) {
    const bool found_inf = scaler->unscale(grads);
    scaler->update(found_inf);
    stepped = !found_inf;
  }
  if (stepped) {
    if (max_norm > 0) torch::nn::utils::clip_grad_norm_(master_, max_norm);
    optimizer_->step();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < master_.size(); ++i) params_[i].copy_(master_[i]);
  }
  for (auto& m : master_) m.mutable_grad().reset();
  return stepped;
  // END SOLUTION
}

}  // namespace dtc::l02

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
    // TODO(L02)
    DTC_TODO("L02",
             "keep the inputs, and nothing else, for backward, and return the body's "
             "output; autograd records no graph here. Tests: L02Recompute.*; hints: README "
             "section 9");
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto holder =
        c10::static_intrusive_pointer_cast<BodyHolder>(ctx->saved_data["body"].toCapsule());
    torch::autograd::variable_list grads{torch::Tensor()};  // the body is not a tensor
    // TODO(L02)
    DTC_TODO("L02",
             "run the body again on the saved inputs with gradients on, backpropagate "
             "grad_outputs through that run (which also fills the gradients of the body's "
             "parameters), "
             "and append each input's gradient to grads, in order. Tests: L02Recompute.*; hints: "
             "README section 9");
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
  // TODO(L02)
  DTC_TODO("L02",
           "say whether any element of the (still scaled) gradients is inf or NaN, and "
           "multiply every defined gradient in place by 1/scale (computed in double, rounded to "
           "float). "
           "Tests: L02LossScaler.*; hints: README section 10");
  return found_inf;
}

void LossScaler::update(bool found_inf) {
  // TODO(L02)
  DTC_TODO("L02",
           "back off on an overflow; grow after growth_interval good steps in a row, as "
           "GradScaler.update does. Tests: L02LossScaler.*; hints: README section 10");
}

// ---------------------------------------------------------------------------------------------
// Master weights
// ---------------------------------------------------------------------------------------------

bool MasterWeights::step(LossScaler* scaler, double max_norm) {
  // TODO(L02)
  DTC_TODO("L02",
           "give each master weight the fp32 value of its parameter's gradient, unscale "
           "and check them when there is a scaler (skip the step on inf/NaN, update the scaler "
           "either "
           "way), clip the unscaled ones to max_norm when it is > 0, step AdamW, round the "
           "master "
           "weights into the model's parameters, and free the fp32 gradient copies. "
           "Tests: L02MasterWeights.*, L02Mixed.*; hints: README section 10");
}

}  // namespace dtc::l02
// generated from solutions/02_baseline/mixed.cpp; checksum dbb7f872a9b0b93e

// Lesson 02: the single-device baseline. Implements lessons/02_baseline/baseline.h.
//
// Fill in every TODO(L02) below, top to bottom; `make test-lesson02` checks your losses against
// PyTorch's on the same weights and batches, your byte counts against lesson 01's ledger, and
// that a checkpoint resumes bit for bit.
#include "baseline.h"

#include "dtc/compat.h"
#include "dtc/todo.h"

namespace dtc::l02 {

// ---------------------------------------------------------------------------------------------
// The set-up (given)
// ---------------------------------------------------------------------------------------------

Gpt make_model(const TrainConfig& config, const torch::Device& device) {
  Gpt model(config.model);
  init_weights(model, config.seed);
  model->to(device);
  return model;
}

std::unique_ptr<torch::optim::AdamW> make_optimizer(Gpt& model, const TrainConfig& config) {
  auto options = torch::optim::AdamWOptions(config.lr)
                     .betas({config.beta1, config.beta2})
                     .eps(config.eps)
                     .weight_decay(config.weight_decay);
  return std::make_unique<torch::optim::AdamW>(model->parameters(), options);
}

// ---------------------------------------------------------------------------------------------
// The training step
// ---------------------------------------------------------------------------------------------

torch::Tensor forward_loss(Gpt& model, const Batch& batch) {
  // TODO(L02): run the model on batch.inputs, then return the mean cross-entropy of the
  //   logits (B*T, V) against batch.targets (B*T)
  DTC_TODO("L02", "run the model on batch.inputs, then return the mean cross-entropy of the "
                  "logits (B*T, V) against batch.targets (B*T)");
}

float train_step(Gpt& model, torch::optim::Optimizer& optimizer, const Batch& batch) {
  // TODO(L02): zero_grad_to_none, forward_loss, backward, optimizer.step(); return the loss
  DTC_TODO("L02", "zero_grad_to_none, forward_loss, backward, optimizer.step(); return the loss");
}

// ---------------------------------------------------------------------------------------------
// Memory accounting
// ---------------------------------------------------------------------------------------------

StateBytes state_bytes(Gpt& model, torch::optim::AdamW& optimizer) {
  StateBytes bytes;
  // TODO(L02): add numel() * element_size() of every parameter, every defined gradient, and
  //   every AdamWParamState's exp_avg, exp_avg_sq (and max_exp_avg_sq when defined)
  DTC_TODO("L02", "add numel() * element_size() of every parameter, every defined gradient, and "
                  "every AdamWParamState's exp_avg, exp_avg_sq (and max_exp_avg_sq when defined)");
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, Gpt& model, torch::optim::AdamW& optimizer,
                     int64_t steps_done) {
  // TODO(L02): save the model and the optimizer into nested archives "model" and
  //   "optimizer", write "steps_done" as a tensor, and save_to(path)
  DTC_TODO("L02", "save the model and the optimizer into nested archives \"model\" and "
                  "\"optimizer\", write \"steps_done\" as a tensor, and save_to(path)");
}

int64_t load_checkpoint(const std::string& path, Gpt& model, torch::optim::AdamW& optimizer) {
  // TODO(L02): load_from(path), read the nested "model" and "optimizer" archives into the
  //   model and the optimizer, and return "steps_done"
  DTC_TODO("L02", "load_from(path), read the nested \"model\" and \"optimizer\" archives into the "
                  "model and the optimizer, and return \"steps_done\"");
}

}  // namespace dtc::l02
// exercise generated from solutions/02_baseline/baseline.cpp by scripts/exercises.py; checksum c7472d06888e0f16

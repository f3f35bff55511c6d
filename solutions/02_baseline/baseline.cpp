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
  // BEGIN SOLUTION: run the model on batch.inputs, then return the mean cross-entropy of the
  //   logits (B*T, V) against batch.targets (B*T)
  auto logits = model->forward(batch.inputs);  // (B, T, V)
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}),
                                              batch.targets.view({-1}));
  // END SOLUTION
}

float train_step(Gpt& model, torch::optim::Optimizer& optimizer, const Batch& batch) {
  // BEGIN SOLUTION: zero_grad_to_none, forward_loss, backward, optimizer.step(); return the loss
  zero_grad_to_none(optimizer);
  auto loss = forward_loss(model, batch);
  loss.backward();
  optimizer.step();
  return loss.item<float>();
  // END SOLUTION
}

// ---------------------------------------------------------------------------------------------
// Memory accounting
// ---------------------------------------------------------------------------------------------

StateBytes state_bytes(Gpt& model, torch::optim::AdamW& optimizer) {
  StateBytes bytes;
  // BEGIN SOLUTION: add numel() * element_size() of every parameter, every defined gradient, and
  //   every AdamWParamState's exp_avg, exp_avg_sq (and max_exp_avg_sq when defined)
  auto size = [](const torch::Tensor& t) -> int64_t {
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  };
  for (const auto& p : model->parameters()) {
    bytes.params += size(p);
    bytes.grads += size(p.grad());
  }
  for (const auto& item : optimizer.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*item.second);
    bytes.optimizer += size(s.exp_avg()) + size(s.exp_avg_sq()) + size(s.max_exp_avg_sq());
  }
  // END SOLUTION
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, Gpt& model, torch::optim::AdamW& optimizer,
                     int64_t steps_done) {
  // BEGIN SOLUTION: save the model and the optimizer into nested archives "model" and
  //   "optimizer", write "steps_done" as a tensor, and save_to(path)
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model_archive;
  model->save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("steps_done", torch::tensor(steps_done, torch::kLong));
  archive.save_to(path);
  // END SOLUTION
}

int64_t load_checkpoint(const std::string& path, Gpt& model, torch::optim::AdamW& optimizer) {
  // BEGIN SOLUTION: load_from(path), read the nested "model" and "optimizer" archives into the
  //   model and the optimizer, and return "steps_done"
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  torch::serialize::InputArchive model_archive;
  archive.read("model", model_archive);
  model->load(model_archive);
  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);
  torch::Tensor steps_done;
  archive.read("steps_done", steps_done);
  return steps_done.item<int64_t>();
  // END SOLUTION
}

}  // namespace dtc::l02

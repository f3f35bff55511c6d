// Lesson 02: the single-device baseline. Implements lessons/02_baseline/baseline.h.
//
// Fill in every TODO(L02) below, top to bottom; `make test-lesson02` checks your losses against
// PyTorch's on the same weights and batches, your byte counts against lesson 01's ledger, and
// that a checkpoint resumes bit for bit.
#include "baseline.h"

#include "mixed.h"

#include "dtc/compat.h"
#include "dtc/todo.h"

namespace dtc::l02 {

// ---------------------------------------------------------------------------------------------
// The set-up (given)
// ---------------------------------------------------------------------------------------------

Gpt make_model(const TrainConfig& config, const torch::Device& device) {
  Gpt model = make_gpt(config.model, config.seed, device);
  if (config.recompute != Recompute::kNone) model->set_recompute(config.recompute, checkpoint);
  return model;
}

std::unique_ptr<torch::optim::AdamW> make_optimizer(Gpt& model, const TrainConfig& config) {
  // TracedAdamW: AdamW, with its step on the timeline under --trace
  return std::make_unique<TracedAdamW>(model->parameters(), adamw_options(config));
}

// ---------------------------------------------------------------------------------------------
// The training step
// ---------------------------------------------------------------------------------------------

torch::Tensor forward_loss(Gpt& model, const Batch& batch) {
  // BEGIN SOLUTION: return the mean next-token cross-entropy over all B * T positions, a 0-dim
  //   tensor that backward() can start from; it must equal PyTorch's on the same batch.
  //   Tests: L02Step.ForwardLossMatchesPyTorch; README section 5
  auto logits = model->forward(batch.inputs);  // (B, T, V)
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}),
                                              batch.targets.view({-1}));
  // END SOLUTION
}

float train_step(Gpt& model, torch::optim::Optimizer& optimizer, const Batch& batch) {
  // BEGIN SOLUTION: one optimizer step driven by this batch's gradients alone (none of the
  //   previous step's may add in); return the loss from before the update. Tests: L02Step.*;
  //   README section 5
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
  // BEGIN SOLUTION: count the bytes the tensors really hold: after one fp32 step 4, 4 and 8 per
  //   parameter; before it, 4, 0 and 0 (no gradient, no AdamW state yet). Tests: L02Memory.*;
  //   hints: README section 6
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
  // BEGIN SOLUTION: write one file at path holding the weights, AdamW's whole state and
  //   steps_done, under the keys baseline.h names, so that a resumed run matches a straight one
  //   bit for bit. Tests: L02Checkpoint.*; hints: README section 7
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
  // BEGIN SOLUTION: restore what save_checkpoint() wrote into this model and optimizer, and
  //   return its steps_done. Tests: L02Checkpoint.*, L02Program.*; hints: README section 7
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

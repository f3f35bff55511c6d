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
  // TODO(L02)
  DTC_TODO("L02",
           "return the mean next-token cross-entropy over all B * T positions, a 0-dim "
           "tensor that backward() can start from; it must equal PyTorch's on the same batch. "
           "Tests: L02Step.ForwardLossMatchesPyTorch; README section 5");
}

float train_step(Gpt& model, torch::optim::Optimizer& optimizer, const Batch& batch) {
  // TODO(L02)
  DTC_TODO("L02",
           "one optimizer step driven by this batch's gradients alone (none of the "
           "previous step's may add in); return the loss from before the update. Tests: "
           "L02Step.*; "
           "README section 5");
}

// ---------------------------------------------------------------------------------------------
// Memory accounting
// ---------------------------------------------------------------------------------------------

StateBytes state_bytes(Gpt& model, torch::optim::AdamW& optimizer) {
  StateBytes bytes;
  // TODO(L02)
  DTC_TODO("L02",
           "count the bytes the tensors really hold: after one fp32 step 4, 4 and 8 per "
           "parameter; before it, 4, 0 and 0 (no gradient, no AdamW state yet). Tests: "
           "L02Memory.*; "
           "hints: README section 6");
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, Gpt& model, torch::optim::AdamW& optimizer,
                     int64_t steps_done) {
  // TODO(L02)
  DTC_TODO("L02",
           "write one file at path holding the weights, AdamW's whole state and "
           "steps_done, under the keys baseline.h names, so that a resumed run matches a "
           "straight one "
           "bit for bit. Tests: L02Checkpoint.*; hints: README section 7");
}

int64_t load_checkpoint(const std::string& path, Gpt& model, torch::optim::AdamW& optimizer) {
  // TODO(L02)
  DTC_TODO("L02",
           "restore what save_checkpoint() wrote into this model and optimizer, and "
           "return its steps_done. Tests: L02Checkpoint.*, L02Program.*; hints: README section 7");
}

}  // namespace dtc::l02
// generated from solutions/02_baseline/baseline.cpp; checksum 388391bc1610fe8f

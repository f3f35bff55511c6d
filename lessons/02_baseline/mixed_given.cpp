// Lesson 02, parts 4 and 5 (given): the loss scaler's constructor and scale, the master weights'
// construction (with the hooks that keep fp32 gradients), their gradients and zeroing, and one
// mixed-precision training step. Your part is in mixed.cpp; both implement mixed.h.
#include <stdexcept>

#include "dtc/compat.h"
#include "mixed.h"

namespace dtc::l02 {

LossScaler::LossScaler(LossScalerOptions options) : options_(options), scale_(options.init_scale) {}

torch::Tensor LossScaler::scale(const torch::Tensor& loss) const {
  return loss * static_cast<float>(scale_);
}

// With fp32 gradients: a hook after each parameter's gradient accumulator moves the 16-bit
// gradient into an fp32 buffer (Megatron-LM's main_grad) and frees it.
struct MasterWeights::Hooks {
  using Buffers = std::vector<torch::Tensor>;
  std::shared_ptr<Buffers> buffers = std::make_shared<Buffers>();  // a hook may outlive us
  std::vector<GradAccumulator> accumulators;  // held: a parameter keeps its own only weakly
};

MasterWeights::MasterWeights(Gpt& model, const TrainConfig& config,
                             const std::function<void()>& after_copy) {
  if (config.precision == Precision::kFp32) {
    throw std::invalid_argument(
        "MasterWeights is for bf16/fp16 training; fp32 uses make_optimizer");
  }
  std::vector<torch::Tensor> fp32 = model->parameters();
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : fp32) master_.push_back(p.detach().clone());
  }
  if (after_copy) after_copy();
  model->to(working_dtype(config.precision));
  params_ = model->parameters();
  for (auto& m : master_) m.requires_grad_(true);
  optimizer_ = std::make_unique<TracedAdamW>(master_, adamw_options(config));
  if (config.fp32_grads) {
    hooks_ = std::make_unique<Hooks>();
    hooks_->buffers->resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      hooks_->accumulators.push_back(
          take_each_gradient(params_[i], [buffers = hooks_->buffers, i](const torch::Tensor& g) {
            auto& buffer = (*buffers)[i];
            if (buffer.defined()) {
              buffer.add_(g);
            } else {
              buffer = g.to(torch::kFloat);
            }
          }));
    }
  }
}

MasterWeights::~MasterWeights() = default;

torch::Tensor MasterWeights::grad(size_t i) const {
  return hooks_ ? hooks_->buffers->at(i) : params_.at(i).grad();
}

void MasterWeights::zero_grad() {
  for (auto& p : params_) p.mutable_grad().reset();
  if (hooks_) {
    for (auto& b : *hooks_->buffers) b.reset();
  }
}

float train_step_mixed(Gpt& model, MasterWeights& master, LossScaler* scaler, const Batch& batch,
                       bool* stepped) {
  master.zero_grad();
  torch::Tensor loss = forward_loss(model, batch);
  (scaler != nullptr ? scaler->scale(loss) : loss).backward();
  const bool took = master.step(scaler);
  if (stepped != nullptr) *stepped = took;
  return loss.item<float>();
}

}  // namespace dtc::l02

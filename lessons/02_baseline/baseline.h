// Lesson 02 contract: the single-device baseline.
//
// One model (the course's GPT, dtc/model.h), one corpus (dtc/data.h), one device: the training
// step, the bytes it holds, and a checkpoint that resumes bit for bit. Every parallel lesson
// after this one is checked against this baseline, on the same weights and the same batches.
// This header is the whole specification of what you implement in baseline.cpp; README.md
// beside it teaches it. Build and test:
//
//   make test-lesson02          # your exercise, test by test
//   make run-lesson02           # the program: build/bin/lesson02 --help
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

#include "dtc/data.h"
#include "dtc/model.h"

namespace dtc::l02 {

// ---------------------------------------------------------------------------------------------
// The training set-up (given)
// ---------------------------------------------------------------------------------------------

/// Everything that decides a training run: the model, the batch (--global-batch), the seed
/// (--seed) and AdamW's hyperparameters (lr 3e-3, betas 0.9 and 0.999, eps 1e-8, weight decay
/// 0.01). Every later training lesson starts from the same struct: dtc::RunConfig, in
/// dtc/model.h.
using TrainConfig = RunConfig;

/// The course's GPT for @p config, initialised from config.seed (dtc::init_weights), on
/// @p device, in fp32; with config.recompute, its blocks or attention cores recompute through
/// your checkpoint() (mixed.h, part 4).
Gpt make_model(const TrainConfig& config, const torch::Device& device = torch::kCPU);

/// AdamW over every parameter of @p model with @p config's hyperparameters (one group).
std::unique_ptr<torch::optim::AdamW> make_optimizer(Gpt& model, const TrainConfig& config);

// ---------------------------------------------------------------------------------------------
// What you implement (baseline.cpp)
// ---------------------------------------------------------------------------------------------

/// The next-token loss of @p model on @p batch.
///
/// Run the model on batch.inputs (B, T) to get logits (B, T, V), and return the mean
/// cross-entropy between the logits and batch.targets (B, T), over all B * T positions: flatten
/// both to (B*T, V) and (B*T). The result is a scalar that backward() can start from.
/// @return a 0-dim float tensor (requires grad).
torch::Tensor forward_loss(Gpt& model, const Batch& batch);

/// One training step: the four moves every training loop makes, in this order.
///
/// 1. Set every gradient to none with dtc::zero_grad_to_none(optimizer) (dtc/compat.h): the
///    previous step's gradients must not add into this one's, and freeing them is cheaper
///    than zeroing them;
/// 2. loss = forward_loss(model, batch);
/// 3. loss.backward(): fills p.grad() for every parameter p;
/// 4. optimizer.step(): AdamW updates the weights from the gradients.
/// @return the loss, before the update, as a float.
float train_step(Gpt& model, torch::optim::Optimizer& optimizer, const Batch& batch);

/// Bytes of training state, counted from the tensors that hold it.
struct StateBytes {
  int64_t params = 0;     ///< every parameter of the model
  int64_t grads = 0;      ///< every gradient that is defined now
  int64_t optimizer = 0;  ///< AdamW's moments, for every parameter that has optimizer state
  int64_t total() const { return params + grads + optimizer; }
};

/// Counts the bytes of @p model's parameters and gradients and @p optimizer's state.
///
/// A tensor holds numel() * element_size() bytes. Parameters: model->parameters(). Gradients:
/// p.grad() where it is defined (after zero_grad_to_none it is not). Optimizer state:
/// optimizer.state() maps each parameter that has been stepped to a
/// torch::optim::AdamWParamState; count its exp_avg and exp_avg_sq, and max_exp_avg_sq when it
/// is defined (amsgrad). Its step() is a plain integer, not a tensor: no tensor bytes.
/// For fp32 + AdamW after one step this is 4, 4 and 8 bytes per parameter (lesson 01).
StateBytes state_bytes(Gpt& model, torch::optim::AdamW& optimizer);

/// Saves everything that a resumed run needs to continue bit for bit to @p path.
///
/// That is the parameters (model->save), the optimizer's state (optimizer.save: both moments
/// and the step count of every parameter, which AdamW's bias correction reads), and how many
/// steps are done (the batch sampler is a function of the step, so this is the data position).
/// Put them in one torch::serialize::OutputArchive, as nested archives "model" and
/// "optimizer" and a tensor "steps_done", and save_to(path).
/// @throws std::exception (from LibTorch) when the file cannot be written.
void save_checkpoint(const std::string& path, Gpt& model, torch::optim::AdamW& optimizer,
                     int64_t steps_done);

/// Loads a checkpoint written by save_checkpoint() into @p model and @p optimizer, which must
/// have the same shapes (a fresh make_model() and make_optimizer() of the same config).
/// @return the number of steps done when it was saved.
/// @throws std::exception (from LibTorch) when the file is missing or is not such a checkpoint.
int64_t load_checkpoint(const std::string& path, Gpt& model, torch::optim::AdamW& optimizer);

}  // namespace dtc::l02

// The single-process baseline that every parallel lesson's tests compare against: lesson 02's
// training step written out in plain LibTorch (no learner code), and PyTorch's own losses for
// the same runs (tests/reference/lesson02_reference.json, written by lesson02_reference.py).
//
//   const auto ref = dtc::test::plain_baseline(config, steps);   // config: a dtc::RunConfig
//   EXPECT_TENSOR_CLOSE(torch::tensor(my_losses), torch::tensor(ref.losses), kFp32Steps);
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtc/data.h"
#include "dtc/digest.h"
#include "dtc/model.h"

namespace dtc::test {

/// What the baseline run leaves.
struct BaselineRun {
  std::vector<float> losses;          ///< one per step, before its update
  std::vector<torch::Tensor> params;  ///< final parameters, in named_parameters() order
  std::vector<std::string> names;     ///< their names (the full model's, "h.0.attn.c_attn.weight")
  std::vector<double> grad_norms;     ///< clip_grad_norm_'s norm of each step (when clipping)
  nlohmann::json digest;              ///< param_digest of the final parameters
};

/// Trains @p c's GPT, initialised from c.seed (dtc::init_weights), on the whole global batch of
/// c.batch rows per step (dtc::ByteDataset::builtin(), lesson 02's sampler) for @p steps steps
/// with torch::optim::AdamW (dtc::adamw_options(c)): one process, one device (the CPU). With
/// c.precision bf16, a bf16 model and AdamW over fp32 master weights (dtc::MasterAdamW);
/// BaselineRun::params are then the master weights. With @p clip > 0, every step's gradients
/// go through torch::nn::utils::clip_grad_norm_(parameters, clip, @p norm_type) first (fp32; in
/// bf16 MasterAdamW's own 2-norm clipping of the fp32 gradients).
inline BaselineRun plain_baseline(const RunConfig& c, int64_t steps, double clip = 0,
                                  double norm_type = 2) {
  if (clip > 0 && c.precision != Precision::kFp32 && norm_type != 2) {
    throw std::invalid_argument("plain_baseline: clipping in bf16 is MasterAdamW's 2-norm only");
  }
  const ByteDataset data = ByteDataset::builtin();
  Gpt model(c.model);
  init_weights(model, c.seed);
  MasterAdamW opt(*model, c.precision, adamw_options(c));
  BaselineRun run;
  for (int64_t step = 0; step < steps; ++step) {
    const Batch b = data.batch(c.seed, step, c.batch, c.model.ctx);
    opt.zero_grad();
    auto logits = model->forward(b.inputs);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                     b.targets.reshape({-1}));
    loss.backward();
    if (clip > 0 && c.precision == Precision::kFp32) {
      run.grad_norms.push_back(
          torch::nn::utils::clip_grad_norm_(model->parameters(), clip, norm_type));
      opt.step();
    } else {
      opt.step(clip);
    }
    run.losses.push_back(loss.item<float>());
  }
  for (const auto& p : opt.master()) run.params.push_back(p.detach().clone());
  for (const auto& item : model->named_parameters()) run.names.push_back(item.key());
  run.digest = param_digest(*model);
  return run;
}

/// One case of PyTorch's reference run (lesson02_reference.json: "tiny_tied", "tiny_untied").
struct ReferenceCase {
  RunConfig config;           ///< the run: model, global batch, seed, AdamW's hyperparameters
  std::vector<float> losses;  ///< PyTorch's loss of every step
};

/// The run a case of lesson02_reference.json (its "config" object) was computed with.
inline RunConfig run_config_of(const nlohmann::json& reference_case) {
  const auto& j = reference_case.at("config");
  RunConfig r;
  r.model.vocab = j.at("vocab");
  r.model.ctx = j.at("ctx");
  r.model.hidden = j.at("hidden");
  r.model.layers = j.at("layers");
  r.model.heads = j.at("heads");
  r.model.tied = j.at("tied");
  r.seed = j.at("seed");
  r.batch = j.at("batch");
  r.lr = j.at("lr");
  r.beta1 = j.at("betas")[0];
  r.beta2 = j.at("betas")[1];
  r.eps = j.at("eps");
  r.weight_decay = j.at("weight_decay");
  return r;
}

/// Reads case @p name of tests/reference/lesson02_reference.json.
/// @throws nlohmann::json::exception when the file or the case is missing.
inline ReferenceCase reference_case(const std::string& name) {
  std::ifstream in(source_path("tests/reference/lesson02_reference.json"));
  const nlohmann::json c = nlohmann::json::parse(in).at("cases").at(name);
  const auto& j = c.at("config");
  ReferenceCase r;
  r.config = run_config_of(c);
  r.losses = c.at("losses").get<std::vector<float>>();
  return r;
}

}  // namespace dtc::test

// The single-process baseline that every parallel lesson's tests compare against: lesson 02's
// training step written out in plain LibTorch (no learner code), and PyTorch's own losses for
// the same runs (tests/reference/lesson02_reference.json, written by lesson02_reference.py).
//
//   const auto ref = dtc::test::plain_baseline(model, seed, batch, steps);
//   EXPECT_TENSOR_CLOSE(torch::tensor(my_losses), torch::tensor(ref.losses), kFp32Steps);
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "dtc/data.h"
#include "dtc/model.h"

namespace dtc::test {

/// AdamW's hyperparameters (lesson 02's TrainConfig defaults: PyTorch's, lr 3e-3).
struct AdamWHyper {
  double lr = 3e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

/// What the baseline run leaves.
struct BaselineRun {
  std::vector<float> losses;          ///< one per step, before its update
  std::vector<torch::Tensor> params;  ///< final parameters, in named_parameters() order
};

/// Trains @p model_config's GPT, initialised from @p seed (dtc::init_weights), on the whole
/// global batch of @p batch rows per step (dtc::ByteDataset::builtin(), lesson 02's sampler) for
/// @p steps steps with torch::optim::AdamW: one process, one device (the CPU).
inline BaselineRun plain_baseline(const GptConfig& model_config, uint64_t seed, int64_t batch,
                                  int64_t steps, const AdamWHyper& h = {}) {
  const ByteDataset data = ByteDataset::builtin();
  Gpt model(model_config);
  init_weights(model, seed);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(h.lr)
                                                   .betas({h.beta1, h.beta2})
                                                   .eps(h.eps)
                                                   .weight_decay(h.weight_decay));
  BaselineRun run;
  for (int64_t step = 0; step < steps; ++step) {
    const Batch b = data.batch(seed, step, batch, model_config.ctx);
    for (auto& p : model->parameters()) p.mutable_grad().reset();
    auto logits = model->forward(b.inputs);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                     b.targets.reshape({-1}));
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item<float>());
  }
  for (const auto& p : model->parameters()) run.params.push_back(p.detach().clone());
  return run;
}

/// One case of PyTorch's reference run (lesson02_reference.json: "tiny_tied", "tiny_untied").
struct ReferenceCase {
  GptConfig model;
  uint64_t seed = 1;
  int64_t batch = 0;  ///< global batch (rows per step)
  AdamWHyper adamw;
  std::vector<float> losses;  ///< PyTorch's loss of every step
};

/// Reads case @p name of tests/reference/lesson02_reference.json.
/// @throws nlohmann::json::exception when the file or the case is missing.
inline ReferenceCase reference_case(const std::string& name) {
  std::ifstream in(source_path("tests/reference/lesson02_reference.json"));
  const nlohmann::json c = nlohmann::json::parse(in).at("cases").at(name);
  const auto& j = c.at("config");
  ReferenceCase r;
  r.model.vocab = j.at("vocab");
  r.model.ctx = j.at("ctx");
  r.model.hidden = j.at("hidden");
  r.model.layers = j.at("layers");
  r.model.heads = j.at("heads");
  r.model.tied = j.at("tied");
  r.seed = j.at("seed");
  r.batch = j.at("batch");
  r.adamw.lr = j.at("lr");
  r.adamw.beta1 = j.at("betas")[0];
  r.adamw.beta2 = j.at("betas")[1];
  r.adamw.eps = j.at("eps");
  r.adamw.weight_decay = j.at("weight_decay");
  r.losses = c.at("losses").get<std::vector<float>>();
  return r;
}

}  // namespace dtc::test

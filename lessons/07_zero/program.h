// Lesson 07's program, and the given pieces around your ZeRO engine: the ledger's prediction per
// stage (ZeRO paper, Fig. 1, in lesson 01's fp32 + AdamW terms), the communication theory, and
// the single-process baseline that every stage is checked against.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <iosfwd>
#include <vector>

#include "zero.h"

namespace dtc::l07 {

/// Bytes per rank that lesson 01's ledger predicts for fp32 + AdamW at a ZeRO stage (Rajbhandari
/// et al. 2020, Fig. 1, with 4 + 4 + 8 bytes per parameter instead of mixed precision's 2 + 2 +
/// 12): stage 0 (DDP) 4Psi + 4Psi + 8Psi; stage 1 4Psi + 4Psi + 8Psi/W; stage 2
/// 4Psi + 4Psi/W + 8Psi/W; stage 3 4Psi/W + 4Psi/W + 8Psi/W.
struct StagePrediction {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
StagePrediction predict_stage_memory(int64_t psi, int stage, int world);

/// Bytes one rank sends per step by the ZeRO paper's count (section 7; ring algorithms):
/// 2 (W-1)/W * 4 Psi for DDP and stages 1-2, 3 (W-1)/W * 4 Psi for stage 3, and 2 again for
/// stage 3 without @p reshard_after_forward (each unit gathered once).
double predict_stage_comm(int64_t psi, int stage, int world, bool reshard_after_forward = true);

/// The single-process reference: the course's GPT trained with torch::optim::AdamW on the full
/// global batch (lesson 02's training step, written out here in full), with
/// torch::nn::utils::clip_grad_norm_ to @p clip_norm before each step when it is > 0.
struct Baseline {
  Gpt model;
  std::vector<float> losses;
};
Baseline train_baseline(const GptConfig& model, uint64_t seed, int64_t batch, int64_t steps,
                        const AdamWOptions& adamw, double clip_norm = 0);

/// Runs `lesson07` with @p argv (under torchrun for several ranks).
/// @return the exit code: 0, 2 for bad input, 3 while a TODO(L07) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace dtc::l07

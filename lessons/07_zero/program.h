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

/// Bytes per rank that lesson 01's ledger predicts at a ZeRO stage (Rajbhandari et al. 2020,
/// sec. 5 and Fig. 1), for @p psi parameters over @p world ranks.
/// fp32 + AdamW (4 + 4 + 8 bytes per parameter): stage 0 (DDP) 4Psi + 4Psi + 8Psi; stage 1
/// 4Psi + 4Psi + 8Psi/W; stage 2 4Psi + 4Psi/W + 8Psi/W; stage 3 4Psi/W + 4Psi/W + 8Psi/W.
/// bf16, the paper's own 2 + 2 + 12 (K = 12: the fp32 master weights 4 and the moments 8):
/// stage 0 16Psi; stage 1 2Psi + 2Psi + 12Psi/W; stage 2 2Psi + 2Psi/W + 12Psi/W; stage 3
/// (2 + 2 + 12)Psi/W. The gradients are in @p reduce: with fp32, stage 0 holds 18Psi and stage 1
/// 2Psi + 4Psi + 12Psi/W (Megatron's distributed optimizer), stage 2's shard 4Psi/W.
struct StagePrediction {
  double params = 0, grads = 0, master = 0, optimizer = 0;  ///< master: 0 in fp32
  double total() const { return params + grads + master + optimizer; }
};
StagePrediction predict_stage_memory(int64_t psi, int stage, int world,
                                     Precision precision = Precision::kFp32,
                                     Precision reduce = Precision::kFp32);

/// Bytes one rank sends per step by the ZeRO paper's count (section 7; ring algorithms), with e
/// the working dtype's bytes (4 fp32, 2 bf16) and e_r the reduce dtype's: 2 (W-1)/W * e_r Psi
/// for DDP's allreduce, (W-1)/W * (e_r + e) Psi for stages 1 and 2 (a reduce-scatter in e_r, an
/// all-gather in e), (W-1)/W * (e_r + 2e) Psi for stage 3, and (e_r + e) Psi without
/// @p reshard_after_forward (each unit gathered once).
double predict_stage_comm(int64_t psi, int stage, int world, bool reshard_after_forward = true,
                          Precision precision = Precision::kFp32,
                          Precision reduce = Precision::kFp32);

/// The single-process reference: the course's GPT trained with torch::optim::AdamW on the full
/// global batch (lesson 02's training step, written out here in full), with
/// torch::nn::utils::clip_grad_norm_ to @p clip_norm before each step when it is > 0. In bf16,
/// the scheme of lesson 02's part 5: a bf16 model, AdamW over fp32 master weights from the bf16
/// gradients cast to fp32, the model the master weights rounded after each step
/// (dtc::MasterAdamW, clipping the fp32 gradients); Baseline::model then holds the master weights
/// (fp32), the weights the engine's full_parameters() returns.
struct Baseline {
  Gpt model;
  std::vector<float> losses;
};
Baseline train_baseline(const GptConfig& model, uint64_t seed, int64_t batch, int64_t steps,
                        const AdamWOptions& adamw, double clip_norm = 0,
                        Precision precision = Precision::kFp32);

/// Runs `lesson07` with @p argv (under torchrun for several ranks).
/// @return the exit code: 0, 2 for bad input, 3 while a TODO(L07) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l07

// Lesson 01: the training memory ledger. Implements lessons/01_memory_ledger/ledger.h.
//
// Fill in every TODO(L01) below, top to bottom; `make test-lesson01` checks each function
// against published numbers (ZeRO, Korthikanti et al., the LLaMA paper) as you go.
// The model presets and the checks of a model and a set-up are given, in ledger_given.cpp.
#include "ledger.h"

#include <fmt/format.h>

#include <stdexcept>

#include "dtc/todo.h"

namespace dtc::l01 {

// ---------------------------------------------------------------------------------------------
// The ledger (your part)
// ---------------------------------------------------------------------------------------------

int64_t count_params(const ModelConfig& m) {
  // TODO(L01)
  DTC_TODO("L01",
           "return the exact count of section 4's table, every weight, bias and norm "
           "vector (llama-7b: 6,738,415,616; gpt2: 124,439,808), each of the moe_layers() blocks "
           "holding all E routed experts, the shared ones and an h x E router instead of its MLP "
           "(mixtral-8x7b: 46,702,792,704). Tests: L01Params.*, L01Moe.*; hints: README section "
           "8");
}

int64_t active_params(const ModelConfig& m) {
  // TODO(L01)
  DTC_TODO("L01",
           "return count_params(m) less the E - k routed experts that each MoE block "
           "skips for a token (expert_params() each); the router and the shared experts are "
           "active, "
           "and a dense model's parameters all are (mixtral-8x7b: 12,879,925,248). Tests: "
           "L01Moe.*");
}

BytesPerParam bytes_per_param(Precision precision, Optimizer optimizer, bool fp32_grad_accum) {
  // TODO(L01)
  DTC_TODO("L01",
           "return section 2's table, with the fp32 master copy filed under optimizer "
           "states (mixed + Adam: 2 + 2 + 12 = 16; with fp32_grad_accum, 20; mixed with fp32 "
           "gradients, 18). Tests: L01Bytes.*; hints: README section 8");
}

StateBytes zero_state_bytes(double params, const BytesPerParam& per_param, int zero_stage,
                            int64_t dp) {
  // TODO(L01)
  DTC_TODO("L01",
           "return each state's bytes for params parameters, divided evenly by dp in "
           "every stage that shards it (ZeRO Figure 1: 7.5B over 64 ranks -> 120, 31.4, 16.6, "
           "1.9 GB). "
           "Tests: L01Zero.*; hints: README section 8");
}

double activation_bytes_per_layer(const ModelConfig& m, const TrainingSetup& setup) {
  // TODO(L01)
  DTC_TODO("L01",
           "return the bytes of section 5's stored tensors for this block and set-up; "
           "a GPT block with F = 4h must give every row of Korthikanti's Table 2 (sbh(34 + "
           "5as/h) "
           "unsplit). Tests: L01Activations.*; hints: README section 8");
}

Ledger compute_ledger(int64_t params, const TrainingSetup& setup, const ModelConfig* model) {
  Ledger out;
  out.params = params;
  // TODO(L01)
  DTC_TODO("L01",
           "fill the rest of out as Ledger documents it: one device's share of a "
           "replica split by tp * pp (whole blocks and the embedding on the first stage when the "
           "model "
           "is known), with E/ep of each MoE block's routed experts (expert_params; the shared "
           "ones "
           "stay whole), its states sharded by ZeRO (the experts' over dp/ep, the rest over dp), "
           "and "
           "the first stage's activations under 1F1B. Tests: L01Ledger.*, L01Moe.*; hints: "
           "README "
           "section 8");
  return out;
}

double train_time_seconds(double params, double tokens, double peak_flops, double mfu,
                          int64_t gpus) {
  if (params <= 0 || tokens <= 0 || peak_flops <= 0 || mfu <= 0 || mfu > 1 || gpus <= 0) {
    throw std::invalid_argument(fmt::format(
        "train_time_seconds: need params, tokens, peak_flops, gpus > 0 and 0 < mfu <= 1 (got "
        "{:g}, {:g}, {:g}, {}, {:g})",
        params, tokens, peak_flops, gpus, mfu));
  }
  // TODO(L01)
  DTC_TODO("L01",
           "return the seconds that 6 N D FLOPs take at mfu of every GPU's peak "
           "(llama2-70b, 1e12 tokens, 1024 GPUs at 40% of 989 TFLOP/s: 11.8 days). Tests: "
           "L01Time.*");
}

}  // namespace dtc::l01
// generated from solutions/01_memory_ledger/ledger.cpp; checksum f8fbd803b0c1ae6d

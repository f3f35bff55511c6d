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
  // BEGIN SOLUTION: return the exact count of section 4's table, every weight, bias and norm
  //   vector (llama-7b: 6,738,415,616; gpt2: 124,439,808), each of the moe_layers() blocks
  //   holding all E routed experts, the shared ones and an h x E router instead of its MLP
  //   (mixtral-8x7b: 46,702,792,704). Tests: L01Params.*, L01Moe.*; hints: README section 8
  const int64_t h = m.hidden;
  const int64_t kv = m.kv_dim();
  // Q and output: h x h; K and V: h x kv (latent attention has its own shapes, counted for you)
  const int64_t attention = m.attention_kind == AttentionKind::kLatent ? latent_attention_params(m)
                                                                       : 2 * h * h + 2 * h * kv;
  // An MoE block's MLP: every routed expert and the shared ones, and the router (h x E, no bias)
  const int64_t moe = (m.experts + m.shared_experts) * expert_params(m) + h * m.experts;
  if (m.arch == Arch::kLlama) {
    const int64_t mlp = 3 * h * m.ffn;  // SwiGLU: gate, up (h x F) and down (F x h)
    const int64_t norms = 2 * h;        // two RMSNorms, one weight vector each
    const int64_t block = attention + mlp + norms;
    return m.layers * block + m.moe_layers() * (moe - mlp) +  // the MoE blocks' MLPs swapped
           2 * m.vocab * h + h;  // untied embedding and head, final norm
  }
  const int64_t attention_bias = h + 2 * kv + h;  // Q, K, V and output biases
  const int64_t mlp = 2 * h * m.ffn + m.ffn + h;  // two matrices and their biases
  const int64_t norms = 2 * 2 * h;                // two LayerNorms: weight and bias
  const int64_t block = attention + attention_bias + mlp + norms;
  return m.layers * block + m.moe_layers() * (moe - mlp) +  // the MoE blocks' MLPs swapped
         m.vocab * h + m.ctx * h + 2 * h;                   // tied embedding, positions, norm
  // END SOLUTION
}

int64_t active_params(const ModelConfig& m) {
  // BEGIN SOLUTION: return count_params(m) less the E - k routed experts that each MoE block
  //   skips for a token (expert_params() each); the router and the shared experts are active,
  //   and a dense model's parameters all are (mixtral-8x7b: 12,879,925,248). Tests: L01Moe.*
  return count_params(m) - m.moe_layers() * (m.experts - m.top_k) * expert_params(m);
  // END SOLUTION
}

BytesPerParam bytes_per_param(Precision precision, Optimizer optimizer, bool fp32_grad_accum) {
  // BEGIN SOLUTION: return section 2's table, with the fp32 master copy filed under optimizer
  //   states (mixed + Adam: 2 + 2 + 12 = 16; with fp32_grad_accum, 20; mixed with fp32
  //   gradients, 18). Tests: L01Bytes.*; hints: README section 8
  double states = 0;  // the optimizer's own buffers
  switch (optimizer) {
    case Optimizer::kSgd: states = 0; break;
    case Optimizer::kMomentum: states = 4; break;  // one fp32 momentum buffer
    case Optimizer::kAdam: states = 8; break;      // fp32 first and second moments
    case Optimizer::kAdam8bit: states = 2; break;  // two 1-byte moments
  }
  BytesPerParam b;
  if (precision == Precision::kFp32) {
    b.params = 4;
    b.grads = 4;
    b.optimizer = states;
  } else {
    b.params = 2;
    if (precision == Precision::kMixedFp32Grads) {
      b.grads = 4;  // the gradients live in fp32 only
    } else {
      b.grads = fp32_grad_accum ? 2 + 4 : 2;
    }
    b.optimizer = 4 + states;  // the fp32 master copy that the optimizer updates
  }
  return b;
  // END SOLUTION
}

StateBytes zero_state_bytes(double params, const BytesPerParam& per_param, int zero_stage,
                            int64_t dp) {
  // BEGIN SOLUTION: return each state's bytes for params parameters, divided evenly by dp in
  //   every stage that shards it (ZeRO Figure 1: 7.5B over 64 ranks -> 120, 31.4, 16.6, 1.9 GB).
  //   Tests: L01Zero.*; hints: README section 8
  const double n = static_cast<double>(dp);
  StateBytes s;
  s.params = params * per_param.params / (zero_stage >= 3 ? n : 1.0);
  s.grads = params * per_param.grads / (zero_stage >= 2 ? n : 1.0);
  s.optimizer = params * per_param.optimizer / (zero_stage >= 1 ? n : 1.0);
  return s;
  // END SOLUTION
}

double activation_bytes_per_layer(const ModelConfig& m, const TrainingSetup& setup) {
  // BEGIN SOLUTION: return the bytes of section 5's stored tensors for this block and set-up;
  //   a GPT block with F = 4h must give every row of Korthikanti's Table 2 (sbh(34 + 5as/h)
  //   unsplit). Tests: L01Activations.*; hints: README section 8
  const double s = static_cast<double>(setup.seq);
  const double b = static_cast<double>(setup.micro_batch);
  const double h = static_cast<double>(m.hidden);
  const double kv = static_cast<double>(m.kv_dim());
  const double f = static_cast<double>(m.active_ffn());  // MoE: the k + shared experts a token uses
  const double a = static_cast<double>(m.heads);
  const double t = static_cast<double>(setup.tp);
  const double sbh = s * b * h;
  const bool dropout = m.has_dropout();

  // Outside the tensor-parallel regions (replicated over tp, split only by sequence parallelism):
  // the two norms' inputs, the inputs of the QKV and first MLP projections, dropout masks.
  double replicated = 2 * sbh + 2 * sbh + 2 * sbh + 2 * sbh;
  if (dropout) replicated += sbh + sbh;  // after the attention output and after the MLP
  // Inside them (split by tp): Q, K, V, the output projection's input, the MLP's F-wide tensors.
  double split = 2 * sbh + 2 * s * b * kv + 2 * s * b * kv + 2 * sbh;
  split += m.arch == Arch::kLlama ? 3 * 2 * s * b * f   // gate and up outputs, down's input
                                  : 2 * 2 * s * b * f;  // GELU's input, second matmul's input
  // The attention scores (a x s x s per sequence): softmax output; with dropout also its mask
  // (1 byte) and its output.
  double scores = 2 * a * s * s * b;
  if (dropout) scores += a * s * s * b + 2 * a * s * s * b;
  // FlashAttention: none of those; the fp32 logsumexp of each query row, per head.
  if (resolved_attention(m, setup) == Attention::kFlash) scores = 4 * a * s * b;

  switch (setup.recompute) {
    case Recompute::kFull: return 2 * sbh / (setup.sequence_parallel ? t : 1.0);
    case Recompute::kSelective: scores = 0; break;
    case Recompute::kNone: break;
  }
  if (setup.sequence_parallel) return (replicated + split + scores) / t;
  return replicated + (split + scores) / t;
  // END SOLUTION
}

Ledger compute_ledger(int64_t params, const TrainingSetup& setup, const ModelConfig* model) {
  Ledger out;
  out.params = params;
  // BEGIN SOLUTION: fill the rest of out as Ledger documents it: one device's share of a
  //   replica split by tp * pp (whole blocks and the embedding on the first stage when the model
  //   is known), with E/ep of each MoE block's routed experts (expert_params; the shared ones
  //   stay whole), its states sharded by ZeRO (the experts' over dp/ep, the rest over dp), and
  //   the first stage's activations under 1F1B. Tests: L01Ledger.*, L01Moe.*; hints: README
  //   section 8
  const double tp = static_cast<double>(setup.tp);
  out.params_per_replica = static_cast<double>(params) / (tp * static_cast<double>(setup.pp));
  // Whole blocks per stage: the first holds ceil(L / pp) of them and the input embedding.
  const int64_t stage_layers = model ? (model->layers + setup.pp - 1) / setup.pp : 0;
  int64_t moe_blocks = model ? model->moe_layers() : 0;  // the MoE blocks this GPU holds
  if (model != nullptr && setup.pp > 1) {
    ModelConfig one = *model, none = *model;
    one.layers = 1;
    one.first_dense_layers = 0;  // an MoE block, when the model has them: the heavier kind
    none.layers = 0;
    const double block = static_cast<double>(count_params(one) - count_params(none));
    out.params_per_replica = (static_cast<double>(stage_layers) * block +
                              static_cast<double>(first_stage_embedding_params(*model))) /
                             tp;
    if (model->is_moe()) moe_blocks = stage_layers;
  }
  if (model != nullptr && model->is_moe()) {
    // The routed experts of those blocks (tp splits each); this GPU keeps E/ep of them.
    const double routed =
        static_cast<double>(moe_blocks * model->experts * expert_params(*model)) / tp;
    out.expert_params = routed / static_cast<double>(setup.ep);
    out.params_per_replica -= routed - out.expert_params;
  }
  out.per_param = bytes_per_param(setup.precision, setup.optimizer, setup.fp32_grad_accum);
  // ZeRO shards the experts over the dp / ep ranks that hold the same ones, the rest over dp.
  const StateBytes rest = zero_state_bytes(out.params_per_replica - out.expert_params,
                                           out.per_param, setup.zero_stage, setup.dp);
  const StateBytes experts =
      zero_state_bytes(out.expert_params, out.per_param, setup.zero_stage, setup.dp / setup.ep);
  out.state.params = rest.params + experts.params;
  out.state.grads = rest.grads + experts.grads;
  out.state.optimizer = rest.optimizer + experts.optimizer;
  if (model != nullptr) {
    out.per_layer_activation_bytes = activation_bytes_per_layer(*model, setup);
    out.activation_bytes =
        out.per_layer_activation_bytes * static_cast<double>(stage_layers * setup.pp);
  }
  // END SOLUTION
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
  // BEGIN SOLUTION: return the seconds that 6 N D FLOPs take at mfu of every GPU's peak
  //   (llama2-70b, 1e12 tokens, 1024 GPUs at 40% of 989 TFLOP/s: 11.8 days). Tests: L01Time.*
  return 6.0 * params * tokens / (static_cast<double>(gpus) * peak_flops * mfu);
  // END SOLUTION
}

}  // namespace dtc::l01

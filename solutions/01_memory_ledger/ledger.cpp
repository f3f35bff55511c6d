// Lesson 01: the training memory ledger. Implements lessons/01_memory_ledger/ledger.h.
//
// Fill in every TODO(L01) below, top to bottom; `make test-lesson01` checks each function
// against published numbers (ZeRO, Korthikanti et al., the LLaMA paper) as you go.
#include "ledger.h"

#include <fmt/format.h>

#include <stdexcept>

#include "dtc/errors.h"
#include "dtc/todo.h"

namespace dtc::l01 {

// ---------------------------------------------------------------------------------------------
// Presets and validation (given)
// ---------------------------------------------------------------------------------------------

const std::vector<ModelConfig>& presets() {
  // name, arch, hidden, layers, heads, kv_heads, ffn, vocab, ctx
  static const std::vector<ModelConfig> all = {
      // LLaMA 1: Touvron et al. 2023 (arXiv:2302.13971) Table 2; ffn from the released
      // params.json (multiple_of 256: 2/3 * 4h rounded up).
      {"llama-7b", Arch::kLlama, 4096, 32, 32, 32, 11008, 32000, 2048},
      {"llama-13b", Arch::kLlama, 5120, 40, 40, 40, 13824, 32000, 2048},
      {"llama-33b", Arch::kLlama, 6656, 60, 52, 52, 17920, 32000, 2048},
      {"llama-65b", Arch::kLlama, 8192, 80, 64, 64, 22016, 32000, 2048},
      // Llama 2: Touvron et al. 2023 (arXiv:2307.09288); 70B uses grouped-query attention.
      {"llama2-70b", Arch::kLlama, 8192, 80, 64, 8, 28672, 32000, 4096},
      // Llama 3: Dubey et al. 2024 (arXiv:2407.21783) Table 3; vocabulary 128,256 tokens.
      {"llama3-8b", Arch::kLlama, 4096, 32, 32, 8, 14336, 128256, 8192},
      {"llama3-70b", Arch::kLlama, 8192, 80, 64, 8, 28672, 128256, 8192},
      {"llama3-405b", Arch::kLlama, 16384, 126, 128, 8, 53248, 128256, 8192},
      // GPT-2: Radford et al. 2019, with the released configs (n_embd, n_layer, n_head).
      {"gpt2", Arch::kGpt, 768, 12, 12, 12, 3072, 50257, 1024},
      {"gpt2-medium", Arch::kGpt, 1024, 24, 16, 16, 4096, 50257, 1024},
      {"gpt2-large", Arch::kGpt, 1280, 36, 20, 20, 5120, 50257, 1024},
      {"gpt2-xl", Arch::kGpt, 1600, 48, 25, 25, 6400, 50257, 1024},
      // GPT-3 175B: Brown et al. 2020 (arXiv:2005.14165) Table 2.1; GPT-2's tokenizer.
      {"gpt3-175b", Arch::kGpt, 12288, 96, 96, 96, 49152, 50257, 2048},
  };
  return all;
}

ModelConfig preset(const std::string& name) {
  return find_by_name(presets(), name, "--model", "model",
                      "or describe the model with --arch --hidden --layers --heads --ffn "
                      "--vocab; or give a parameter count with --params");
}

namespace {

void require_positive(int64_t value, const char* flag, const char* what) {
  if (value <= 0) {
    throw UsageError(flag, fmt::format("{} is {}, but must be at least 1", what, value),
                     fmt::format("pass a positive {}, e.g. {} 4096", what, flag));
  }
}

}  // namespace

void validate(const ModelConfig& m) {
  require_positive(m.hidden, "--hidden", "the hidden size");
  require_positive(m.layers, "--layers", "the number of layers");
  require_positive(m.heads, "--heads", "the number of attention heads");
  require_positive(m.kv_heads, "--kv-heads", "the number of key/value heads");
  require_positive(m.ffn, "--ffn", "the MLP width");
  require_positive(m.vocab, "--vocab", "the vocabulary size");
  if (m.hidden % m.heads != 0) {
    throw UsageError("--heads",
                     fmt::format("{} heads do not divide the hidden size {}", m.heads, m.hidden),
                     "choose heads so that hidden / heads is a whole head size, e.g. "
                     "--hidden 4096 --heads 32 (head size 128)");
  }
  if (m.kv_heads > m.heads || m.heads % m.kv_heads != 0) {
    throw UsageError(
        "--kv-heads",
        fmt::format("{} key/value heads do not divide the {} query heads", m.kv_heads, m.heads),
        "each group of query heads shares one kv head: pick kv-heads dividing "
        "heads (= heads for plain multi-head attention)");
  }
  if (m.arch == Arch::kGpt && m.ctx <= 0) {
    throw UsageError("--ctx",
                     "a GPT model needs its context length (it learns one position "
                     "embedding per position)",
                     "pass --ctx, e.g. --ctx 1024");
  }
  if (m.ctx < 0) {
    throw UsageError("--ctx", fmt::format("{} is negative", m.ctx), "pass --ctx 0 or more");
  }
}

int64_t first_stage_embedding_params(const ModelConfig& m) {
  return m.vocab * m.hidden + (m.arch == Arch::kGpt ? m.ctx * m.hidden : 0);
}

Attention resolved_attention(const ModelConfig& model, const TrainingSetup& setup) {
  if (setup.attention != Attention::kAuto) return setup.attention;
  return model.arch == Arch::kLlama ? Attention::kFlash : Attention::kEager;
}

void validate(const TrainingSetup& s, const ModelConfig* m) {
  require_positive(s.dp, "--dp", "the data-parallel degree");
  require_positive(s.tp, "--tp", "the tensor-parallel degree");
  require_positive(s.pp, "--pp", "the pipeline-parallel degree");
  require_positive(s.seq, "--seq", "the sequence length");
  require_positive(s.micro_batch, "--micro-batch", "the micro-batch size");
  if (s.zero_stage < 0 || s.zero_stage > 3) {
    throw UsageError("--zero", fmt::format("stage {} does not exist", s.zero_stage),
                     "ZeRO has stages 0 (none), 1 (optimizer), 2 (+gradients), "
                     "3 (+parameters): pass --zero 0..3");
  }
  if (s.fp32_grad_accum && s.precision != Precision::kMixed) {
    throw UsageError("--fp32-grad-accum", "only applies to mixed precision",
                     "add --precision mixed, or drop --fp32-grad-accum (fp32 gradients are "
                     "already fp32)");
  }
  if (m == nullptr) return;
  const auto divides = [&](int64_t what, const char* name) {
    if (what % s.tp != 0) {
      throw UsageError(
          "--tp",
          fmt::format("tensor parallelism over {} GPUs does not divide the {} {}", s.tp, what,
                      name),
          fmt::format("each GPU takes whole {}: use a --tp that divides {}", name, what));
    }
  };
  divides(m->heads, "attention heads");
  divides(m->kv_heads, "key/value heads");
  divides(m->ffn, "MLP columns");
  if (s.pp > m->layers) {
    throw UsageError(
        "--pp",
        fmt::format("{} pipeline stages for {} layers: some stage would be empty", s.pp, m->layers),
        fmt::format("use --pp {} or fewer", m->layers));
  }
}

// ---------------------------------------------------------------------------------------------
// The ledger (your part)
// ---------------------------------------------------------------------------------------------

int64_t count_params(const ModelConfig& m) {
  // BEGIN SOLUTION: return the exact count of section 4's table, every weight, bias and norm
  //   vector (llama-7b: 6,738,415,616; gpt2: 124,439,808). Tests: L01Params.*; hints: README
  //   section 8
  const int64_t h = m.hidden;
  const int64_t kv = m.kv_dim();
  const int64_t attention = 2 * h * h + 2 * h * kv;  // Q and output: h x h; K and V: h x kv
  if (m.arch == Arch::kLlama) {
    const int64_t mlp = 3 * h * m.ffn;  // SwiGLU: gate, up (h x F) and down (F x h)
    const int64_t norms = 2 * h;        // two RMSNorms, one weight vector each
    const int64_t block = attention + mlp + norms;
    return m.layers * block + 2 * m.vocab * h + h;  // untied embedding and head, final norm
  }
  const int64_t attention_bias = h + 2 * kv + h;  // Q, K, V and output biases
  const int64_t mlp = 2 * h * m.ffn + m.ffn + h;  // two matrices and their biases
  const int64_t norms = 2 * 2 * h;                // two LayerNorms: weight and bias
  const int64_t block = attention + attention_bias + mlp + norms;
  return m.layers * block + m.vocab * h + m.ctx * h + 2 * h;  // tied embedding, positions, norm
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
  const double f = static_cast<double>(m.ffn);
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
  //   is known), its states sharded by ZeRO, and the first stage's activations under 1F1B.
  //   Tests: L01Ledger.*; hints: README section 8
  const double tp = static_cast<double>(setup.tp);
  out.params_per_replica = static_cast<double>(params) / (tp * static_cast<double>(setup.pp));
  // Whole blocks per stage: the first holds ceil(L / pp) of them and the input embedding.
  const int64_t stage_layers = model ? (model->layers + setup.pp - 1) / setup.pp : 0;
  if (model != nullptr && setup.pp > 1) {
    ModelConfig one = *model, none = *model;
    one.layers = 1;
    none.layers = 0;
    const double block = static_cast<double>(count_params(one) - count_params(none));
    out.params_per_replica = (static_cast<double>(stage_layers) * block +
                              static_cast<double>(first_stage_embedding_params(*model))) /
                             tp;
  }
  out.per_param = bytes_per_param(setup.precision, setup.optimizer, setup.fp32_grad_accum);
  out.state = zero_state_bytes(out.params_per_replica, out.per_param, setup.zero_stage, setup.dp);
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

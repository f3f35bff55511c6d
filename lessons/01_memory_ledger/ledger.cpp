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
  // TODO(L01)
  DTC_TODO("L01",
           "return the exact count of section 4's table, every weight, bias and norm "
           "vector (llama-7b: 6,738,415,616; gpt2: 124,439,808). Tests: L01Params.*; hints: "
           "README "
           "section 8");
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
           "is known), its states sharded by ZeRO, and the first stage's activations under 1F1B. "
           "Tests: L01Ledger.*; hints: README section 8");
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
// generated from solutions/01_memory_ledger/ledger.cpp; checksum db59f058ec376e2c

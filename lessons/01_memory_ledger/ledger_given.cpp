// Lesson 01 (given): the model presets and the checks of a model and a set-up. Your part, the
// ledger, is in ledger.cpp; both implement ledger.h.
#include <fmt/format.h>

#include <stdexcept>

#include "dtc/errors.h"
#include "ledger.h"

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
      // The course's own GPT (dtc::GptConfig's defaults, lesson 02's model): 834,304 parameters.
      {"course-gpt", Arch::kGpt, 128, 4, 4, 4, 512, 256, 64},
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

}  // namespace dtc::l01

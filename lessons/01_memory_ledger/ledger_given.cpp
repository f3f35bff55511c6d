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
      // Mixtures of experts; after ctx: experts, top_k, shared_experts, moe_ffn,
      // first_dense_layers.
      // Mixtral 8x7B: Jiang et al. 2024 (arXiv:2401.04088) Table 1, and the released config
      // (mistralai/Mixtral-8x7B-v0.1 config.json: num_local_experts 8, num_experts_per_tok 2,
      // max_position_embeddings 32768, untied embeddings); every block is an MoE block.
      {"mixtral-8x7b", Arch::kLlama, 4096, 32, 32, 8, 14336, 32000, 32768, 8, 2, 0, 14336, 0},
      // DeepSeek-V3: DeepSeek-AI 2024 (arXiv:2412.19437) sec. 4.2, and the released config
      // (deepseek-ai/DeepSeek-V3 config.json: intermediate_size 18432 for the first_k_dense_replace
      // 3 dense blocks, moe_intermediate_size 2048, n_routed_experts 256, n_shared_experts 1,
      // num_experts_per_tok 8, untied embeddings); 4K-token pre-training sequences. Multi-head
      // latent attention: q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
      // qk_rope_head_dim 64, v_head_dim 128. Its multi-token-prediction module (14B, not in the
      // 671B) is left out, and so are the routers' per-expert bias terms (256 a block, set by
      // DeepSeek's balancing rule, not by the optimizer).
      {"deepseek-v3",
       Arch::kLlama,
       7168,
       61,
       128,
       128,
       18432,
       129280,
       4096,
       256,
       8,
       1,
       2048,
       3,
       AttentionKind::kLatent,
       1536,
       512,
       128,
       64,
       128},
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
  if (m.experts < 0) {
    throw UsageError("--experts", fmt::format("{} experts", m.experts),
                     "pass the routed experts of a mixture of experts, e.g. --experts 8, or "
                     "leave it out for a dense model");
  }
  if (!m.is_moe() &&
      (m.top_k != 0 || m.shared_experts != 0 || m.moe_ffn != 0 || m.first_dense_layers != 0)) {
    throw UsageError("--experts",
                     "--top-k, --shared-experts, --moe-ffn and --first-dense-layers describe "
                     "a mixture of experts, but the model has fewer than 2 routed experts",
                     "add --experts E (E >= 2), or drop those flags for a dense model");
  }
  if (m.is_moe()) {
    if (m.top_k < 1 || m.top_k > m.experts) {
      throw UsageError("--top-k",
                       fmt::format("each token goes to {} of {} experts", m.top_k, m.experts),
                       fmt::format("pass --top-k between 1 and {}, e.g. --top-k 2", m.experts));
    }
    if (m.shared_experts < 0) {
      throw UsageError("--shared-experts", fmt::format("{} is negative", m.shared_experts),
                       "pass --shared-experts 0 or more");
    }
    if (m.moe_ffn < 0) {
      throw UsageError("--moe-ffn", fmt::format("{} is negative", m.moe_ffn),
                       "pass an expert's MLP width, or 0 for --ffn's");
    }
    if (m.first_dense_layers < 0 || m.first_dense_layers > m.layers) {
      throw UsageError("--first-dense-layers",
                       fmt::format("{} dense blocks of {}", m.first_dense_layers, m.layers),
                       fmt::format("pass 0 to {}", m.layers));
    }
  }
  if (m.attention_kind == AttentionKind::kLatent &&
      (m.q_lora_rank <= 0 || m.kv_lora_rank <= 0 || m.qk_nope_head_dim <= 0 ||
       m.qk_rope_head_dim <= 0 || m.v_head_dim <= 0)) {
    throw UsageError("--model", "latent attention needs positive latent and head widths",
                     "set q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and "
                     "v_head_dim, as a published config.json gives them");
  }
}

int64_t expert_params(const ModelConfig& m) {
  const int64_t h = m.hidden;
  const int64_t f = m.expert_ffn();
  return m.arch == Arch::kLlama ? 3 * h * f : 2 * h * f + f + h;
}

int64_t latent_attention_params(const ModelConfig& m) {
  const int64_t h = m.hidden, a = m.heads;
  const int64_t q = h * m.q_lora_rank + m.q_lora_rank +                             // q_a, its norm
                    m.q_lora_rank * a * (m.qk_nope_head_dim + m.qk_rope_head_dim);  // q_b
  const int64_t kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank +   // kv_a, norm
                     m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim);      // kv_b
  return q + kv + a * m.v_head_dim * h;                                             // o_proj
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
  require_positive(s.ep, "--ep", "the expert-parallel degree");
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
  if (s.ep > 1) {
    if (m == nullptr || !m->is_moe()) {
      throw UsageError("--ep",
                       fmt::format("expert parallelism over {} GPUs needs a mixture of experts, "
                                   "but {} has no routed experts",
                                   s.ep, m ? m->name : "a bare parameter count"),
                       "give an MoE model (e.g. --model mixtral-8x7b), or drop --ep");
    }
    if (m->experts % s.ep != 0) {
      throw UsageError("--ep",
                       fmt::format("{} GPUs cannot share {} experts evenly", s.ep, m->experts),
                       fmt::format("each GPU holds E/ep whole experts: use an --ep that divides {}",
                                   m->experts));
    }
    if (s.dp % s.ep != 0) {
      throw UsageError("--ep",
                       fmt::format("expert parallelism over {} GPUs does not divide the {} "
                                   "data-parallel ranks it folds over",
                                   s.ep, s.dp),
                       fmt::format("the ep ranks are dp ranks (ep adds no GPUs): use a --dp that "
                                   "is a multiple of {}, or an --ep that divides {}",
                                   s.ep, s.dp));
    }
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
  if (m->is_moe()) divides(m->expert_ffn(), "expert MLP columns");  // tp splits each expert too
  if (s.pp > m->layers) {
    throw UsageError(
        "--pp",
        fmt::format("{} pipeline stages for {} layers: some stage would be empty", s.pp, m->layers),
        fmt::format("use --pp {} or fewer", m->layers));
  }
}

}  // namespace dtc::l01

// The course's GPT (see dtc/model.h for the architecture and the initialisation formula).
#include "dtc/model.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "dtc/compat.h"
#include "dtc/errors.h"
#include "dtc/trace.h"

namespace dtc {

void validate(const GptConfig& c) {
  const std::pair<int64_t, const char*> sizes[] = {{c.vocab, "--vocab"},
                                                   {c.ctx, "--seq"},
                                                   {c.hidden, "--hidden"},
                                                   {c.layers, "--layers"},
                                                   {c.heads, "--heads"}};
  for (const auto& [value, flag] : sizes) {
    if (value < 1) {
      throw UsageError(flag, fmt::format("is {}, but must be at least 1", value),
                       fmt::format("pass a positive size, e.g. {} 4", flag));
    }
  }
  if (c.hidden % c.heads != 0) {
    throw UsageError("--heads",
                     fmt::format("{} heads do not divide the hidden size {}", c.heads, c.hidden),
                     "choose heads so that hidden / heads is a whole head size, e.g. "
                     "--hidden 128 --heads 4");
  }
}

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp32: break;
  }
  return "fp32";
}

torch::ScalarType working_dtype(Precision precision) {
  switch (precision) {
    case Precision::kBf16: return torch::kBFloat16;
    case Precision::kFp16: return torch::kHalf;
    case Precision::kFp32: break;
  }
  return torch::kFloat;
}

const char* recompute_name(Recompute recompute) {
  switch (recompute) {
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
    case Recompute::kNone: break;
  }
  return "none";
}

torch::optim::AdamWOptions adamw_options(const RunConfig& config) {
  return torch::optim::AdamWOptions(config.lr)
      .betas({config.beta1, config.beta2})
      .eps(config.eps)
      .weight_decay(config.weight_decay);
}

void check_precision(Precision precision, bool bf16_collectives) {
  if (precision == Precision::kFp16) {
    throw UsageError("--precision", "this lesson trains in fp32 or bf16",
                     "fp16 needs lesson 02's loss scaler: pass --precision bf16");
  }
  if (precision != Precision::kFp32 && bf16_collectives && !kGlooBf16) {
    throw UsageError("--precision",
                     "LibTorch 1.13's gloo has no bf16 collectives (\"Invalid scalar type\")",
                     "train bf16 on LibTorch 2.x (the primary path), or pass --precision fp32");
  }
}

MasterAdamW::MasterAdamW(torch::nn::Module& module, Precision precision,
                         const torch::optim::AdamWOptions& options)
    : MasterAdamW(module.parameters(), precision, options) {}

MasterAdamW::MasterAdamW(const std::vector<torch::Tensor>& params, Precision precision,
                         const torch::optim::AdamWOptions& options)
    : precision_(precision), params_(params) {
  if (precision == Precision::kFp16) {
    throw std::invalid_argument(
        "MasterAdamW: fp16 needs a loss scaler (lesson 02, part 5); train bf16 or fp32");
  }
  if (precision != Precision::kFp32) {
    torch::NoGradGuard no_grad;
    for (auto& p : params_) {
      master_.push_back(p.detach().to(torch::kFloat, false, true));
      p.set_data(p.detach().to(working_dtype(precision)));
    }
  }
  optimizer_ = std::make_unique<torch::optim::AdamW>(master_.empty() ? params_ : master_, options);
}

void MasterAdamW::zero_grad() {
  for (auto& p : params_) p.mutable_grad().reset();
}

torch::Tensor TracedAdamW::step(LossClosure closure) {
  TraceSpan span("optimizer");
  return torch::optim::AdamW::step(std::move(closure));
}

void MasterAdamW::step(double clip_norm) {
  TraceSpan span("optimizer");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < master_.size(); ++i) {
    const torch::Tensor& g = params_[i].grad();
    if (g.defined()) {
      master_[i].mutable_grad() = g.to(torch::kFloat);
    } else {
      master_[i].mutable_grad().reset();
    }
  }
  if (clip_norm > 0) torch::nn::utils::clip_grad_norm_(master(), clip_norm);
  optimizer_->step();
  for (size_t i = 0; i < master_.size(); ++i) {
    params_[i].copy_(master_[i]);       // rounded to the working dtype
    master_[i].mutable_grad().reset();  // the fp32 copies of the gradients go
  }
}

// ---------------------------------------------------------------------------------------------
// Modules
// ---------------------------------------------------------------------------------------------

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& c) : heads_(c.heads) {
  c_attn = register_module("c_attn", torch::nn::Linear(c.hidden, 3 * c.hidden));
  c_proj = register_module("c_proj", torch::nn::Linear(c.hidden, c.hidden));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), D = C / heads_;
  // (B, T, 3C) -> q, k, v each (B, T, C) -> (B, heads, T, D)
  auto qkv = c_attn(x).split(C, /*dim=*/2);
  auto q = qkv[0].view({B, T, heads_, D}).transpose(1, 2);
  auto k = qkv[1].view({B, T, heads_, D}).transpose(1, 2);
  auto v = qkv[2].view({B, T, heads_, D}).transpose(1, 2);
  const AttentionCore run = swapped_core ? swapped_core : AttentionCore(&core);
  auto y =
      checkpoint
          ? checkpoint(
                [run](const std::vector<torch::Tensor>& in) { return run(in[0], in[1], in[2]); },
                {q, k, v})
          : run(q, k, v);
  return c_proj(y);
}

torch::Tensor CausalSelfAttentionImpl::core(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  // scores (B, heads, T, T); position t attends to positions <= t only
  auto att = q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
  auto future = torch::ones({T, T}, torch::dtype(torch::kBool).device(q.device())).triu(1);
  att = att.masked_fill(future, -std::numeric_limits<float>::infinity()).softmax(-1);
  // (B, heads, T, D) -> (B, T, C)
  return att.matmul(v).transpose(1, 2).contiguous().view({B, T, H * D});
}

MlpImpl::MlpImpl(const GptConfig& c) {
  c_fc = register_module("c_fc", torch::nn::Linear(c.hidden, c.ffn()));
  c_proj = register_module("c_proj", torch::nn::Linear(c.ffn(), c.hidden));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return c_proj(torch::gelu(c_fc(x)));  // exact (erf) GELU
}

BlockImpl::BlockImpl(const GptConfig& c, bool sublayers) {
  const auto ln = torch::nn::LayerNormOptions({c.hidden}).eps(1e-5);
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(ln));
  if (sublayers) attn = register_module("attn", CausalSelfAttention(c));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(ln));
  if (sublayers) mlp = register_module("mlp", Mlp(c));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  TraceSpan span("fwd block", index);
  torch::Tensor y =
      checkpoint
          ? checkpoint([this](const std::vector<torch::Tensor>& in) { return forward_body(in[0]); },
                       {x})
          : forward_body(x);
  trace_backward(x, y, "bwd block", index);
  return y;
}

torch::Tensor BlockImpl::forward_body(torch::Tensor x) {
  TORCH_CHECK((attn || !attn_part_.is_empty()) && (mlp || !mlp_part_.is_empty()), "block ", index,
              " was built without sublayers and has not had both swapped in");
  x = x + (attn ? attn(ln_1(x)) : attn_part_.forward(ln_1(x)));
  return x + (mlp ? mlp(ln_2(x)) : mlp_part_.forward(ln_2(x)));
}

torch::Tensor forward_blocks(const torch::nn::ModuleListImpl& blocks, torch::Tensor x) {
  for (const auto& module : blocks) {
    auto* block = module->as<BlockImpl>();
    TORCH_CHECK(block != nullptr, "forward_blocks: a module that is not a dtc::Block");
    x = block->forward(x);
  }
  return x;
}

GptImpl::GptImpl(const GptConfig& c) : config_(c) {
  validate(c);
  wte = register_module("wte", torch::nn::Embedding(c.vocab, c.hidden));
  wpe = register_module("wpe", torch::nn::Embedding(c.ctx, c.hidden));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) {
    Block block(c);
    block->index = i;
    h->push_back(block);
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
  if (!c.tied) {
    lm_head = register_module(
        "lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.hidden, c.vocab).bias(false)));
  }
}

torch::Tensor embed_tokens(torch::nn::Embedding wte, torch::nn::Embedding wpe,
                           const torch::Tensor& tokens, const torch::Tensor& positions) {
  const int64_t T = tokens.size(1);
  const int64_t ctx = wpe->weight.size(0);
  TORCH_CHECK(T <= ctx, "sequence of ", T, " tokens is longer than the context ", ctx);
  torch::Tensor pos;
  if (positions.defined()) {
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T, "Gpt: ", T,
                " tokens a sequence, but set_positions gave ", positions.sizes(),
                " positions (one per token)");
    pos = positions.to(tokens.device());
  } else {
    pos = torch::arange(T, torch::dtype(torch::kLong).device(tokens.device()));
  }
  return wte(tokens) + wpe(pos);  // (B, T, h) + (T, h)
}

torch::Tensor head_logits(torch::nn::LayerNorm ln_f, torch::nn::Linear lm_head,
                          const torch::Tensor& wte_weight, const torch::Tensor& x) {
  auto y = ln_f(x);
  // (B, T, h) @ (h, V) -> (B, T, V), in fp32 for the loss (a no-op in fp32)
  return (lm_head ? lm_head(y) : torch::matmul(y, wte_weight.t())).to(torch::kFloat);
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
  auto x = embed_tokens(wte, wpe, tokens, positions_);
  x = forward_blocks(*h, x);
  TraceSpan span("fwd head");
  auto logits =
      head_logits(ln_f, config_.tied ? torch::nn::Linear(nullptr) : lm_head, wte->weight, x);
  trace_backward(x, logits, "bwd head");
  return logits;
}

void GptImpl::set_attention_core(AttentionCore core) {
  for (const auto& module : *h) {
    auto block = module->as<Block>();
    if (block->attn) block->attn->swapped_core = core;
  }
}

void GptImpl::set_recompute(Recompute mode, CheckpointFn checkpoint) {
  TORCH_CHECK(mode == Recompute::kNone || checkpoint, "recompute ", recompute_name(mode),
              " needs a checkpoint function");
  for (const auto& module : *h) {
    auto block = module->as<Block>();
    block->checkpoint = mode == Recompute::kFull ? checkpoint : CheckpointFn();
    TORCH_CHECK(block->attn || mode != Recompute::kSelective,
                "selective recomputation needs the default attention (block ", block->index,
                "'s was swapped)");
    if (block->attn) {
      block->attn->checkpoint = mode == Recompute::kSelective ? checkpoint : CheckpointFn();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Deterministic initialisation
// ---------------------------------------------------------------------------------------------

uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t fnv1a64(const std::string& text) {
  uint64_t hash = 0xCBF29CE484222325ULL;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001B3ULL;
  }
  return hash;
}

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// 0: zeros, 1: ones, otherwise the standard deviation of the uniform draw.
double init_std(const std::string& name, int64_t layers) {
  if (ends_with(name, ".bias")) return 0.0;
  if (name.find("ln_") != std::string::npos) return -1.0;  // LayerNorm weight: ones
  if (ends_with(name, "c_proj.weight")) return 0.02 / std::sqrt(2.0 * static_cast<double>(layers));
  return 0.02;
}

}  // namespace

float init_value(uint64_t seed, const std::string& name, int64_t index, int64_t layers) {
  const double std = init_std(name, layers);
  if (std == 0.0) return 0.0f;
  if (std < 0.0) return 1.0f;
  const uint64_t key = splitmix64(seed ^ fnv1a64(name));
  const double u = static_cast<double>(splitmix64(key + static_cast<uint64_t>(index)) >> 40) *
                   (1.0 / 16777216.0);  // 24 bits: [0, 1)
  return static_cast<float>((2.0 * u - 1.0) * std * std::sqrt(3.0));
}

void init_weights(Gpt& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  const int64_t layers = model->config().layers;
  for (auto& item : model->named_parameters()) {
    auto& p = item.value();
    std::vector<float> values(static_cast<size_t>(p.numel()));
    for (int64_t i = 0; i < p.numel(); ++i) {
      values[static_cast<size_t>(i)] = init_value(seed, item.key(), i, layers);
    }
    auto cpu = torch::from_blob(values.data(), p.sizes(), torch::kFloat32);
    p.copy_(cpu);  // from_blob does not own `values`: copy before it goes
  }
}

Gpt make_gpt(const GptConfig& config, uint64_t seed, const torch::Device& device) {
  Gpt model(config);
  init_weights(model, seed);
  model->to(device);
  return model;
}

torch::Device default_device() {
  const char* env = std::getenv("DTC_DEVICE");
  const std::string want = env ? env : "";
  if (want == "cpu") return torch::kCPU;
  if (want.empty() || want == "cuda") {
    if (torch::cuda::is_available()) return torch::Device(torch::kCUDA, 0);
    if (want == "cuda") {
      throw UsageError("DTC_DEVICE", "is cuda, but no GPU is visible to this LibTorch",
                       "unset DTC_DEVICE (or set it to cpu) on a machine without a GPU");
    }
    return torch::kCPU;
  }
  throw UsageError("DTC_DEVICE", fmt::format("'{}' is not a device", want),
                   "set DTC_DEVICE to cpu or cuda, or unset it");
}

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace dtc

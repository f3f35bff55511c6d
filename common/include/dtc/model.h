// The course's model: a small GPT-style decoder that every training lesson trains (lesson 02's
// single-device baseline, then DDP, ZeRO, tensor and pipeline parallelism on the same weights).
//
//   tokens (B, T) int64
//     -> wte(tokens) + wpe(0..T-1)                          (B, T, h)   learned positions
//     -> L x Block: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))         pre-LayerNorm
//          attn: c_attn (h -> 3h) -> causal softmax(q k^T / sqrt(d)) v per head -> c_proj (h -> h)
//          mlp:  c_fc (h -> 4h) -> GELU (exact, erf) -> c_proj (4h -> h)
//     -> ln_f -> logits = x @ W_out^T                       (B, T, V)
// W_out is wte.weight (tied, GPT-2's choice and the default) or a separate lm_head (untied:
// set GptConfig::tied = false; pipeline parallelism is simpler without the shared matrix).
// Every Linear has a bias; LayerNorm eps is 1e-5; no dropout (training is deterministic).
// Parameters: L(12h^2 + 13h) + Vh + ctx*h + 2h when tied (lesson 01's GPT formula), + Vh untied.
//
// Initial weights are a pure function of (seed, parameter name, element index), written out in
// init_weights() below and in tests/reference/lesson02_reference.py, so PyTorch builds the very
// same model without sharing a file or a random-number generator with LibTorch.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dtc {

/// How training stores weights and runs the forward and backward pass (lesson 02, part 5).
enum class Precision {
  kFp32,  ///< everything in fp32
  kBf16,  ///< bf16 weights, activations (and gradients, unless fp32); fp32 master weights
  kFp16,  ///< as bf16 in fp16, with dynamic loss scaling (fp16's range is too narrow without)
};
/// "fp32", "bf16" or "fp16": the --precision value and the --json "precision".
const char* precision_name(Precision precision);
/// The dtype the model computes in: kFloat, kBFloat16 or kHalf.
torch::ScalarType working_dtype(Precision precision);

/// Activation recomputation (checkpointing), Korthikanti et al. 2022, as lesson 01's ledger
/// models it.
enum class Recompute {
  kNone,       ///< keep every tensor backward needs
  kSelective,  ///< recompute the attention core (scores, softmax, attention over V) in backward
  kFull,       ///< keep each block's input only; recompute the whole block in backward
};
/// "none", "selective" or "full": the --recompute value and the --json "recompute".
const char* recompute_name(Recompute recompute);

/// A piece of the forward pass that a checkpoint may run twice: a pure function of its inputs
/// (and of module parameters it captures).
using CheckpointBody = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;
/// Runs @p body on @p inputs so that backward recomputes it: lesson 02's checkpoint().
using CheckpointFn =
    std::function<torch::Tensor(const CheckpointBody& body, const std::vector<torch::Tensor>&)>;

/// The shape of the course's GPT.
struct GptConfig {
  int64_t vocab = 256;   ///< V: 256 for the byte-level corpus (dtc/data.h)
  int64_t ctx = 64;      ///< the longest sequence; one learned position embedding per position
  int64_t hidden = 128;  ///< h, the model width
  int64_t layers = 4;    ///< L, transformer blocks
  int64_t heads = 4;     ///< a, attention heads; head size h / a
  bool tied = true;      ///< output head shares the token embedding (GPT-2)

  int64_t head_dim() const { return hidden / heads; }
  int64_t ffn() const { return 4 * hidden; }
};

/// Checks a configuration.
/// @throws dtc::UsageError naming the flag (--vocab, --seq, --hidden, --layers, --heads) for a
///   size below 1, or heads that do not divide hidden.
void validate(const GptConfig& config);

/// What decides a training run of the course's GPT: its shape, the global batch, the seed and
/// AdamW's hyperparameters, with lesson 02's defaults (PyTorch's AdamW, lr 3e-3). Lesson 02's
/// TrainConfig, shared by every later training lesson (dtc::TrainOptions::run_config fills it
/// from the common flags).
struct RunConfig {
  GptConfig model;             ///< sequences are model.ctx tokens long
  int64_t batch = 8;           ///< sequences per optimizer step, over all ranks (--global-batch)
  uint64_t seed = 1;           ///< seeds the weights and the batches (--seed)
  double lr = 3e-3;            ///< AdamW learning rate, constant (--lr)
  double beta1 = 0.9;          ///< AdamW first-moment decay
  double beta2 = 0.999;        ///< AdamW second-moment decay
  double eps = 1e-8;           ///< AdamW epsilon
  double weight_decay = 0.01;  ///< AdamW decoupled weight decay (PyTorch's default), on every
                               ///< parameter
  Precision precision = Precision::kFp32;  ///< --precision (lesson 02, part 5)
  bool fp32_grads = false;                 ///< --grad-dtype fp32: fp32 gradients in low precision
  Recompute recompute = Recompute::kNone;  ///< --recompute
};

/// Refuses what the parallel lessons (07-09) do not train: fp16, which needs lesson 02's loss
/// scaler, and, when @p bf16_collectives (bf16 tensors cross gloo), bf16 on LibTorch 1.13,
/// whose gloo has no bf16 collectives. @throws UsageError("--precision") saying which.
void check_precision(Precision precision, bool bf16_collectives);

/// torch::optim::AdamW's options for @p config: lr, betas, eps and weight decay.
torch::optim::AdamWOptions adamw_options(const RunConfig& config);

/// AdamW whose step() is an "optimizer" span on the timeline (--trace, dtc/trace.h); otherwise
/// torch::optim::AdamW itself.
class TracedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// AdamW over fp32 master weights, for the parallel lessons' bf16 runs and their baselines
/// (given: lesson 02's part 5 is where you write one, with a loss scaler and fp32 gradient
/// hooks). In fp32 it is torch::optim::AdamW over @p module's parameters. In bf16 it copies every
/// parameter to fp32 (the master weights: the fp32 initial weights), casts @p module to bf16,
/// and step() runs AdamW on the master weights from the gradients cast to fp32, then rounds each
/// master weight into its parameter.
class MasterAdamW {
 public:
  /// @throws std::invalid_argument for kFp16 (it needs lesson 02's loss scaler)
  MasterAdamW(torch::nn::Module& module, Precision precision,
              const torch::optim::AdamWOptions& options);
  /// The same over @p params, each cast in place (set_data) in bf16, as Module::to() casts.
  MasterAdamW(const std::vector<torch::Tensor>& params, Precision precision,
              const torch::optim::AdamWOptions& options);
  /// Every parameter's gradient to none.
  void zero_grad();
  /// One AdamW step from the gradients backward left (parameters without one are skipped);
  /// with @p clip_norm > 0, torch::nn::utils::clip_grad_norm_ on the fp32 gradients first.
  void step(double clip_norm = 0);
  /// The fp32 weights AdamW updates, in module.parameters() order (fp32: the parameters).
  const std::vector<torch::Tensor>& master() const { return master_.empty() ? params_ : master_; }
  Precision precision() const { return precision_; }
  /// The AdamW over master() (its state: the moments of each master weight).
  torch::optim::AdamW& optimizer() { return *optimizer_; }

 private:
  Precision precision_;
  std::vector<torch::Tensor> params_;  ///< the module's, in the working dtype
  std::vector<torch::Tensor> master_;  ///< bf16: the fp32 copies; fp32: empty
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

/// The attention core: q, k, v (B, heads, T, D) -> y (B, T, heads x D), the heads
/// concatenated. CausalSelfAttentionImpl::core by default; context parallelism (lesson 10) swaps
/// in attention over the whole sequence's keys and values.
using AttentionCore =
    std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;

/// Causal multi-head self-attention: c_attn (h -> 3h), softmax over earlier positions, c_proj.
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GptConfig& config);
  /// x (B, T, h) -> (B, T, h)
  torch::Tensor forward(const torch::Tensor& x);
  /// The attention core, q, k, v (B, heads, T, D) -> y (B, T, h): causal softmax(q k^T /
  /// sqrt(D)) v, the heads concatenated. What selective recomputation runs again.
  static torch::Tensor core(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

  torch::nn::Linear c_attn{nullptr};
  torch::nn::Linear c_proj{nullptr};
  /// Set by GptImpl::set_recompute: when defined, core() runs inside it (selective).
  CheckpointFn checkpoint;
  /// Set by GptImpl::set_attention_core: when defined, forward() calls it instead of core().
  AttentionCore swapped_core;

 private:
  int64_t heads_;
};
TORCH_MODULE(CausalSelfAttention);

/// The MLP: c_fc (h -> 4h), GELU, c_proj (4h -> h).
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const GptConfig& config);
  /// x (B, T, h) -> (B, T, h)
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear c_fc{nullptr};
  torch::nn::Linear c_proj{nullptr};
};
TORCH_MODULE(Mlp);

/// One pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).
///
/// Its two sublayers can be swapped for modules that compute the same function another way
/// (tensor parallelism's split attention and MLP, lesson 08; a mixture of experts in place of the
/// MLP): swap_attention() and swap_mlp() register the new module under the same name, so the
/// parameter names (h.{i}.attn.*, h.{i}.mlp.*) and hence param_digest do not change.
class BlockImpl : public torch::nn::Module {
 public:
  /// The block with its LayerNorms and, when @p sublayers, the default attention and MLP;
  /// without, the two are swapped in afterwards (in that order: their parameters then follow
  /// ln_1 and ln_2), which spares building full-size ones only to replace them.
  explicit BlockImpl(const GptConfig& config, bool sublayers = true);
  /// x (B, T, h) -> (B, T, h); inside `checkpoint` when that is set (full recomputation).
  torch::Tensor forward(torch::Tensor x);
  /// The block's computation itself, never checkpointed.
  torch::Tensor forward_body(torch::Tensor x);

  /// Replaces the attention sublayer by @p module (x (B, T, h) -> (B, T, h)), registered as
  /// "attn". `attn`, the default's typed handle, becomes empty: use the new module's own.
  /// Swap before set_recompute(kSelective) or set_attention_core: the new module does not inherit
  /// what they set on the old one, so swapping after them throws instead of dropping it.
  template <class ModuleType>
  void swap_attention(torch::nn::ModuleHolder<ModuleType> module) {
    TORCH_CHECK(!attn || (!attn->checkpoint && !attn->swapped_core), "block ", index,
                ": swap the attention before set_recompute(kSelective) or set_attention_core; "
                "the new module would silently lose the recomputation or the core they set");
    put_part("attn", module);
    attn_part_ = torch::nn::AnyModule(module);
    attn = nullptr;
  }
  /// Replaces the MLP by @p module (x (B, T, h) -> (B, T, h)), registered as "mlp"; `mlp`
  /// becomes empty.
  template <class ModuleType>
  void swap_mlp(torch::nn::ModuleHolder<ModuleType> module) {
    put_part("mlp", module);
    mlp_part_ = torch::nn::AnyModule(module);
    mlp = nullptr;
  }
  /// The swapped-in attention or MLP as @p ModuleType (TpAttentionImpl, say).
  /// @throws c10::Error when that part is not a @p ModuleType
  template <class ModuleType>
  ModuleType& part(const std::string& name) const {
    auto* m = named_children()[name]->as<ModuleType>();
    TORCH_CHECK(m != nullptr, "block ", index, "'s ", name, " is not the module asked for");
    return *m;
  }

  /// Set by GptImpl::set_recompute: when defined, forward() runs inside it (full).
  CheckpointFn checkpoint;
  /// The block's place in the GPT (h.{index}), for its spans on a trace: "fwd block {index}"
  /// and "bwd block {index}" (dtc/trace.h; nothing happens when tracing is off).
  int64_t index = -1;
  torch::nn::LayerNorm ln_1{nullptr};
  CausalSelfAttention attn{nullptr};  ///< the default attention; empty once swapped
  torch::nn::LayerNorm ln_2{nullptr};
  Mlp mlp{nullptr};  ///< the default MLP; empty once swapped

 private:
  template <class ModuleType>
  void put_part(const std::string& name, torch::nn::ModuleHolder<ModuleType> module) {
    if (named_children().contains(name)) {
      replace_module(name, module);
    } else {
      register_module(name, module);
    }
  }
  torch::nn::AnyModule attn_part_;  ///< the swapped-in attention, if any
  torch::nn::AnyModule mlp_part_;   ///< the swapped-in MLP, if any
};
TORCH_MODULE(Block);

/// Runs @p x through every Block of @p blocks in order (each Block::forward: its trace spans and
/// its recomputation): the one block loop of every model of the course, whatever its blocks hold.
torch::Tensor forward_blocks(const torch::nn::ModuleListImpl& blocks, torch::Tensor x);

/// The model's input, tokens (B, T) int64 -> wte(tokens) + wpe(positions) (B, T, h), in the
/// embeddings' dtype; @p positions (T, int64) undefined: 0, 1, ..., T-1 on the tokens' device.
/// GptImpl::forward's first step, and a pipeline's first stage's (lesson 09).
/// @throws c10::Error when T exceeds the context (wpe's rows) or positions has not T entries.
torch::Tensor embed_tokens(torch::nn::Embedding wte, torch::nn::Embedding wpe,
                           const torch::Tensor& tokens, const torch::Tensor& positions = {});

/// The model's output, x (B, T, h) -> ln_f -> logits (B, T, V), cast to fp32 for the loss (as
/// Megatron-LM does): through @p lm_head, or x @ @p wte_weight^T when lm_head is null (tied).
/// GptImpl::forward's last step, and a pipeline's last stage's (lesson 09).
torch::Tensor head_logits(torch::nn::LayerNorm ln_f, torch::nn::Linear lm_head,
                          const torch::Tensor& wte_weight, const torch::Tensor& x);

/// The GPT. Parameter names (named_parameters(), in this order): wte.weight, wpe.weight,
/// `h.{i}.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}.{weight, bias}`,
/// ln_f.{weight, bias}, and lm_head.weight when untied. (A model whose blocks were built without
/// sublayers and had them swapped in, lesson 08's TpGpt, lists each block's ln_1 and ln_2 first:
/// names are what digests and optimizers match, never positions.)
class GptImpl : public torch::nn::Module {
 public:
  /// Builds the modules; weights are LibTorch's defaults until init_weights().
  /// @throws dtc::UsageError for a bad config (see validate()).
  explicit GptImpl(const GptConfig& config);
  /// tokens (B, T) int64 in [0, V), T <= ctx -> logits (B, T, V) float32. The model computes
  /// in its parameters' dtype (fp32, or bf16/fp16 after to()); the logits are cast to fp32 for
  /// the loss, as Megatron-LM does, so log-softmax runs in fp32.
  torch::Tensor forward(const torch::Tensor& tokens);
  const GptConfig& config() const { return config_; }
  /// Recomputes each block (kFull) or each attention core (kSelective) in backward through
  /// @p checkpoint; kNone (the default) keeps everything. @p checkpoint must be defined unless
  /// @p mode is kNone.
  void set_recompute(Recompute mode, CheckpointFn checkpoint);
  /// Every block's attention computes its core through @p core (an undefined one restores
  /// CausalSelfAttentionImpl::core). Blocks whose attention was swapped are left alone.
  void set_attention_core(AttentionCore core);
  /// The global positions of the tokens forward() gets (T, int64), for a model that sees a part
  /// of each sequence (context parallelism); undefined (the default): 0, 1, ..., T-1.
  void set_positions(torch::Tensor positions) { positions_ = std::move(positions); }
  const torch::Tensor& positions() const { return positions_; }

  torch::nn::Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};  ///< only when !config.tied (no bias)

 private:
  GptConfig config_;
  torch::Tensor positions_;
};
TORCH_MODULE(Gpt);

/// Sets every parameter from (seed, name, index), on the CPU, then copies to its device.
///
/// Element i of the parameter called `name` (as named_parameters() spells it) is
///   key = splitmix64(seed ^ fnv1a64(name));  u = (splitmix64(key + i) >> 40) * 2^-24 in [0, 1)
///   w   = (2u - 1) * std * sqrt(3)          (uniform with standard deviation std, in double,
///                                            rounded once to float)
/// with std = 0.02 (GPT-2) for embeddings, c_attn, c_fc and lm_head, std = 0.02 / sqrt(2L) for
/// the two c_proj weights that write into the residual stream (GPT-2's scaled init), LayerNorm
/// weights 1, and every bias 0.
void init_weights(Gpt& model, uint64_t seed);

/// The course's GPT for @p config, its initial weights from @p seed (init_weights), on @p device:
/// the same weights on every rank and in every lesson.
Gpt make_gpt(const GptConfig& config, uint64_t seed, const torch::Device& device = torch::kCPU);

/// The same value init_weights() gives element @p index of @p name (for tests).
float init_value(uint64_t seed, const std::string& name, int64_t index, int64_t layers);

/// SplitMix64's output function after its increment (Steele, Lea, Flood 2014): a well-mixed
/// 64-bit hash of @p x. Shared by the initialiser and the batch sampler.
uint64_t splitmix64(uint64_t x);

/// FNV-1a, 64-bit, of @p text.
uint64_t fnv1a64(const std::string& text);

/// The device the course trains on: CUDA device 0 when this LibTorch has CUDA and a GPU is
/// visible, else the CPU. DTC_DEVICE=cpu (or cuda) in the environment overrides it.
/// @throws dtc::UsageError("DTC_DEVICE") for another value, or cuda without a GPU.
torch::Device default_device();

/// Sum of numel() over the parameters of @p module.
int64_t count_parameters(const torch::nn::Module& module);

}  // namespace dtc

// Lesson 01 contract: the training memory ledger.
//
// How many bytes does training hold per GPU? Four parts: parameters, gradients, optimizer
// states and activations. This header is the whole specification of what you implement in
// ledger.cpp; README.md beside it teaches the formulas. Build and test:
//
//   make test-lesson01          # your exercise, test by test
//   make run-lesson01           # the program: build/bin/lesson01 --help
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace dtc::l01 {

// ---------------------------------------------------------------------------------------------
// Models
// ---------------------------------------------------------------------------------------------

/// The two families of decoder-only transformers the ledger knows.
enum class Arch {
  /// LLaMA style: no biases, RMSNorm (one weight vector), SwiGLU MLP (three matrices: gate,
  /// up, down), rotary positions (no position weights), optional grouped-query attention,
  /// untied input and output embeddings, no dropout.
  kLlama,
  /// GPT-2/GPT-3 style: biases everywhere, LayerNorm (weight + bias), GELU MLP (two
  /// matrices), learned position embeddings (ctx x hidden), tied input/output embeddings,
  /// dropout.
  kGpt,
};

/// How a block projects its queries, keys and values.
enum class AttentionKind {
  /// Multi-head attention: Q and output projections h x h, K and V h x kv_dim (grouped-query
  /// attention when kv_heads < heads).
  kMultiHead,
  /// Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434, sec. 2.1): queries and
  /// keys/values pass through narrow latents (q_lora_rank, kv_lora_rank) with their own
  /// per-head widths; latent_attention_params() counts it.
  kLatent,
};

/// The shape of a decoder-only transformer.
///
/// A mixture-of-experts (MoE) model replaces the MLP of each MoE block with `experts` routed
/// experts (each an MLP of width expert_ffn(), of the block's kind: SwiGLU or GELU), a router
/// (an h x E linear layer, no bias) that sends each token to top_k of them, and shared experts
/// that every token goes through. The first first_dense_layers blocks keep a dense MLP of
/// width ffn.
struct ModelConfig {
  std::string name = "custom";  ///< preset name, or "custom"
  Arch arch = Arch::kLlama;
  int64_t hidden = 0;    ///< h, the model width
  int64_t layers = 0;    ///< L, transformer blocks
  int64_t heads = 0;     ///< a, attention (query) heads
  int64_t kv_heads = 0;  ///< key/value heads: = heads for multi-head attention, fewer for GQA
  int64_t ffn = 0;       ///< F, width of the MLP's hidden layer (4h in GPT)
  int64_t vocab = 0;     ///< V, vocabulary size
  int64_t ctx = 0;       ///< maximum context; GPT learns one position embedding per position

  // Mixture of experts (all 0: a dense model)
  int64_t experts = 0;             ///< E, routed experts per MoE block; 0 or 1: a dense model
  int64_t top_k = 0;               ///< k, routed experts each token goes through
  int64_t shared_experts = 0;      ///< experts that every token goes through (DeepSeekMoE)
  int64_t moe_ffn = 0;             ///< F_e, one expert's MLP width; 0: ffn
  int64_t first_dense_layers = 0;  ///< leading blocks with a dense MLP (DeepSeek-V3: 3)

  // Multi-head latent attention (used only when attention_kind is kLatent)
  AttentionKind attention_kind = AttentionKind::kMultiHead;
  int64_t q_lora_rank = 0;       ///< width of the query latent
  int64_t kv_lora_rank = 0;      ///< width of the key/value latent
  int64_t qk_nope_head_dim = 0;  ///< per head: the query/key width without rotary positions
  int64_t qk_rope_head_dim = 0;  ///< per head: the rotary part (one rotary key for all heads)
  int64_t v_head_dim = 0;        ///< per head: the value width

  /// h / a, the width of one head.
  int64_t head_dim() const { return hidden / heads; }
  /// kv_heads * head_dim: the width of the K and of the V projection.
  int64_t kv_dim() const { return kv_heads * head_dim(); }
  /// GPT blocks apply dropout (and store its masks); LLaMA blocks do not.
  bool has_dropout() const { return arch == Arch::kGpt; }
  /// Whether the model is a mixture of experts: more than one routed expert.
  bool is_moe() const { return experts > 1; }
  /// F_e, the width of one expert's MLP.
  int64_t expert_ffn() const { return moe_ffn > 0 ? moe_ffn : ffn; }
  /// The blocks whose MLP is a mixture of experts: all but the first dense ones; 0 when dense.
  int64_t moe_layers() const {
    return is_moe() ? layers - std::min(std::max<int64_t>(first_dense_layers, 0), layers) : 0;
  }
  /// The MLP width one token goes through in an MoE block, (k + shared) F_e; ffn when dense.
  int64_t active_ffn() const { return is_moe() ? (top_k + shared_experts) * expert_ffn() : ffn; }
};

/// The published configurations the course knows by name: llama-7b, llama-13b, llama-33b,
/// llama-65b, llama2-70b, llama3-8b, llama3-70b, llama3-405b, gpt2, gpt2-medium, gpt2-large,
/// gpt2-xl, gpt3-175b, course-gpt, and two mixtures of experts, mixtral-8x7b and deepseek-v3
/// (sources in ledger_given.cpp).
const std::vector<ModelConfig>& presets();

/// The preset called @p name.
/// @throws dtc::UsageError("--model") listing the known names when there is none.
ModelConfig preset(const std::string& name);

/// Checks that a model's shape makes sense.
/// @throws dtc::UsageError naming the flag (--hidden, --layers, --heads, --kv-heads, --ffn,
///   --vocab) for a size that is zero or negative, heads that do not divide hidden, or
///   kv-heads that do not divide heads; --ctx when it is negative, or zero for a GPT model
///   (which learns one position embedding per position); for a mixture of experts --experts
///   when it is negative, or when a setting of experts is given for a dense model, --top-k
///   outside 1..experts, --shared-experts or --moe-ffn negative, --first-dense-layers outside
///   0..layers; --model for a latent-attention model whose latent widths are not positive.
void validate(const ModelConfig& model);

/// The parameters of one expert: an MLP of width F_e = expert_ffn(), of the block's kind
/// (LLaMA: three h x F_e matrices, 3 h F_e; GPT: two, and their biases, 2 h F_e + F_e + h).
/// Given.
int64_t expert_params(const ModelConfig& model);

/// The parameters of one block's multi-head latent attention (attention_kind kLatent), with
/// a = heads, r_q = q_lora_rank, r_kv = kv_lora_rank, d_nope, d_rope, d_v the per-head widths
/// (DeepSeek-V3's modeling_deepseek.py, DeepseekV3Attention; no biases):
///   q_a_proj h x r_q, q_a_layernorm r_q, q_b_proj r_q x a (d_nope + d_rope),
///   kv_a_proj_with_mqa h x (r_kv + d_rope), kv_a_layernorm r_kv,
///   kv_b_proj r_kv x a (d_nope + d_v), o_proj a d_v x h. Given.
int64_t latent_attention_params(const ModelConfig& model);

// ---------------------------------------------------------------------------------------------
// Training set-up
// ---------------------------------------------------------------------------------------------

/// How weights and gradients are stored.
enum class Precision {
  kFp32,   ///< everything in fp32
  kMixed,  ///< 16-bit (bf16/fp16) weights and gradients, plus an fp32 master copy of the weights
  /// 16-bit weights, gradients kept and reduced in fp32 only (no 16-bit copy), plus the fp32
  /// master copy: Megatron-LM's bf16 default (it turns on accumulate_allreduce_grads_in_fp32
  /// for bf16), 18 bytes/param with Adam
  kMixedFp32Grads,
};
/// The optimizer, which decides the optimizer states.
enum class Optimizer {
  kSgd,       ///< plain SGD: no state
  kMomentum,  ///< SGD with momentum: one fp32 buffer
  kAdam,      ///< Adam / AdamW: two fp32 moments
  kAdam8bit,  ///< 8-bit Adam (bitsandbytes): two 1-byte moments
};
/// Activation recomputation (checkpointing), Korthikanti et al. 2022.
enum class Recompute {
  kNone,       ///< store every activation the backward pass needs
  kSelective,  ///< recompute the attention core (softmax, its dropout, attention over V)
  kFull,       ///< store only each layer's input; recompute the whole layer in backward
};

/// How the attention core is computed, which decides whether the s x s scores are stored.
enum class Attention {
  kAuto,   ///< FlashAttention for the LLaMA family, eager for GPT (see resolved_attention())
  kEager,  ///< softmax(QK^T)V as separate ops: the scores (and their dropout) are stored
  /// One fused kernel (FlashAttention, PyTorch's SDPA flash backend): no s x s tensor is
  /// stored; backward recomputes the scores from Q, K, V and each row's fp32 logsumexp.
  kFlash,
};

/// Everything about a training run that changes memory, besides the model.
struct TrainingSetup {
  Precision precision = Precision::kMixed;
  /// Mixed precision only: accumulate gradients in an extra fp32 buffer (4 bytes/param).
  bool fp32_grad_accum = false;
  Optimizer optimizer = Optimizer::kAdam;
  int zero_stage = 0;  ///< ZeRO stage 0 (plain data parallel) .. 3
  int64_t dp = 1;      ///< data-parallel degree: ZeRO shards over these ranks
  int64_t tp = 1;      ///< tensor-parallel degree
  int64_t pp = 1;      ///< pipeline-parallel degree
  /// Expert-parallel degree (mixtures of experts): each GPU holds E/ep of every MoE block's
  /// routed experts. The ep ranks are data-parallel ranks: the MoE blocks fold their expert
  /// groups over the ranks that replicate the rest (Megatron Core's MoE parallel folding,
  /// arXiv:2504.14960; torchtitan takes ep from its data-parallel shard ranks), so ep divides
  /// dp and adds no GPUs.
  int64_t ep = 1;
  int64_t seq = 2048;       ///< s, tokens per sequence
  int64_t micro_batch = 1;  ///< b, sequences per micro-batch on one GPU
  Recompute recompute = Recompute::kNone;
  bool sequence_parallel = false;  ///< Megatron sequence parallelism (shards norms/dropout by tp)
  Attention attention = Attention::kAuto;
};

/// The attention @p setup asks for, with kAuto resolved for @p model: kFlash for the LLaMA
/// family (what its training stacks run), kEager for GPT (whose presets reproduce Korthikanti et
/// al.'s Table 2, measured with eager attention). Given.
Attention resolved_attention(const ModelConfig& model, const TrainingSetup& setup);

/// Checks a set-up, and its fit with @p model when one is given (nullptr: a bare parameter
/// count).
/// @throws dtc::UsageError naming the flag: --dp/--tp/--pp/--ep/--seq/--micro-batch below 1,
///   --zero outside 0-3, --tp not dividing heads, kv-heads, ffn or an expert's ffn,
///   --pp greater than layers, --fp32-grad-accum without --precision mixed; --ep above 1
///   without a model, for a dense model, or not dividing the experts or dp.
void validate(const TrainingSetup& setup, const ModelConfig* model);

// ---------------------------------------------------------------------------------------------
// What you implement (ledger.cpp)
// ---------------------------------------------------------------------------------------------

/// Counts the parameters of @p model.
///
/// Per block: attention (Q and output projections h x h; K and V projections h x kv_dim;
/// latent_attention_params() for kLatent), the MLP (LLaMA: three h x F matrices; GPT: two),
/// the norms (RMSNorm: h; LayerNorm: 2h), and for GPT the biases of every linear layer
/// (Q/K/V/output, and the MLP's F and h). In each of the moe_layers() MoE blocks the MLP is
/// replaced by all E routed experts and the shared ones (expert_params() each) and the router
/// (h x E). Then the embeddings: LLaMA has an input embedding and a separate output head (2 V h)
/// and a final RMSNorm (h); GPT has one tied V x h matrix, ctx x h position embeddings and a
/// final LayerNorm (2h).
/// @return the exact count, e.g. 6,738,415,616 for llama-7b, 46,702,792,704 for mixtral-8x7b.
int64_t count_params(const ModelConfig& model);

/// Counts the parameters one token goes through: count_params() without the E - k routed
/// experts of each MoE block that the router does not pick for it (the router itself and the
/// shared experts are active). A dense model's are all of them. Active parameters set the
/// FLOPs (6 N D with N active); all of them take memory.
/// @return the exact count, e.g. 12,879,925,248 for mixtral-8x7b.
int64_t active_params(const ModelConfig& model);

/// Bytes per parameter of each training state, before any sharding.
struct BytesPerParam {
  double params = 0;     ///< the weights the forward pass uses
  double grads = 0;      ///< gradients (plus the fp32 accumulation buffer, if any)
  double optimizer = 0;  ///< optimizer states, including the fp32 master copy in mixed precision
  /// params + grads + optimizer.
  double total() const { return params + grads + optimizer; }
};

/// The bytes per parameter for a precision and optimizer.
///
/// fp32: weights 4, gradients 4, optimizer states in fp32 (SGD none, momentum one buffer,
/// Adam two moments; 8-bit Adam two 1-byte moments). Mixed: weights 2, gradients 2 (+4 with
/// @p fp32_grad_accum), optimizer = fp32 master copy (4) + the states as in fp32 training.
/// Mixed + Adam gives 2 + 2 + 12 = 16 (ZeRO, sec. 3.1). Mixed with fp32 gradients: weights 2,
/// gradients 4, optimizer as mixed: 2 + 4 + 12 = 18 with Adam (Megatron Core's distributed
/// optimizer guide, "bf16 param, fp32 grads").
BytesPerParam bytes_per_param(Precision precision, Optimizer optimizer, bool fp32_grad_accum);

/// Bytes of each state held by one device.
struct StateBytes {
  double params = 0;
  double grads = 0;
  double optimizer = 0;
  double total() const { return params + grads + optimizer; }
};

/// ZeRO sharding of @p params parameters (those one data-parallel replica holds) over @p dp
/// ranks. Stage 0 shards nothing; stage 1 shards the optimizer states; stage 2 also the
/// gradients; stage 3 also the parameters. A sharded state is divided evenly by dp.
/// Check: P = 7.5e9, dp = 64, 16 bytes/param -> 120, 31.4, 16.6, 1.9 GB (ZeRO, Figure 1).
StateBytes zero_state_bytes(double params, const BytesPerParam& per_param, int zero_stage,
                            int64_t dp);

/// Activation bytes one transformer block stores for backward, on one GPU, for one
/// micro-batch of setup.micro_batch sequences of setup.seq tokens (16-bit activations, 1-byte
/// dropout masks).
///
/// Korthikanti et al. 2022 (arXiv:2205.05198, Table 2) derive s*b*h*(34 + 5*a*s/h) for a GPT
/// block with F = 4h. Generalise their derivation to this block's real shape (K and V of width
/// kv_dim, the MLP's F = active_ffn() and its matrices, dropout only where the block has it;
/// an MoE block stores the F-wide tensors of the k + shared experts each token goes through),
/// and apply tensor parallelism (tp), sequence parallelism and recomputation as Table 2 does:
///   - tp splits the tensors inside the attention and MLP (Q, K, V, the attention scores, the
///     MLP's F-wide tensors, the output projections' inputs); the rest is replicated unless
///     sequence_parallel, which splits it by tp as well;
///   - selective recomputation drops the attention-score (s x s) tensors;
///   - FlashAttention (resolved_attention() is kFlash) stores no s x s tensor either, but keeps
///     each query row's logsumexp per head, in fp32: 4asb bytes, split by tp (selective
///     recomputation drops that too);
///   - full recomputation keeps only the block's input, 2sbh (split by tp with sequence
///     parallelism).
/// README.md lists every stored tensor.
double activation_bytes_per_layer(const ModelConfig& model, const TrainingSetup& setup);

/// One device's memory for training.
struct Ledger {
  int64_t params = 0;  ///< parameters of the whole model
  /// Parameters one GPU holds of its replica, before ZeRO: P/(tp*pp) for a bare count; with the
  /// model, the first stage's share, with only E/ep of each MoE block's routed experts
  /// (compute_ledger()).
  double params_per_replica = 0;
  /// Of params_per_replica, the routed experts' parameters, which ZeRO shards over the dp/ep
  /// ranks that hold the same experts (0 for a dense model).
  double expert_params = 0;
  BytesPerParam per_param;                ///< bytes per parameter before sharding
  StateBytes state;                       ///< parameters, gradients, optimizer states per device
  double per_layer_activation_bytes = 0;  ///< activation_bytes_per_layer(); 0 without a shape
  double activation_bytes = 0;            ///< activations per device
  /// Everything on one device.
  double total_bytes() const { return state.total() + activation_bytes; }
};

/// The parameters of the input embedding, which the first pipeline stage holds besides its
/// blocks: V h, and GPT's ctx h position embeddings (its tied head is the same V h matrix).
/// Given.
int64_t first_stage_embedding_params(const ModelConfig& model);

/// The ledger for one device, the one that holds the most: the first pipeline stage.
///
/// Tensor and pipeline parallelism split the model. With a bare parameter count (@p model
/// nullptr) one GPU's share of a replica is params / (tp * pp), an even split, and there are no
/// activations. With @p model and pp > 1 a stage holds whole blocks: the first holds
/// ceil(layers / pp) of them (each of count_params() with 1 layer minus with 0 layers; an MoE
/// block, the heavier kind, when the model has any: first_dense_layers 0 in that count) and the
/// input embedding (first_stage_embedding_params()), split by tp; with pp = 1 the GPU holds
/// params / tp. Expert parallelism then keeps E/ep of the routed experts of each MoE block the
/// GPU holds (their tp share; the shared experts and the rest stay whole): expert_params.
/// ZeRO shards the states of expert_params over dp/ep ranks and those of the rest of the share
/// over dp. Activations, with @p model: per_layer x ceil(layers / pp) x pp, the first stage's
/// under 1F1B: it keeps pp micro-batches in flight, each through its ceil(layers / pp) blocks
/// (Korthikanti sec. 4.2.3: L layers' worth when pp divides L).
Ledger compute_ledger(int64_t params, const TrainingSetup& setup, const ModelConfig* model);

/// Seconds to train a model of @p params parameters on @p tokens tokens: 6 * N * D FLOPs
/// (forward 2ND + backward 4ND) at @p mfu of @p peak_flops per GPU, on @p gpus GPUs. For a
/// mixture of experts N is active_params(): a token's FLOPs go through those only.
/// @throws std::invalid_argument for a non-positive argument or an mfu above 1.
double train_time_seconds(double params, double tokens, double peak_flops, double mfu,
                          int64_t gpus);

}  // namespace dtc::l01

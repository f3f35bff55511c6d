// Lesson 01 tests: the ledger against published numbers and closed forms.
// Every expected value names its source: a paper and its table or section, or a closed form.
#include <gtest/gtest.h>

#include "dtc/errors.h"
#include "dtc_test.h"
#include "ledger.h"

namespace dtc::l01 {
namespace {

using test::kGB;

TrainingSetup mixed_adam() { return TrainingSetup{}; }

// A GPT block with F = 4h, the shape Korthikanti et al. derive their Table 2 for: GPT-3 175B.
ModelConfig gpt3() { return preset("gpt3-175b"); }

// ---------------------------------------------------------------------------------------------
// Parameter counts
// ---------------------------------------------------------------------------------------------

TEST(L01Params, Llama7bExact) {
  // LLaMA-7B: 6,738,415,616 parameters (Touvron et al. 2023, the released 7B checkpoint).
  EXPECT_EQ(count_params(preset("llama-7b")), 6738415616LL)
      << "LLaMA-7B has 6,738,415,616 parameters: per layer 4h^2 + 3hF + 2h, plus 2Vh + h";
}

TEST(L01Params, LlamaPaperSizes) {
  // Touvron et al. 2023 (LLaMA), Table 2: 6.7B, 13.0B, 32.5B, 65.2B, cut (not rounded) to
  // 0.1B: the count lies in [published, published + 0.1B).
  const std::pair<const char*, double> published[] = {
      {"llama-7b", 6.7}, {"llama-13b", 13.0}, {"llama-33b", 32.5}, {"llama-65b", 65.2}};
  for (const auto& [name, billions] : published) {
    SCOPED_TRACE(name);
    const double got = static_cast<double>(count_params(preset(name))) / 1e9;
    EXPECT_GE(got, billions) << "LLaMA paper, Table 2: " << billions << "B";
    EXPECT_LT(got, billions + 0.1) << "LLaMA paper, Table 2: " << billions << "B";
  }
}

TEST(L01Params, Gpt2SmallExact) {
  // GPT-2 small as released: 124,439,808 parameters (Hugging Face's gpt2 checkpoint).
  EXPECT_EQ(count_params(preset("gpt2")), 124439808LL);
}

TEST(L01Params, GptClosedForm) {
  // Closed form for a GPT-2-style model: L*(12h^2 + 13h) + V*h + ctx*h + 2h.
  for (const char* name : {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b"}) {
    SCOPED_TRACE(name);
    const ModelConfig m = preset(name);
    const int64_t h = m.hidden;
    const int64_t expected = m.layers * (12 * h * h + 13 * h) + m.vocab * h + m.ctx * h + 2 * h;
    EXPECT_EQ(count_params(m), expected);
  }
}

TEST(L01Params, Gpt3PaperSize) {
  // Brown et al. 2020 (GPT-3), Table 2.1: 175.0B parameters.
  EXPECT_CLOSE_REL(static_cast<double>(count_params(gpt3())), 175.0e9, 0.005,
                   "GPT-3 paper, Table 2.1");
}

TEST(L01Params, GroupedQueryAttention) {
  // With GQA the K and V projections are h x (kv * head_dim). Llama 2 70B has 8 kv heads for
  // its 64 query heads (head size 128): per layer it saves 2 * h * (h - 8 * 128) weights against
  // full MHA.
  ModelConfig gqa = preset("llama2-70b");
  ModelConfig mha = gqa;
  mha.kv_heads = mha.heads;
  const int64_t h = gqa.hidden;
  EXPECT_EQ(count_params(mha) - count_params(gqa), gqa.layers * 2 * h * (h - 8 * 128));
  // Closed form for the whole model: L * (2h^2 + 2h*kv + 3hF + 2h) + 2Vh + h.
  const int64_t kv = 8 * 128;
  const int64_t layer = 2 * h * h + 2 * h * kv + 3 * h * gqa.ffn + 2 * h;
  EXPECT_EQ(count_params(gqa), gqa.layers * layer + 2 * gqa.vocab * h + h);
}

// ---------------------------------------------------------------------------------------------
// Bytes per parameter
// ---------------------------------------------------------------------------------------------

TEST(L01Bytes, MixedAdamIs16) {
  // ZeRO (Rajbhandari et al. 2019), sec. 3.1: 2 + 2 + K, K = 12 -> 16 bytes per parameter.
  const BytesPerParam b = bytes_per_param(Precision::kMixed, Optimizer::kAdam, false);
  EXPECT_EQ(b.params, 2);
  EXPECT_EQ(b.grads, 2);
  EXPECT_EQ(b.optimizer, 12);
  EXPECT_EQ(b.total(), 16);
}

TEST(L01Bytes, Fp32GradAccumulationIs20) {
  // HF Ultra-Scale Playbook: 2 + 2 + 4 + 8 + 4 = 20 bytes/param with fp32 grad accumulation.
  EXPECT_EQ(bytes_per_param(Precision::kMixed, Optimizer::kAdam, true).total(), 20);
}

TEST(L01Bytes, Fp32GradientsAre18) {
  // Megatron Core's distributed optimizer guide, bytes per parameter without sharding:
  // "bf16 param, fp32 grads" 18 (2 + 4 + 12); Megatron-LM keeps bf16 runs' gradients in fp32
  // (arguments.py turns on accumulate_allreduce_grads_in_fp32 for bf16).
  const BytesPerParam b = bytes_per_param(Precision::kMixedFp32Grads, Optimizer::kAdam, false);
  EXPECT_EQ(b.params, 2);
  EXPECT_EQ(b.grads, 4);
  EXPECT_EQ(b.optimizer, 12);
  EXPECT_EQ(b.total(), 18);
}

TEST(L01Bytes, OptimizerStates) {
  // EleutherAI "Transformer Math 101": optimizer bytes/param in mixed precision:
  // AdamW 12, 8-bit Adam 6, SGD with momentum 8 (each includes the 4-byte fp32 master copy).
  EXPECT_EQ(bytes_per_param(Precision::kMixed, Optimizer::kAdam, false).optimizer, 12);
  EXPECT_EQ(bytes_per_param(Precision::kMixed, Optimizer::kAdam8bit, false).optimizer, 6);
  EXPECT_EQ(bytes_per_param(Precision::kMixed, Optimizer::kMomentum, false).optimizer, 8);
  EXPECT_EQ(bytes_per_param(Precision::kMixed, Optimizer::kSgd, false).optimizer, 4);
}

TEST(L01Bytes, Fp32Training) {
  // Transformer Math 101: 4 bytes/param for fp32 weights and gradients; no master copy, so
  // Adam's two fp32 moments are 8 bytes and plain SGD keeps none.
  const BytesPerParam adam = bytes_per_param(Precision::kFp32, Optimizer::kAdam, false);
  EXPECT_EQ(adam.params, 4);
  EXPECT_EQ(adam.grads, 4);
  EXPECT_EQ(adam.optimizer, 8);
  EXPECT_EQ(bytes_per_param(Precision::kFp32, Optimizer::kSgd, false).optimizer, 0);
}

// ---------------------------------------------------------------------------------------------
// ZeRO
// ---------------------------------------------------------------------------------------------

TEST(L01Zero, Figure1) {
  // ZeRO paper, Figure 1: P = 7.5B, Nd = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB per device.
  const BytesPerParam b{2, 2, 12};
  const double published[] = {120.0, 31.4, 16.6, 1.9};
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    const double gb = zero_state_bytes(7.5e9, b, stage, 64).total() / kGB;
    EXPECT_NEAR(gb, published[stage], 0.05) << "ZeRO paper, Figure 1 (rounded to 0.1 GB)";
  }
}

TEST(L01Zero, StageFormulas) {
  // ZeRO sec. 5: stage 1 4P + KP/Nd; stage 2 2P + (2+K)P/Nd; stage 3 (4+K)P/Nd.
  const double p = 1e9, nd = 8, k = 12;
  const BytesPerParam b{2, 2, k};
  EXPECT_DOUBLE_EQ(zero_state_bytes(p, b, 0, 8).total(), (4 + k) * p);
  EXPECT_DOUBLE_EQ(zero_state_bytes(p, b, 1, 8).total(), 4 * p + k * p / nd);
  EXPECT_DOUBLE_EQ(zero_state_bytes(p, b, 2, 8).total(), 2 * p + (2 + k) * p / nd);
  EXPECT_DOUBLE_EQ(zero_state_bytes(p, b, 3, 8).total(), (4 + k) * p / nd);
  const StateBytes s2 = zero_state_bytes(p, b, 2, 8);
  EXPECT_DOUBLE_EQ(s2.params, 2 * p);
  EXPECT_DOUBLE_EQ(s2.grads, 2 * p / nd);
  EXPECT_DOUBLE_EQ(s2.optimizer, k * p / nd);
}

// ---------------------------------------------------------------------------------------------
// Activations (Korthikanti et al. 2022, arXiv:2205.05198, Table 2)
// ---------------------------------------------------------------------------------------------

struct KorthikantiCase {
  int64_t tp;
  bool sp;
  Recompute recompute;
};

TEST(L01Activations, KorthikantiTable2) {
  const ModelConfig m = gpt3();
  const double s = 2048, b = 1, h = 12288, a = 96;
  for (int64_t t : {1, 2, 8}) {
    SCOPED_TRACE(testing::Message() << "tp " << t);
    TrainingSetup setup = mixed_adam();
    setup.seq = 2048;
    setup.micro_batch = 1;
    setup.tp = t;
    const double none_tp = s * b * h * (10 + 24.0 / t + 5 * a * s / (h * t));
    EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup), none_tp, 1e-12,
                     "Korthikanti Table 2: tensor parallel, sbh(10 + 24/t + 5as/(ht))");
    setup.sequence_parallel = true;
    EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup), s * b * h / t * (34 + 5 * a * s / h),
                     1e-12, "Korthikanti Table 2: tensor + sequence parallel, sbh/t(34 + 5as/h)");
    setup.recompute = Recompute::kSelective;
    EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup), 34 * s * b * h / t, 1e-12,
                     "Korthikanti Table 2: selective recompute + TP + SP, 34sbh/t");
  }
  TrainingSetup plain = mixed_adam();
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, plain), s * b * h * (34 + 5 * a * s / h), 1e-12,
                   "Korthikanti Table 2: no parallelism, sbh(34 + 5as/h)");
  plain.recompute = Recompute::kFull;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, plain), 2 * s * b * h, 1e-12,
                   "Korthikanti Table 2: full recomputation, 2sbh");
}

TEST(L01Activations, SelectiveSaves70PercentOnGpt3) {
  // Korthikanti sec. 5: for GPT-3 (5as/h = 80) selective recomputation saves 80/114 = 70%.
  const ModelConfig m = gpt3();
  TrainingSetup setup = mixed_adam();
  const double full = activation_bytes_per_layer(m, setup);
  setup.recompute = Recompute::kSelective;
  const double selective = activation_bytes_per_layer(m, setup);
  EXPECT_CLOSE_REL(1.0 - selective / full, 80.0 / 114.0, 1e-12, "Korthikanti sec. 5: 80/114");
}

TEST(L01Activations, ScalesWithBatchAndSequence) {
  // Closed form: everything is linear in b; the attention scores are quadratic in s.
  const ModelConfig m = gpt3();
  TrainingSetup one = mixed_adam();
  TrainingSetup four = one;
  four.micro_batch = 4;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, four), 4 * activation_bytes_per_layer(m, one),
                   1e-12, "closed form: linear in the micro-batch");
  one.recompute = four.recompute = Recompute::kSelective;  // no s^2 term left: linear in s
  four.micro_batch = 1;
  four.seq = 4 * one.seq;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, four), 4 * activation_bytes_per_layer(m, one),
                   1e-12, "closed form: linear in s without the attention scores");
}

TEST(L01Activations, LlamaBlockShape) {
  // The generalisation to LLaMA's block: no dropout (no masks, no dropout output), a
  // three-matrix MLP storing three F-wide tensors, and K, V of width kv_dim; eager attention.
  ModelConfig m = preset("llama-7b");
  TrainingSetup setup = mixed_adam();
  setup.attention = Attention::kEager;
  const double s = 2048, b = 1, h = 4096, a = 32, f = 11008;
  // Per the README's table: 8 sbh outside TP regions; Q, K, V, out-proj input 8 sbh; the MLP
  // 6 sbF; softmax output 2 a s^2 b.
  const double expected = 16 * s * b * h + 6 * s * b * f + 2 * a * s * s * b;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup), expected, 1e-12,
                   "closed form for a LLaMA block (README table)");
  // Grouped-query attention: K and V shrink from h to kv_dim wide.
  ModelConfig gqa = m;
  gqa.kv_heads = 8;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup) - activation_bytes_per_layer(gqa, setup),
                   2 * 2 * s * b * (h - 8 * 128), 1e-12, "closed form: K and V are 2sb*kv_dim");
}

TEST(L01Activations, FlashAttentionStoresNoScores) {
  // FlashAttention keeps Q, K, V and the output (already counted) and each query row's fp32
  // logsumexp per head, 4asb bytes (FlashAttention-2, Algorithm 1; PyTorch's
  // _scaled_dot_product_flash_attention returns it as a float tensor of shape (b, a, s)); the
  // scores, their dropout mask and output are never stored (the mask is regenerated from the
  // RNG state).
  const ModelConfig m = gpt3();
  const double s = 2048, b = 1, h = 12288, a = 96;
  TrainingSetup setup = mixed_adam();
  setup.attention = Attention::kFlash;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup), 34 * s * b * h + 4 * a * s * b, 1e-12,
                   "closed form: Table 2's 34sbh, and 4asb of logsumexp instead of 5as^2b");
  for (int64_t t : {2, 8}) {
    SCOPED_TRACE(testing::Message() << "tp " << t);
    setup.tp = t;
    setup.sequence_parallel = false;
    EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup),
                     s * b * h * (10 + 24.0 / t) + 4 * a * s * b / t, 1e-12,
                     "closed form: the logsumexp is split with the heads");
    setup.sequence_parallel = true;
    EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup), (34 * s * b * h + 4 * a * s * b) / t,
                     1e-12, "closed form: sequence parallelism splits the rest too");
  }
  // Selective recomputation recomputes the attention core: the logsumexp goes too.
  setup.tp = 1;
  setup.sequence_parallel = false;
  setup.recompute = Recompute::kSelective;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup), 34 * s * b * h, 1e-12,
                   "closed form: 34sbh, as selective recompute with eager attention");
  // Linear in s, unlike eager attention.
  setup.recompute = Recompute::kNone;
  TrainingSetup longer = setup;
  longer.seq = 4 * setup.seq;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, longer), 4 * activation_bytes_per_layer(m, setup),
                   1e-12, "closed form: no s^2 term with FlashAttention");
}

TEST(L01Activations, AutoIsFlashForLlamaAndEagerForGpt) {
  const ModelConfig llama = preset("llama-7b");
  TrainingSetup setup = mixed_adam();  // attention left at its default, kAuto
  EXPECT_EQ(resolved_attention(llama, setup), Attention::kFlash);
  EXPECT_EQ(resolved_attention(gpt3(), setup), Attention::kEager);
  const double s = 2048, b = 1, h = 4096, a = 32, f = 11008;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(llama, setup),
                   16 * s * b * h + 6 * s * b * f + 4 * a * s * b, 1e-12,
                   "closed form: a LLaMA block with FlashAttention by default");
  EXPECT_CLOSE_REL(activation_bytes_per_layer(gpt3(), setup),
                   s * b * 12288 * (34 + 5 * 96 * s / 12288), 1e-12,
                   "GPT by default: Korthikanti's eager Table 2");
}

// ---------------------------------------------------------------------------------------------
// The whole ledger
// ---------------------------------------------------------------------------------------------

TEST(L01Ledger, Outline7bStaticMemory) {
  // Course outline: BF16 mixed precision + Adam, 7B -> static memory 112 GB (16 bytes/param);
  // HF Ultra-Scale Playbook: 140 GB with fp32 gradient accumulation (20 bytes/param).
  TrainingSetup setup = mixed_adam();
  Ledger l = compute_ledger(7000000000LL, setup, nullptr);
  EXPECT_CLOSE_REL(l.total_bytes(), 112e9, 1e-12, "course outline: 7B -> 112 GB");
  EXPECT_EQ(l.activation_bytes, 0) << "a bare parameter count has no activations";
  setup.fp32_grad_accum = true;
  l = compute_ledger(7000000000LL, setup, nullptr);
  EXPECT_CLOSE_REL(l.total_bytes(), 140e9, 1e-12, "Ultra-Scale Playbook: 7B -> 140 GB");
}

TEST(L01Ledger, TensorAndPipelineSplitTheModel) {
  // A bare count splits evenly: P / (tp * pp); ZeRO then shards over dp.
  TrainingSetup setup = mixed_adam();
  setup.tp = 2;
  setup.pp = 4;
  setup.dp = 8;
  setup.zero_stage = 1;
  const double p = 6738415616.0;
  Ledger l = compute_ledger(6738415616LL, setup, nullptr);
  EXPECT_DOUBLE_EQ(l.params_per_replica, p / 8);
  EXPECT_DOUBLE_EQ(l.state.params, 2 * p / 8);
  EXPECT_DOUBLE_EQ(l.state.grads, 2 * p / 8);
  EXPECT_DOUBLE_EQ(l.state.optimizer, 12 * p / 8 / 8);
  // With the model, whole blocks per stage: the first stage holds 32 / 4 = 8 of LLaMA-7B's
  // blocks (202,383,360 parameters each, README section 3's table) and the 32,000 x 4096 input
  // embedding, split over tp 2.
  const ModelConfig m = preset("llama-7b");
  l = compute_ledger(6738415616LL, setup, &m);
  const double first = (8 * 202383360.0 + 32000.0 * 4096) / 2;
  EXPECT_DOUBLE_EQ(l.params_per_replica, first);
  EXPECT_DOUBLE_EQ(l.state.params, 2 * first);
  EXPECT_DOUBLE_EQ(l.state.optimizer, 12 * first / 8);
  // Without pipeline parallelism the GPU holds its tp share of everything.
  setup.pp = 1;
  l = compute_ledger(6738415616LL, setup, &m);
  EXPECT_DOUBLE_EQ(l.params_per_replica, p / 2);
}

TEST(L01Ledger, StagesHoldWholeLayers) {
  // 126 layers in 64 stages: the first stage holds ceil(126 / 64) = 2 blocks, not 1.97, and
  // under 1F1B keeps 64 micro-batches in flight through them: 128 layers' worth of activations.
  const ModelConfig m = preset("llama3-405b");
  ASSERT_EQ(m.layers, 126);
  TrainingSetup setup = mixed_adam();
  setup.tp = 8;
  setup.pp = 64;
  setup.sequence_parallel = true;
  const Ledger l = compute_ledger(count_params(m), setup, &m);
  EXPECT_CLOSE_REL(l.activation_bytes, 128 * activation_bytes_per_layer(m, setup), 1e-12,
                   "closed form: ceil(L/pp) x pp layers on the first stage");
  ModelConfig one = m, none = m;
  one.layers = 1;
  none.layers = 0;
  const double block = static_cast<double>(count_params(one) - count_params(none));
  EXPECT_CLOSE_REL(l.params_per_replica, (2 * block + static_cast<double>(m.vocab * m.hidden)) / 8,
                   1e-12, "closed form: 2 blocks and the input embedding, over tp 8");
}

TEST(L01Ledger, ActivationsForEveryLayer) {
  // Korthikanti sec. 4.2.3: per device, activations of L layers' worth (1F1B keeps pp
  // micro-batches of L/pp layers on the first stage), so pp does not change them.
  const ModelConfig m = gpt3();
  TrainingSetup setup = mixed_adam();
  setup.tp = 8;
  setup.pp = 8;
  setup.sequence_parallel = true;
  setup.recompute = Recompute::kSelective;
  const Ledger l = compute_ledger(count_params(m), setup, &m);
  const double s = 2048, b = 1, h = 12288, t = 8, layers = 96;
  EXPECT_CLOSE_REL(l.per_layer_activation_bytes, 34 * s * b * h / t, 1e-12,
                   "Korthikanti Table 2: 34sbh/t");
  EXPECT_CLOSE_REL(l.activation_bytes, 34 * s * b * h / t * layers, 1e-12,
                   "Korthikanti sec. 4.2.3: L layers' worth per device");
  EXPECT_DOUBLE_EQ(l.total_bytes(), l.state.total() + l.activation_bytes);
}

// ---------------------------------------------------------------------------------------------
// Time to train
// ---------------------------------------------------------------------------------------------

TEST(L01Time, SixNDOverDeliveredFlops) {
  // 6 N D FLOPs (Kaplan et al. 2020); H100 SXM dense BF16 peak 989 TFLOP/s (NVIDIA).
  // The outline: 70B on 1T tokens on one GPU takes years.
  const double secs = train_time_seconds(70e9, 1e12, 989e12, 0.4, 1);
  EXPECT_CLOSE_REL(secs, 6 * 70e9 * 1e12 / (989e12 * 0.4), 1e-12,
                   "closed form: 6ND / (peak * mfu)");
  EXPECT_GT(secs / (365.0 * 86400.0), 10.0) << "70B on 1T tokens on one GPU: decades";
  EXPECT_CLOSE_REL(train_time_seconds(70e9, 1e12, 989e12, 0.4, 1024), secs / 1024, 1e-12,
                   "closed form: linear in the GPU count");
}

// ---------------------------------------------------------------------------------------------
// Mixtures of experts: total and active parameters, expert parallelism
// ---------------------------------------------------------------------------------------------

// A small LLaMA-style mixture of experts whose every count is worked out by hand below: h 64,
// 3 blocks of which the first is dense (F 128), 4 heads, 4 routed experts of F_e 32 (top-2)
// and 1 shared expert per MoE block, V 100.
ModelConfig tiny_moe() {
  ModelConfig m;
  m.name = "tiny-moe";
  m.arch = Arch::kLlama;
  m.hidden = 64;
  m.layers = 3;
  m.heads = 4;
  m.kv_heads = 4;
  m.ffn = 128;
  m.vocab = 100;
  m.experts = 4;
  m.top_k = 2;
  m.shared_experts = 1;
  m.moe_ffn = 32;
  m.first_dense_layers = 1;
  return m;
}

TEST(L01Moe, Mixtral8x7bExact) {
  // Mixtral 8x7B from its released config (mistralai/Mixtral-8x7B-v0.1; Jiang et al. 2024,
  // arXiv:2401.04088, Table 1): h 4096, 32 blocks, 32 heads of 128, 8 kv heads, 8 experts of
  // F 14336, top-2, V 32000, untied. Per block:
  //   attention 2 h^2 + 2 h (8 x 128)       = 33,554,432 + 8,388,608  =    41,943,040
  //   experts   8 x 3 h F = 8 x 176,160,768                            = 1,409,286,144
  //   router    h x 8                                                  =        32,768
  //   norms     2 h                                                    =         8,192
  //   block                                                            = 1,451,270,144
  // Outside the blocks: 2 V h + h = 262,144,000 + 4,096 = 262,148,096.
  // Total: 32 x 1,451,270,144 + 262,148,096 = 46,440,644,608 + 262,148,096 = 46,702,792,704.
  // Active: each token goes through 2 experts, so a block holds 41,943,040 + 2 x 176,160,768 +
  //   32,768 + 8,192 = 394,305,536; 32 x 394,305,536 + 262,148,096 = 12,879,925,248.
  // (The paper's abstract rounds them: 47B parameters, 13B active.)
  const ModelConfig m = preset("mixtral-8x7b");
  EXPECT_EQ(count_params(m), 46702792704LL) << "Mixtral 8x7B: 46,702,792,704 (config, by hand)";
  EXPECT_EQ(active_params(m), 12879925248LL)
      << "Mixtral 8x7B: 12,879,925,248 active (2 of 8 experts, router and the rest)";
}

TEST(L01Moe, DeepSeekV3Exact) {
  // DeepSeek-V3 from its released config (deepseek-ai/DeepSeek-V3 config.json;
  // modeling_deepseek.py for the shapes): h 7168, 61 blocks, the first 3 dense (F 18432), the
  // other 58 with 256 routed experts (top-8) and 1 shared, F_e 2048; V 129280, untied.
  // Multi-head latent attention, a = 128 heads, per block:
  //   q_a_proj  h x 1536                          =  11,010,048
  //   q_a_layernorm                               =       1,536
  //   q_b_proj  1536 x 128 (128 + 64)             =  37,748,736
  //   kv_a_proj_with_mqa  h x (512 + 64)          =   4,128,768
  //   kv_a_layernorm                              =         512
  //   kv_b_proj 512 x 128 (128 + 128)             =  16,777,216
  //   o_proj    128 x 128 x h                     = 117,440,512
  //   attention                                   = 187,107,328
  // Norms 2h = 14,336. Dense MLP 3 h 18432 = 396,361,728. One expert 3 h 2048 = 44,040,192.
  //   dense block  187,107,328 + 396,361,728 + 14,336                             =    583,483,392
  //   MoE block    187,107,328 + (256 + 1) x 44,040,192 + h x 256 (1,835,008) + 14,336
  //              = 187,107,328 + 11,318,329,344 + 1,835,008 + 14,336            = 11,507,286,016
  //   outside: 2 V h + h = 2 x 926,679,040 + 7,168                              =  1,853,365,248
  // Total: 3 x 583,483,392 + 58 x 11,507,286,016 + 1,853,365,248
  //      = 1,750,450,176 + 667,422,588,928 + 1,853,365,248 = 671,026,404,352.
  // Active MoE block: 187,107,328 + (8 + 1) x 44,040,192 + 1,835,008 + 14,336 = 585,318,400;
  //   3 x 583,483,392 + 58 x 585,318,400 + 1,853,365,248 = 37,552,282,624.
  const ModelConfig m = preset("deepseek-v3");
  EXPECT_EQ(count_params(m), 671026404352LL) << "DeepSeek-V3: 671,026,404,352 (config, by hand)";
  EXPECT_EQ(active_params(m), 37552282624LL) << "DeepSeek-V3: 37,552,282,624 active (by hand)";
  // Published (DeepSeek-V3 technical report, arXiv:2412.19437, abstract): 671B total, 37B
  // activated for each token. Its README_WEIGHTS.md gives 36.6B activated without the input
  // embedding (a table lookup: no FLOPs): 37,552,282,624 - 926,679,040 = 36,625,603,584.
  EXPECT_NEAR(static_cast<double>(count_params(m)) / 1e9, 671.0, 0.05) << "DeepSeek-V3: 671B";
  EXPECT_NEAR(static_cast<double>(active_params(m) - m.vocab * m.hidden) / 1e9, 36.6, 0.05)
      << "DeepSeek-V3 README_WEIGHTS.md: 36.6B activated, input embedding aside";
}

TEST(L01Moe, SharedExpertsAndDenseFirstBlocks) {
  // tiny_moe() by hand: attention 4 h^2 = 16,384; norms 2h = 128; dense MLP 3 h 128 = 24,576;
  // one expert 3 h 32 = 6,144; a MoE block's MLP (4 + 1) x 6,144 + router h x 4 = 30,976.
  //   dense block 16,384 + 24,576 + 128 = 41,088; MoE block 16,384 + 30,976 + 128 = 47,488;
  //   outside 2 V h + h = 12,864. Total 41,088 + 2 x 47,488 + 12,864 = 148,928.
  // Active: each MoE block skips 4 - 2 routed experts: 148,928 - 2 x 2 x 6,144 = 124,352.
  const ModelConfig m = tiny_moe();
  EXPECT_EQ(m.moe_layers(), 2);
  EXPECT_EQ(count_params(m), 148928) << "closed form (by hand): 41,088 + 2 x 47,488 + 12,864";
  EXPECT_EQ(active_params(m), 124352) << "closed form (by hand): 148,928 - 2 x 2 x 6,144";
}

TEST(L01Moe, GptStyleExperts) {
  // GPT-style experts are GELU MLPs with biases. h 8, 2 blocks, both MoE, 4 experts of F_e 16,
  // top-1, V 10, ctx 4. Per block: attention 4 h^2 + 4 h biases = 288, LayerNorms 4h = 32, one
  // expert 2 h 16 + 16 + 8 = 280, router h x 4 = 32: 288 + 32 + 4 x 280 + 32 = 1,472.
  // Total: 2 x 1,472 + V h + ctx h + 2h = 2,944 + 80 + 32 + 16 = 3,072.
  // Active: 3,072 - 2 blocks x 3 skipped experts x 280 = 1,392.
  ModelConfig m;
  m.arch = Arch::kGpt;
  m.hidden = 8;
  m.layers = 2;
  m.heads = 2;
  m.kv_heads = 2;
  m.ffn = 32;
  m.vocab = 10;
  m.ctx = 4;
  m.experts = 4;
  m.top_k = 1;
  m.moe_ffn = 16;
  EXPECT_EQ(count_params(m), 3072) << "closed form (by hand)";
  EXPECT_EQ(active_params(m), 1392) << "closed form (by hand)";
}

TEST(L01Moe, DenseModelsAreAllActive) {
  // A dense model's every parameter is active; one routed expert is a dense MLP.
  EXPECT_EQ(active_params(preset("llama-7b")), 6738415616LL) << "LLaMA-7B (Touvron et al. 2023)";
  EXPECT_EQ(active_params(preset("gpt2")), 124439808LL) << "GPT-2 small (Hugging Face)";
  ModelConfig one = preset("llama-7b");
  one.experts = 1;
  EXPECT_EQ(count_params(one), 6738415616LL) << "experts 1 is dense";
}

TEST(L01Moe, ExpertParallelismHoldsEOverEpRoutedExperts) {
  // Mixtral 8x7B's routed experts: 32 blocks x 8 x 176,160,768 = 45,097,156,608 parameters;
  // the rest (attention, routers, norms, embeddings) 46,702,792,704 - 45,097,156,608 =
  // 1,605,636,096.
  const ModelConfig m = preset("mixtral-8x7b");
  TrainingSetup setup = mixed_adam();
  Ledger l = compute_ledger(count_params(m), setup, &m);
  EXPECT_DOUBLE_EQ(l.params_per_replica, 46702792704.0) << "ep 1: the whole model";
  EXPECT_DOUBLE_EQ(l.expert_params, 45097156608.0) << "32 x 8 x 176,160,768 routed";
  // ep 8 over dp 8: each GPU holds 1 of each block's 8 experts, 45,097,156,608 / 8 =
  // 5,637,144,576, and the rest whole: 1,605,636,096 + 5,637,144,576 = 7,242,780,672, at 16
  // bytes each without ZeRO: 115,884,490,752 bytes.
  setup.dp = 8;
  setup.ep = 8;
  l = compute_ledger(count_params(m), setup, &m);
  EXPECT_DOUBLE_EQ(l.expert_params, 5637144576.0) << "45,097,156,608 / 8";
  EXPECT_DOUBLE_EQ(l.params_per_replica, 7242780672.0) << "1,605,636,096 + 5,637,144,576";
  EXPECT_DOUBLE_EQ(l.state.total(), 16 * 7242780672.0) << "16 bytes a parameter, no ZeRO";
  // ZeRO-1 over dp 16 with ep 8: the rest's optimizer states shard over all 16 ranks, the
  // experts' over the 16 / 8 = 2 ranks that hold the same experts:
  //   12 x (1,605,636,096 / 16 + 5,637,144,576 / 2) = 12 x (100,352,256 + 2,818,572,288)
  //   = 12 x 2,918,924,544 = 35,027,094,528 bytes; weights and gradients 2 bytes x 7,242,780,672
  //   each.
  setup.dp = 16;
  setup.zero_stage = 1;
  l = compute_ledger(count_params(m), setup, &m);
  EXPECT_DOUBLE_EQ(l.state.optimizer, 35027094528.0) << "12 x (100,352,256 + 2,818,572,288)";
  EXPECT_DOUBLE_EQ(l.state.params, 2 * 7242780672.0);
  EXPECT_DOUBLE_EQ(l.state.grads, 2 * 7242780672.0);
  // ZeRO-3: every state is sharded, and E/ep experts over dp/ep ranks is E/dp of them, the same
  // as without ep: 16 x 46,702,792,704 / 16 = 46,702,792,704 bytes.
  setup.zero_stage = 3;
  l = compute_ledger(count_params(m), setup, &m);
  EXPECT_DOUBLE_EQ(l.state.total(), 46702792704.0) << "ZeRO-3: 16 bytes x P / dp, ep or not";
}

TEST(L01Moe, SharedExpertsStayWholeUnderExpertParallelism) {
  // tiny_moe() (SharedExpertsAndDenseFirstBlocks: 148,928 parameters) with ep 4 over dp 4: its 2
  // MoE blocks' 4 routed experts, 2 x 4 x 6,144 = 49,152 parameters, leave 1 a block on each
  // GPU, 12,288; the shared expert stays whole: 148,928 - 49,152 + 12,288 = 112,064.
  const ModelConfig m = tiny_moe();
  TrainingSetup setup = mixed_adam();
  setup.dp = 4;
  setup.ep = 4;
  Ledger l = compute_ledger(count_params(m), setup, &m);
  EXPECT_DOUBLE_EQ(l.expert_params, 12288.0) << "2 blocks x 4 experts x 6,144 / ep 4";
  EXPECT_DOUBLE_EQ(l.params_per_replica, 112064.0) << "148,928 - 49,152 + 12,288";
  // With 3 pipeline stages each stage holds 1 block; the ledger sizes the heaviest, a MoE
  // block (47,488) with the input embedding (V h = 6,400): 53,888, of which the block's 4
  // routed experts (24,576) are split over ep 2: 53,888 - 24,576 + 12,288 = 41,600.
  setup.pp = 3;
  setup.dp = 2;
  setup.ep = 2;
  l = compute_ledger(count_params(m), setup, &m);
  EXPECT_DOUBLE_EQ(l.expert_params, 12288.0) << "1 block x 4 experts x 6,144 / ep 2";
  EXPECT_DOUBLE_EQ(l.params_per_replica, 41600.0) << "47,488 + 6,400 - 24,576 + 12,288";
}

TEST(L01Moe, ActivationsFollowTheExpertsATokenUses) {
  // A MoE block stores, for each token, the F_e-wide tensors of the k experts it goes through:
  // Mixtral's MLP tensors are those of a 2 x 14,336-wide SwiGLU MLP. The LLaMA closed form of
  // L01Activations.LlamaBlockShape with eager attention, K and V 8 x 128 = 1,024 wide:
  //   8 sbh outside the TP regions + 4 sbh + 4 sb 1024 + 6 sb (2 x 14336) + 2 a s^2 b.
  const ModelConfig m = preset("mixtral-8x7b");
  TrainingSetup setup = mixed_adam();
  setup.attention = Attention::kEager;
  const double s = 2048, b = 1, h = 4096, a = 32;
  const double expected =
      12 * s * b * h + 4 * s * b * 1024 + 6 * s * b * 2 * 14336 + 2 * a * s * s * b;
  EXPECT_CLOSE_REL(activation_bytes_per_layer(m, setup), expected, 1e-12,
                   "closed form: a LLaMA block with a 2 x F_e-wide MLP");
}

// ---------------------------------------------------------------------------------------------
// Given code: presets and validation (these pass on the untouched exercise)
// ---------------------------------------------------------------------------------------------

template <class F>
std::string usage_subject(F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("HINT:"), std::string::npos) << e.what();
    return e.subject();
  }
  return "(no error)";
}

TEST(L01ValidationGiven, UnknownModelListsTheNames) {
  try {
    preset("llama-8b");
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.subject(), "--model");
    EXPECT_NE(std::string(e.what()).find("llama3-8b"), std::string::npos) << e.what();
  }
}

TEST(L01ValidationGiven, ModelShape) {
  ModelConfig m = preset("llama-7b");
  EXPECT_EQ(usage_subject([&] { validate(m); }), "(no error)");
  auto bad = m;
  bad.hidden = 0;
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--hidden");
  bad = m;
  bad.heads = 30;  // 4096 / 30 is not whole
  bad.kv_heads = 30;
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--heads");
  bad = m;
  bad.kv_heads = 5;
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--kv-heads");
  bad = m;
  bad.layers = -1;
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--layers");
}

TEST(L01ValidationGiven, SetupAgainstModel) {
  const ModelConfig m = preset("llama-7b");  // 32 heads, 32 layers
  TrainingSetup s;
  EXPECT_EQ(usage_subject([&] { validate(s, &m); }), "(no error)");
  s.tp = 3;
  EXPECT_EQ(usage_subject([&] { validate(s, &m); }), "--tp");
  s = TrainingSetup{};
  s.zero_stage = 4;
  EXPECT_EQ(usage_subject([&] { validate(s, nullptr); }), "--zero");
  s = TrainingSetup{};
  s.pp = 33;
  EXPECT_EQ(usage_subject([&] { validate(s, &m); }), "--pp");
  s = TrainingSetup{};
  s.dp = 0;
  EXPECT_EQ(usage_subject([&] { validate(s, nullptr); }), "--dp");
  s = TrainingSetup{};
  s.precision = Precision::kFp32;
  s.fp32_grad_accum = true;
  EXPECT_EQ(usage_subject([&] { validate(s, nullptr); }), "--fp32-grad-accum");
}

TEST(L01ValidationGiven, PresetsAreValid) {
  for (const auto& m : presets()) {
    SCOPED_TRACE(m.name);
    EXPECT_EQ(usage_subject([&] { validate(m); }), "(no error)");
  }
  EXPECT_EQ(presets().size(), 16u);
}

TEST(L01ValidationGiven, MixtureOfExperts) {
  const ModelConfig mixtral = preset("mixtral-8x7b");  // 8 experts, top-2
  auto bad = mixtral;
  bad.top_k = 9;
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--top-k");
  bad = mixtral;
  bad.top_k = 0;
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--top-k");
  bad = mixtral;
  bad.experts = -8;
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--experts");
  bad = mixtral;
  bad.first_dense_layers = 33;
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--first-dense-layers");
  bad = preset("llama-7b");
  bad.top_k = 2;  // experts' settings on a dense model
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--experts");
  bad = preset("deepseek-v3");
  bad.kv_lora_rank = 0;
  EXPECT_EQ(usage_subject([&] { validate(bad); }), "--model");
}

TEST(L01ValidationGiven, TensorParallelSplitsEachExpert) {
  const ModelConfig mixtral = preset("mixtral-8x7b");
  TrainingSetup s;
  s.tp = 8;  // 14,336 / 8 expert columns: fine
  EXPECT_EQ(usage_subject([&] { validate(s, &mixtral); }), "(no error)");
  ModelConfig narrow = mixtral;
  narrow.moe_ffn = 100;  // 100 expert columns over tp 8
  EXPECT_EQ(usage_subject([&] { validate(s, &narrow); }), "--tp");
}

TEST(L01ValidationGiven, ExpertParallelism) {
  const ModelConfig mixtral = preset("mixtral-8x7b");
  const ModelConfig dense = preset("llama-7b");
  TrainingSetup s;
  s.dp = 8;
  s.ep = 8;
  EXPECT_EQ(usage_subject([&] { validate(s, &mixtral); }), "(no error)");
  EXPECT_EQ(usage_subject([&] { validate(s, &dense); }), "--ep") << "a dense model has no experts";
  EXPECT_EQ(usage_subject([&] { validate(s, nullptr); }), "--ep") << "a bare count has no experts";
  s.ep = 0;
  EXPECT_EQ(usage_subject([&] { validate(s, &mixtral); }), "--ep");
  s.dp = 6;
  s.ep = 3;  // 8 experts over 3 GPUs
  EXPECT_EQ(usage_subject([&] { validate(s, &mixtral); }), "--ep");
  s.dp = 2;
  s.ep = 4;  // folded over the dp ranks: ep must divide dp
  EXPECT_EQ(usage_subject([&] { validate(s, &mixtral); }), "--ep");
}

}  // namespace
}  // namespace dtc::l01

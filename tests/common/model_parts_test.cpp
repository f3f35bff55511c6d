// dtc::Gpt's swappable parts: a sublayer swapped for a module that computes the same function
// another way keeps the parameter names (so param_digest) and the logits; a swapped attention
// core and given positions are what forward uses. References: the unswapped model on the same
// weights and tokens.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtc/compare.h"
#include "dtc/model.h"
#include "dtc_test.h"

namespace dtc {
namespace {

GptConfig small() {
  return GptConfig{/*vocab=*/32, /*ctx=*/8, /*hidden=*/16, /*layers=*/3, /*heads=*/2};
}

std::vector<std::string> names(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& item : m.named_parameters()) out.push_back(item.key());
  return out;
}

// The MLP written out with matmuls over the same two Linears (registered under their names).
class HandMlpImpl : public torch::nn::Module {
 public:
  explicit HandMlpImpl(const Mlp& full) {
    c_fc = register_module("c_fc", full->c_fc);
    c_proj = register_module("c_proj", full->c_proj);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    auto hidden = torch::gelu(torch::matmul(x, c_fc->weight.t()) + c_fc->bias);
    return torch::matmul(hidden, c_proj->weight.t()) + c_proj->bias;
  }
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
  int calls = 0;
};
TORCH_MODULE(HandMlp);

// The attention as the default computes it, through its own module (as a TP split would be).
class SameAttentionImpl : public torch::nn::Module {
 public:
  explicit SameAttentionImpl(const CausalSelfAttention& full) : inner(full) {
    c_attn = register_module("c_attn", full->c_attn);
    c_proj = register_module("c_proj", full->c_proj);
  }
  torch::Tensor forward(const torch::Tensor& x) { return inner->forward(x); }
  CausalSelfAttention inner;
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(SameAttention);

const torch::Tensor& tokens() {
  static const torch::Tensor t = torch::randint(0, 32, {2, 8}, torch::kLong);
  return t;
}

TEST(GptParts, SwappedSublayersKeepTheNamesTheLogitsAndTheGradients) {
  Gpt plain = make_gpt(small(), 3);
  Gpt swapped = make_gpt(small(), 3);
  std::vector<HandMlp> mlps;
  for (const auto& module : *swapped->h) {
    auto block = module->as<Block>();
    mlps.push_back(HandMlp(block->mlp));
    block->swap_mlp(mlps.back());
    block->swap_attention(SameAttention(block->attn));
    EXPECT_FALSE(block->attn) << "the default's handle is emptied";
    EXPECT_FALSE(block->mlp);
  }
  EXPECT_EQ(names(*swapped), names(*plain)) << "the same names, in the same order";
  const torch::Tensor want = plain->forward(tokens());
  const torch::Tensor got = swapped->forward(tokens());
  for (const HandMlp& m : mlps) EXPECT_EQ(m->calls, 1) << "forward goes through the swapped MLP";
  EXPECT_TENSOR_CLOSE(got, want, kFp32Steps);
  got.sum().backward();
  want.sum().backward();
  const auto a = plain->named_parameters(), b = swapped->named_parameters();
  for (const auto& item : a) {
    const torch::Tensor& g = b[item.key()].grad();
    ASSERT_TRUE(g.defined()) << item.key();
    SCOPED_TRACE(item.key());
    EXPECT_TENSOR_CLOSE(g, item.value().grad(), kFp32Steps);
  }
  EXPECT_THROW(
      swapped->set_recompute(Recompute::kSelective,
                             [](const CheckpointBody& body, const std::vector<torch::Tensor>& in) {
                               return body(in);
                             }),
      c10::Error)
      << "selective recomputation checkpoints the default attention's core";
}

TEST(GptParts, TheAttentionCoreIsSwappable) {
  Gpt model = make_gpt(small(), 3);
  const torch::Tensor want = model->forward(tokens());
  int calls = 0;
  model->set_attention_core(
      [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
        ++calls;
        return CausalSelfAttentionImpl::core(q, k, v);
      });
  EXPECT_TENSOR_CLOSE(model->forward(tokens()), want, kExact);
  EXPECT_EQ(calls, 3) << "one call a block";
  model->set_attention_core([](const torch::Tensor& q, const torch::Tensor&, const torch::Tensor&) {
    return torch::zeros({q.size(0), q.size(2), q.size(1) * q.size(3)}, q.options());
  });
  EXPECT_GT((model->forward(tokens()) - want).abs().max().item<float>(), 1e-4)
      << "an attention that attends to nothing changes the logits";
  model->set_attention_core({});
  SCOPED_TRACE("an undefined core: the default again");
  EXPECT_TENSOR_CLOSE(model->forward(tokens()), want, kExact);
}

TEST(GptParts, GivenPositionsAreThePositionsEmbedded) {
  Gpt model = make_gpt(small(), 3);
  const torch::Tensor want = model->forward(tokens());
  model->set_positions(torch::arange(8, torch::kLong));
  EXPECT_TENSOR_CLOSE(model->forward(tokens()), want, kExact);  // 0..T-1: the default
  // Positions 0..3 for the first four tokens: causal attention makes their logits the same.
  model->set_positions(torch::arange(4, torch::kLong));
  const auto first = tokens().narrow(1, 0, 4);
  EXPECT_TENSOR_CLOSE(model->forward(first), want.narrow(1, 0, 4), kFp32Steps);
  // Shifted by one: the position embedding is read at the given rows.
  model->set_positions(torch::arange(1, 5, torch::kLong));
  EXPECT_GT((model->forward(first) - want.narrow(1, 0, 4)).abs().max().item<float>(), 1e-4);
  model->set_positions(torch::arange(3, torch::kLong));
  EXPECT_THROW(model->forward(first), c10::Error) << "one position per token";
}

// What set_recompute(kSelective) and set_attention_core set lives on the default attention: a swap
// after them would drop it without a word, so it throws; before them it is the swapped module's.
TEST(GptParts, SwappingAfterRecomputeOrACoreThrows) {
  const CheckpointFn through = [](const CheckpointBody& body,
                                  const std::vector<torch::Tensor>& in) { return body(in); };
  Gpt selective = make_gpt(small(), 3);
  selective->set_recompute(Recompute::kSelective, through);
  auto block = selective->h[0]->as<Block>();
  EXPECT_THROW(block->swap_attention(SameAttention(block->attn)), c10::Error);
  Gpt cored = make_gpt(small(), 3);
  cored->set_attention_core(CausalSelfAttentionImpl::core);
  block = cored->h[1]->as<Block>();
  EXPECT_THROW(block->swap_attention(SameAttention(block->attn)), c10::Error);
  Gpt full = make_gpt(small(), 3);  // full recomputation lives on the block: swapping keeps it
  full->set_recompute(Recompute::kFull, through);
  block = full->h[2]->as<Block>();
  EXPECT_NO_THROW(block->swap_attention(SameAttention(block->attn)));
  EXPECT_TRUE(static_cast<bool>(block->checkpoint));
}

// A block built without sublayers lists ln_1 and ln_2 first, then the parts in the order swapped
// in (what model.h says of lesson 08's TpGpt); forward_blocks runs such blocks like any other.
TEST(GptParts, ABlockWithoutSublayersListsItsLayerNormsFirst) {
  Gpt plain = make_gpt(small(), 3);
  auto source = plain->h[0]->as<Block>();
  Block bare(small(), /*sublayers=*/false);
  bare->index = 0;
  torch::nn::ModuleList blocks;
  blocks->push_back(bare);
  EXPECT_THROW(forward_blocks(*blocks, torch::zeros({1, 8, 16})), c10::Error)
      << "parts not swapped in yet";
  bare->swap_attention(SameAttention(source->attn));
  bare->swap_mlp(HandMlp(source->mlp));
  const std::vector<std::string> want = {
      "ln_1.weight",        "ln_1.bias",        "ln_2.weight",        "ln_2.bias",
      "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
      "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
  EXPECT_EQ(names(*bare), want);
  bare->ln_1->weight.data().copy_(source->ln_1->weight);
  bare->ln_2->weight.data().copy_(source->ln_2->weight);
  const torch::Tensor x = torch::randn({2, 8, 16});
  EXPECT_TENSOR_CLOSE(forward_blocks(*blocks, x), source->forward(x), kFp32Steps);
}

}  // namespace
}  // namespace dtc

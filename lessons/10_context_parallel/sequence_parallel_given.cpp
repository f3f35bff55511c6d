// Lesson 10, part 5 (given): the tp x cp GPT of sequence_parallel_given.h.
#include "sequence_parallel_given.h"

#include <fmt/format.h>

#include <string>
#include <vector>

#include "dtc/errors.h"

namespace dtc::l10 {

namespace F = torch::nn::functional;

void validate_sequence_parallel(int64_t seq, int cp, int tp) {
  const int64_t tc = seq / cp;
  if (tc % tp == 0) return;
  throw UsageError(
      "--seq",
      fmt::format("{} tokens a CP rank do not split over tp {} for sequence parallelism", tc, tp),
      fmt::format("choose --seq a multiple of cp x tp = {}", cp * tp));
}

torch::Tensor TpCpParts::enter(const torch::Tensor& x,
                               const l08::ColumnParallelLinear& layer) const {
  if (sequence_parallel) return gather_linear(x, layer->weight, layer->bias, *tp);
  return F::linear(l08::copy_to_tp(x, *tp), layer->weight, layer->bias);  // lesson 08's f
}

torch::Tensor TpCpParts::leave(const torch::Tensor& x, const l08::RowParallelLinear& layer) const {
  const torch::Tensor partial = F::linear(x, layer->weight);  // this rank's share of the sum
  const torch::Tensor y =
      sequence_parallel ? reduce_scatter_sequence(partial, *tp) : l08::reduce_from_tp(partial, *tp);
  return layer->bias.defined() ? y + layer->bias : y;  // the bias once, after the sum
}

TpCpAttentionImpl::TpCpAttentionImpl(const l08::TpAttentionImpl& tp_attention, const TpCpParts& p)
    : c_attn(tp_attention.c_attn),
      c_proj(tp_attention.c_proj),
      local_heads(tp_attention.local_heads),
      parts(p) {
  register_module("c_attn", c_attn);  // the same modules: the same parameters and names
  register_module("c_proj", c_proj);
}

torch::Tensor TpCpAttentionImpl::forward(const torch::Tensor& x) {
  const torch::Tensor qkv = parts.enter(x, c_attn);  // (B, Tc, 3h/tp): every row of the CP rank
  const int64_t B = qkv.size(0), tc = qkv.size(1), C = qkv.size(2) / 3, H = local_heads;
  const int64_t D = C / H;
  auto split = qkv.split(C, /*dim=*/2);
  auto q = split[0].view({B, tc, H, D}).transpose(1, 2);  // (B, h/tp heads, Tc, D)
  auto k = split[1].view({B, tc, H, D}).transpose(1, 2);
  auto v = split[2].view({B, tc, H, D}).transpose(1, 2);
  auto y = context_attention(parts.kind, q, k, v, *parts.cp, parts.zigzag);
  return parts.leave(y.transpose(1, 2).contiguous().view({B, tc, C}), c_proj);
}

TpCpMlpImpl::TpCpMlpImpl(const l08::TpMlpImpl& tp_mlp, const TpCpParts& p)
    : c_fc(tp_mlp.c_fc), c_proj(tp_mlp.c_proj), parts(p) {
  register_module("c_fc", c_fc);
  register_module("c_proj", c_proj);
}

torch::Tensor TpCpMlpImpl::forward(const torch::Tensor& x) {
  return parts.leave(torch::gelu(parts.enter(x, c_fc)), c_proj);
}

TpCpGptImpl::TpCpGptImpl(const Gpt& full, Comm& tp, Comm& cp, Attention kind, bool zigzag,
                         bool sequence_parallel)
    : model(full, tp), parts{&tp, &cp, kind, zigzag, sequence_parallel} {
  const GptConfig& m = full->config();
  validate_cp(m.ctx, m.heads / tp.getSize(), cp.getSize(), kind, zigzag);
  if (sequence_parallel) validate_sequence_parallel(m.ctx, cp.getSize(), tp.getSize());
  for (const auto& module : *model->h) {  // the TP parts, on this CP rank's tokens
    auto* block = module->as<BlockImpl>();
    block->swap_attention(TpCpAttention(block->part<l08::TpAttentionImpl>("attn"), parts));
    block->swap_mlp(TpCpMlp(block->part<l08::TpMlpImpl>("mlp"), parts));
  }
  register_module("model", model);
  positions =
      local_positions(m.ctx, cp.getRank(), cp.getSize(), zigzag).to(full->wte->weight.device());
}

torch::Tensor TpCpGptImpl::loss(const Batch& batch) {
  const GptConfig& m = model->config();
  Comm& tp = *parts.tp;
  const torch::Tensor& tokens = batch.inputs;  // (B, Tc): this CP rank's tokens
  const int64_t tc = tokens.size(1);
  TORCH_CHECK(tc == positions.size(0), "TpCpGpt: ", tc, " tokens a sequence, expected ",
              positions.size(0));
  // The embedding: each TP rank looks up the tokens of its vocabulary rows (lesson 08).
  auto& wte = model->wte;
  const auto mine = (tokens >= wte->vocab_begin).logical_and(tokens < wte->vocab_end);
  const auto local = (tokens - wte->vocab_begin).masked_fill(mine.logical_not(), 0);
  const auto rows =
      F::embedding(local, wte->weight).masked_fill(mine.logical_not().unsqueeze(-1), 0.0);
  torch::Tensor x, pos = positions;
  if (parts.sequence_parallel) {  // the sum, and this TP rank's rows of it
    x = reduce_scatter_sequence(rows, tp);
    pos = positions.narrow(0, tp.getRank() * (tc / tp.getSize()), tc / tp.getSize());
  } else {
    x = l08::reduce_from_tp(rows, tp);
  }
  x = x + model->wpe(pos);  // (B, Tc/tp or Tc, h)
  x = forward_blocks(*model->h, x);
  x = model->ln_f(x);
  const torch::Tensor& w = m.tied ? wte->weight : model->lm_head;  // (Vp/tp, h)
  const torch::Tensor logits = parts.sequence_parallel
                                   ? gather_linear(x, w, torch::Tensor(), tp)
                                   : F::linear(l08::copy_to_tp(x, tp), w);  // (B, Tc, Vp/tp)
  const torch::Tensor flat = logits.to(torch::kFloat).reshape({-1, logits.size(-1)});
  const int64_t first = tp.getRank() * logits.size(-1);
  return l08::vocab_parallel_cross_entropy(flat, batch.targets.reshape({-1}), first, tp, m.vocab) /
         static_cast<double>(parts.cp->getSize());
}

std::vector<torch::Tensor> TpCpGptImpl::replicated_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    const bool split = name.find("c_attn") != std::string::npos ||
                       name.find("c_fc") != std::string::npos ||
                       name.find("c_proj.weight") != std::string::npos ||
                       name.rfind("wte", 0) == 0 || name == "lm_head";
    if (!split) out.push_back(item.value());
  }
  return out;
}

void TpCpGptImpl::reduce_replicated_gradients() {
  if (!parts.sequence_parallel || parts.tp->getSize() == 1) return;
  for (auto& p : replicated_parameters()) {
    if (!p.grad().defined()) continue;
    std::vector<torch::Tensor> g{p.mutable_grad()};
    parts.tp->allreduce(g)->wait();
  }
}

}  // namespace dtc::l10

// Lesson 10, part 5: sequence parallelism. Implements
// lessons/10_context_parallel/sequence_parallel.h.
//
// Fill in the TODO(L10) regions below; `make test-lesson10` checks each operator against the
// gathered computation on 2 and 4 thread-ranks (L10SeqPar.*), then tp x cp training runs
// against the single-process baseline.
#include "sequence_parallel.h"

#include <fmt/format.h>

#include <string>
#include <vector>

#include "dtc/errors.h"
#include "dtc/todo.h"

namespace dtc::l10 {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

Comm& comm_of(const AutogradContext* ctx) { return comm_from(ctx->saved_data.at("comm").toInt()); }

// ---------------------------------------------------------------------------------------------
// Part 5: sequence parallelism's two operators
// ---------------------------------------------------------------------------------------------

// (B, T, ...) partial sums on every TP rank -> rows [t T/tp, (t+1) T/tp) of their sum.
torch::Tensor reduce_scatter_rows(const torch::Tensor& x, Comm& tp) {
  // BEGIN SOLUTION: rank t gets rows [t T/tp, (t+1) T/tp) of the sum over the TP ranks of x,
  //   (B, T/tp, ...), with one alltoall (L10SeqPar.ReduceScatter*; README section 9 hints)
  const int n = tp.getSize();
  const auto shape = x.sizes().vec();
  std::vector<int64_t> split = {shape[0], n, shape[1] / n};  // (B, tp, T/tp, ...)
  split.insert(split.end(), shape.begin() + 2, shape.end());
  std::vector<int64_t> order(split.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::swap(order[0], order[1]);  // slice j, the rows of rank j, first
  const torch::Tensor got = all_to_all(x.reshape(split).permute(order), tp);  // j: rank j's part
  return got.sum(0);
  // END SOLUTION
}

// (B, T/tp, ...) on every TP rank -> (B, T, ...): rank j's rows at [j T/tp, (j+1) T/tp).
torch::Tensor all_gather_rows(const torch::Tensor& x, Comm& tp) {
  // BEGIN SOLUTION: every TP rank's rows in rank order along dimension 1, with one allgather
  //   (L10SeqPar.*; README section 9 hints)
  std::vector<torch::Tensor> input{x.contiguous()};
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int j = 0; j < tp.getSize(); ++j) output[0].push_back(torch::empty_like(input[0]));
  tp.allgather(output, input)->wait();
  return torch::cat(output[0], /*dim=*/1);
  // END SOLUTION
}

// g-bar: forward reduce-scatter, backward all-gather (given).
struct ReduceScatterSequenceFn : public torch::autograd::Function<ReduceScatterSequenceFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return reduce_scatter_rows(x, comm_from(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_rows(grads[0], comm_of(ctx)), torch::Tensor()};
  }
};

// g (forward all-gather, backward reduce-scatter) and the column-parallel Linear in one,
// saving only this rank's rows.
struct GatherLinearFn : public torch::autograd::Function<GatherLinearFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               int64_t comm) {
    ctx->saved_data["comm"] = comm;
    const bool has_bias = bias.numel() > 0;  // no bias: an empty tensor (see gather_linear)
    ctx->saved_data["bias"] = has_bias;
    [[maybe_unused]] Comm& tp = comm_from(comm);
    // BEGIN SOLUTION: the Linear of every TP rank's rows gathered along the sequence; save only
    //   this rank's rows (and the weight) for backward (L10SeqPar.GatherLinear*; README section 9
    //   hints)
    ctx->save_for_backward({x, weight});  // the shard, not the gathered copy
    return F::linear(all_gather_rows(x, tp), weight, has_bias ? bias : torch::Tensor());
    // END SOLUTION
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    [[maybe_unused]] Comm& tp = comm_of(ctx);
    [[maybe_unused]] const bool has_bias = ctx->saved_data["bias"].toBool();
    const torch::Tensor dy = grads[0];  // (B, T, out/tp)
    torch::Tensor dx, dweight, dbias;
    // BEGIN SOLUTION: gather the rows again; dX = dY W summed over the TP ranks onto this rank's
    //   rows; dW = dY^T X and db over every row (L10SeqPar.GatherLinear*; README section 9 hints)
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor full = all_gather_rows(saved[0], tp);  // (B, T, in), again
    dx = reduce_scatter_rows(dy.matmul(saved[1]), tp);  // each rank holds some output features
    const auto dy2 = dy.reshape({-1, dy.size(-1)});
    dweight = dy2.t().matmul(full.reshape({-1, full.size(-1)}));
    if (has_bias) dbias = dy2.sum(0);
    // END SOLUTION
    return {dx, dweight, dbias, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, Comm& tp) {
  if (x.dim() < 2 || x.size(1) % tp.getSize() != 0) {
    throw std::invalid_argument(
        fmt::format("reduce_scatter_sequence: {} rows do not split over tp {}",
                    x.dim() < 2 ? 0 : x.size(1), tp.getSize()));
  }
  return ReduceScatterSequenceFn::apply(x, comm_handle(tp));
}

torch::Tensor gather_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const torch::Tensor& bias, Comm& tp) {
  // An autograd function's inputs must be defined tensors: no bias travels as an empty one.
  return GatherLinearFn::apply(
      x, weight, bias.defined() ? bias : torch::empty({0}, weight.options()), comm_handle(tp));
}

// ---------------------------------------------------------------------------------------------
// The tp x cp GPT
// ---------------------------------------------------------------------------------------------

void validate_sequence_parallel(int64_t seq, int cp, int tp) {
  const int64_t tc = seq / cp;
  if (tc % tp == 0) return;
  throw UsageError(
      "--seq",
      fmt::format("{} tokens a CP rank do not split over tp {} for sequence parallelism", tc, tp),
      fmt::format("choose --seq a multiple of cp x tp = {}", cp * tp));
}

TpCpGptImpl::TpCpGptImpl(const Gpt& full, Comm& t, Comm& c, Attention k, bool zz, bool sp)
    : model(full, t), tp(&t), cp(&c), kind(k), zigzag(zz), sequence_parallel(sp) {
  const GptConfig& m = full->config();
  validate_cp(m.ctx, m.heads / t.getSize(), c.getSize(), kind, zigzag);
  if (sp) validate_sequence_parallel(m.ctx, c.getSize(), t.getSize());
  register_module("model", model);
  positions =
      local_positions(m.ctx, c.getRank(), c.getSize(), zigzag).to(full->wte->weight.device());
}

torch::Tensor TpCpGptImpl::enter(const torch::Tensor& x, const l08::ColumnParallelLinear& layer) {
  if (sequence_parallel) return gather_linear(x, layer->weight, layer->bias, *tp);
  return F::linear(l08::copy_to_tp(x, *tp), layer->weight, layer->bias);  // lesson 08's f
}

torch::Tensor TpCpGptImpl::leave(const torch::Tensor& x, const l08::RowParallelLinear& layer) {
  const torch::Tensor partial = F::linear(x, layer->weight);  // this rank's share of the sum
  const torch::Tensor y =
      sequence_parallel ? reduce_scatter_sequence(partial, *tp) : l08::reduce_from_tp(partial, *tp);
  return layer->bias.defined() ? y + layer->bias : y;  // the bias once, after the sum
}

torch::Tensor TpCpGptImpl::loss(const Batch& batch) {
  const GptConfig& m = model->config();
  const torch::Tensor& tokens = batch.inputs;  // (B, Tc): this CP rank's tokens
  const int64_t B = tokens.size(0), tc = tokens.size(1);
  TORCH_CHECK(tc == positions.size(0), "TpCpGpt: ", tc, " tokens a sequence, expected ",
              positions.size(0));
  // The embedding: each TP rank looks up the tokens of its vocabulary rows (lesson 08).
  auto& wte = model->wte;
  const auto mine = (tokens >= wte->vocab_begin).logical_and(tokens < wte->vocab_end);
  const auto local = (tokens - wte->vocab_begin).masked_fill(mine.logical_not(), 0);
  const auto rows =
      F::embedding(local, wte->weight).masked_fill(mine.logical_not().unsqueeze(-1), 0.0);
  torch::Tensor x, pos = positions;
  if (sequence_parallel) {  // the sum, and this TP rank's rows of it
    x = reduce_scatter_sequence(rows, *tp);
    pos = positions.narrow(0, tp->getRank() * (tc / tp->getSize()), tc / tp->getSize());
  } else {
    x = l08::reduce_from_tp(rows, *tp);
  }
  x = x + model->wpe(pos);  // (B, Tc/tp or Tc, h)
  for (const auto& module : *model->h) {
    auto* block = module->as<BlockImpl>();
    const auto& attn = block->part<l08::TpAttentionImpl>("attn");
    const torch::Tensor qkv = enter(block->ln_1(x), attn.c_attn);  // (B, Tc, 3h/tp), every row
    const int64_t C = qkv.size(2) / 3, H = attn.local_heads, D = C / H;
    auto parts = qkv.split(C, /*dim=*/2);
    auto q = parts[0].view({B, tc, H, D}).transpose(1, 2);  // (B, h/tp heads, Tc, D)
    auto k = parts[1].view({B, tc, H, D}).transpose(1, 2);
    auto v = parts[2].view({B, tc, H, D}).transpose(1, 2);
    auto y = context_attention(kind, q, k, v, *cp, zigzag);
    x = x + leave(y.transpose(1, 2).contiguous().view({B, tc, C}), attn.c_proj);
    const auto& mlp = block->part<l08::TpMlpImpl>("mlp");
    x = x + leave(torch::gelu(enter(block->ln_2(x), mlp.c_fc)), mlp.c_proj);
  }
  x = model->ln_f(x);
  const torch::Tensor& w = m.tied ? wte->weight : model->lm_head;  // (Vp/tp, h)
  const torch::Tensor logits = sequence_parallel
                                   ? gather_linear(x, w, torch::Tensor(), *tp)
                                   : F::linear(l08::copy_to_tp(x, *tp), w);  // (B, Tc, Vp/tp)
  const torch::Tensor flat = logits.to(torch::kFloat).reshape({-1, logits.size(-1)});
  const int64_t first = tp->getRank() * logits.size(-1);
  return l08::vocab_parallel_cross_entropy(flat, batch.targets.reshape({-1}), first, *tp, m.vocab) /
         static_cast<double>(cp->getSize());
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
  if (!sequence_parallel || tp->getSize() == 1) return;
  for (auto& p : replicated_parameters()) {
    if (!p.grad().defined()) continue;
    std::vector<torch::Tensor> g{p.mutable_grad()};
    tp->allreduce(g)->wait();
  }
}

}  // namespace dtc::l10

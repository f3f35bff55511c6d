// Lesson 08 (given): the checks and slices, the parallel layers' constructors, the overlapped
// input-gradient Linear, and the tensor-parallel GPT around your modules. Your part is in
// tensor_parallel.cpp; both implement tensor_parallel.h.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "dtc/errors.h"
#include "tensor_parallel.h"

namespace dtc::l08 {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---------------------------------------------------------------------------------------------
// Given: checks, slices and an in-place allreduce
// ---------------------------------------------------------------------------------------------

void validate_tp(const GptConfig& m, int tp) {
  if (tp < 1) {
    throw UsageError("--tp", fmt::format("is {}, but must be at least 1", tp),
                     "pass the number of ranks that split each layer, e.g. --tp 2");
  }
  // What tp must divide, and why: every split is into equal slices.
  const std::vector<std::pair<int64_t, const char*>> sizes = {
      {m.hidden, "the hidden size (--hidden)"},
      {m.heads, "the attention heads (--heads): each rank owns whole heads"},
      {m.ffn(), "the MLP width 4h"},
  };
  for (const auto& [size, what] : sizes) {
    if (size % tp == 0) continue;
    std::string fits;
    for (int t = 1; t <= 64; ++t) {
      if (m.hidden % t == 0 && m.heads % t == 0 && m.ffn() % t == 0) {
        fits += (fits.empty() ? "" : ", ") + std::to_string(t);
      }
    }
    throw UsageError("--tp", fmt::format("{} does not divide {} = {}", tp, what, size),
                     fmt::format("use a tp that divides hidden, heads and 4h: {} here "
                                 "(and --dp so that dp x tp = the world size)",
                                 fits));
  }
}

torch::Tensor shard(const torch::Tensor& full, int64_t dim, int rank, int parts) {
  const int64_t n = full.size(dim);
  if (parts < 1 || n % parts != 0 || rank < 0 || rank >= parts) {
    throw std::invalid_argument(
        fmt::format("shard: cannot take slice {} of {} from a size of {}", rank, parts, n));
  }
  const int64_t len = n / parts;
  return full.narrow(dim, rank * len, len).detach().clone().contiguous();
}

int64_t padded_vocab(int64_t vocab, int tp) { return (vocab + tp - 1) / tp * tp; }

torch::Tensor shard_padded_rows(const torch::Tensor& full, int rank, int parts) {
  const int64_t rows = full.size(0);
  const int64_t padded = padded_vocab(rows, parts);
  if (padded == rows) return shard(full, 0, rank, parts);
  std::vector<int64_t> shape = full.sizes().vec();
  shape[0] = padded - rows;
  return shard(torch::cat({full.detach(), torch::zeros(shape, full.options())}), 0, rank, parts);
}

void allreduce_(torch::Tensor& t, Comm& comm, c10d::ReduceOp op) {
  std::vector<torch::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  comm.allreduce(tensors, options)->wait();
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& full, Comm& tp)
    : ColumnParallelLinearImpl(
          shard(full->weight, 0, tp.getRank(), tp.getSize()),
          full->bias.defined() ? shard(full->bias, 0, tp.getRank(), tp.getSize()) : torch::Tensor(),
          tp) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::Tensor& w, const torch::Tensor& b,
                                                   Comm& comm)
    : tp(&comm) {
  weight = register_parameter("weight", w.detach().clone());
  if (b.defined()) bias = register_parameter("bias", b.detach().clone());
}

namespace {

// linear_async_dgrad's autograd function (given).
struct LinearAsyncDgrad : public torch::autograd::Function<LinearAsyncDgrad> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               int64_t comm) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["bias"] = bias.defined();
    return F::linear(x, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& weight = saved[1];
    const torch::Tensor g = grad_outputs[0];  // (..., out/tp)
    // 1. dX = dY W, this rank's share of the input gradient: start its sum over the TP group.
    std::vector<torch::Tensor> dgrad{g.matmul(weight)};  // (..., in)
    auto work = comm_of(ctx).allreduce(dgrad);
    // 2. While it runs: dW = dY^T X and db, which do not need it.
    const auto g2 = g.reshape({-1, g.size(-1)});
    const torch::Tensor dweight = g2.t().matmul(x.reshape({-1, x.size(-1)}));
    const torch::Tensor dbias = ctx->saved_data["bias"].toBool() ? g2.sum(0) : torch::Tensor();
    // 3. Then the input gradient is complete.
    work->wait();
    return {dgrad[0], dweight, dbias, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor linear_async_dgrad(const torch::Tensor& x, const torch::Tensor& weight,
                                 const torch::Tensor& bias, Comm& tp) {
  return LinearAsyncDgrad::apply(x, weight, bias, comm_handle(tp));
}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& full, Comm& comm)
    : tp(&comm) {
  weight = register_parameter("weight", shard(full->weight, 1, comm.getRank(), comm.getSize()));
  if (full->bias.defined()) bias = register_parameter("bias", full->bias.detach().clone());
}

TpMlpImpl::TpMlpImpl(const Mlp& full, Comm& tp) {
  c_fc = register_module("c_fc", ColumnParallelLinear(full->c_fc, tp));
  c_proj = register_module("c_proj", RowParallelLinear(full->c_proj, tp));
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, Comm& comm)
    : tp(&comm) {
  const int64_t vocab = full->weight.size(0);
  weight =
      register_parameter("weight", shard_padded_rows(full->weight, comm.getRank(), comm.getSize()));
  vocab_begin = std::min(comm.getRank() * weight.size(0), vocab);
  vocab_end = std::min(vocab_begin + weight.size(0), vocab);  // the padding rows excluded
}

TpGptImpl::TpGptImpl(const Gpt& full, Comm& comm) : tp(&comm), config_(full->config()) {
  validate_tp(config_, comm.getSize());
  wte = register_module("wte", VocabParallelEmbedding(full->wte, comm));
  wpe = register_module("wpe", torch::nn::Embedding(config_.ctx, config_.hidden));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.layers; ++i) {
    // The course's block, its LayerNorms copied (replicated on every TP rank), its attention
    // and MLP swapped for this rank's slices of the full block's.
    const Block whole(std::dynamic_pointer_cast<BlockImpl>(full->h->ptr(i)));
    Block block(config_, /*sublayers=*/false);
    block->index = i;
    {
      torch::NoGradGuard no_grad;
      block->ln_1->weight.copy_(whole->ln_1->weight);
      block->ln_1->bias.copy_(whole->ln_1->bias);
      block->ln_2->weight.copy_(whole->ln_2->weight);
      block->ln_2->bias.copy_(whole->ln_2->bias);
    }
    block->swap_attention(TpAttention(whole->attn, config_.heads, comm));
    block->swap_mlp(TpMlp(whole->mlp, comm));
    h->push_back(block);
  }
  ln_f =
      register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config_.hidden})));
  torch::NoGradGuard no_grad;
  wpe->weight.copy_(full->wpe->weight);
  ln_f->weight.copy_(full->ln_f->weight);
  ln_f->bias.copy_(full->ln_f->bias);
  if (!config_.tied) {
    lm_head = register_parameter(
        "lm_head", shard_padded_rows(full->lm_head->weight, comm.getRank(), comm.getSize()));
  }
  to(full->wte->weight.device());
}

void TpGptImpl::set_overlap_dgrad(bool on) {
  for (const auto& module : *h) {
    auto* block = module->as<BlockImpl>();
    block->part<TpAttentionImpl>("attn").c_attn->overlap_dgrad = on;
    block->part<TpMlpImpl>("mlp").c_fc->overlap_dgrad = on;
  }
}

torch::Tensor TpGptImpl::loss(const Batch& batch) {
  auto logits = forward(batch.inputs).to(torch::kFloat);  // (B, T, V/tp); bf16: the loss in fp32
  const int64_t first = tp->getRank() * logits.size(-1);  // this rank's first column's id
  return vocab_parallel_cross_entropy(logits.view({-1, logits.size(-1)}),
                                      batch.targets.reshape({-1}), first, *tp, config_.vocab);
}

}  // namespace dtc::l08

// Lesson 07: ZeRO stages 1-3. Implements lessons/07_zero/zero.h, with zero_given.cpp (the
// layout, the engine's bookkeeping, checkpoints: given).
//
// Fill in every TODO(L07) below, top to bottom; `make test-lesson07` checks each piece on 2 and
// 3 thread-ranks against closed forms and against plain single-process AdamW training. Then
// run the program on real processes and compare the stages' memory:
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson07 --stage 3
#include "zero.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <map>
#include <stdexcept>

#include "dtc/errors.h"
#include "dtc/todo.h"

namespace dtc::l07 {

// =============================================================================================
// Part 1: the flat, padded layout
// =============================================================================================

int64_t padded_size(int64_t numel, int world) {
  if (world < 1) throw std::invalid_argument("padded_size: world must be at least 1");
  if (numel < 0) throw std::invalid_argument("padded_size: numel must not be negative");
  // TODO(L07)
  DTC_TODO("L07",
           "the smallest multiple of world that is not below numel; 0 stays 0 "
           "(L07Layout.PaddedSizeClosedForm)");
}

// =============================================================================================
// Part 2: collectives that count their bytes
// =============================================================================================
// LibTorch 1.13's gloo has no reduce_scatter and no _allgather_base, so the course builds them
// from what every gloo has: alltoall_base (a reduce-scatter is "send chunk j to rank j, then add
// up what you received": the same bytes on the wire as a ring reduce-scatter) and the list form
// of allgather. Bytes are counted by the ring's definition (lesson 03), so that they compare
// with the ZeRO paper's volumes whatever gloo does inside.

Pending CountingComm::reduce_scatter_start(const torch::Tensor& flat) {
  const int w = world();
  TORCH_CHECK(flat.dim() == 1 && flat.numel() % w == 0,
              "reduce_scatter: a flat buffer of a multiple of W elements, got ", flat.sizes());
  Pending pending;
  pending.chunk = flat.numel() / w;
  // TODO(L07)
  DTC_TODO("L07",
           "start, without waiting, one collective after which pending.buffer, seen as "
           "(W, chunk), holds rank j's chunk r of its flat in row j; add the ring's (W-1) * "
           "chunk * e "
           "bytes, e the element size (L07Comm.ReduceScatter*; calls and hints: README section "
           "8)");
  return pending;
}

torch::Tensor CountingComm::reduce_scatter_finish(Pending& pending) {
  // TODO(L07)
  DTC_TODO("L07",
           "once the collective is done, return chunk r summed over the W ranks, (chunk) "
           "(empty when chunk is 0), and leave pending empty so that its buffer is freed "
           "(L07Comm.ReduceScatter*; hints: README section 8)");
}

Pending CountingComm::all_gather_start(const torch::Tensor& chunk) {
  Pending pending;
  pending.chunk = chunk.numel();
  // TODO(L07)
  DTC_TODO("L07",
           "start, without waiting, one collective that writes rank j's chunk straight "
           "into [j * chunk, (j + 1) * chunk) of a new pending.buffer (W * chunk); add (W-1) * "
           "chunk * e "
           "bytes, e the element size (L07Comm.AllGather*; calls and hints: README section 8)");
  return pending;
}

void CountingComm::all_reduce(torch::Tensor& flat) {
  // TODO(L07)
  DTC_TODO("L07",
           "on return flat holds, in place, its sum over the ranks; add the ring's "
           "2 (W-1) * (numel / W) * e bytes, e the element size (L07Comm.AllReduce*; calls: "
           "README "
           "section 8)");
}

// =============================================================================================
// Part 3: AdamW, elementwise
// =============================================================================================

void adamw_update(torch::Tensor param, const torch::Tensor& grad, torch::Tensor exp_avg,
                  torch::Tensor exp_avg_sq, int64_t step, const AdamWOptions& o) {
  torch::NoGradGuard no_grad;
  // TODO(L07)
  DTC_TODO("L07",
           "one torch::optim::AdamW step (the header's lines, in their order), in "
           "place on param and both moments and elementwise, so that shards update like the "
           "whole "
           "(L07AdamW.*; hints: README section 8)");
}

// =============================================================================================
// Part 4: the engine
// =============================================================================================

namespace {

// x (B, T, h) from tokens (B, T): token plus position embeddings (dtc/model.h, GptImpl::forward).
torch::Tensor embed(Gpt& model, const torch::Tensor& tokens) {
  auto pos = torch::arange(tokens.size(1), torch::dtype(torch::kLong).device(tokens.device()));
  return model->wte(tokens) + model->wpe(pos);
}

// The mean next-token loss from the last block's output x (B, T, h): ln_f, the head, softmax.
torch::Tensor head_loss(Gpt& model, const torch::Tensor& x, const torch::Tensor& targets) {
  auto y = model->ln_f(x);
  auto logits = model->config().tied ? torch::matmul(y, model->wte->weight.t())
                                     : model->lm_head(y);  // (B, T, V)
  logits = logits.to(torch::kFloat);  // the loss in fp32, as GptImpl::forward (bf16: a cast)
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}),
                                              targets.view({-1}));
}

// Makes every parameter's gradient a view of @p grads (the unit's padded gradient buffer), so
// that backward accumulates straight into it (PyTorch DDP's gradient_as_bucket_view).
void bind_grads(const Unit& unit, const torch::Tensor& grads, int64_t base) {
  int64_t off = base;
  for (size_t k = 0; k < unit.params.size(); ++k) {
    auto p = unit.params[k];
    const int64_t numel = c10::multiply_integers(unit.shapes[k]);
    p.mutable_grad() = grads.narrow(0, off, numel).view(unit.shapes[k]);
    off += numel;
  }
}

void unbind_grads(const Unit& unit) {
  for (auto p : unit.params) p.mutable_grad().reset();
}

}  // namespace

float ZeroEngine::forward_backward_replicated(const Batch& batch) {
  // The full gradient buffer in the reduce dtype, made on the first step. In the working dtype
  // every parameter's grad is a view of it; in a wider one (bf16 parameters, fp32 reduce:
  // Megatron's main_grad) a hook adds each parameter's gradient into its view as autograd
  // writes it.
  if (!flat_grads_.defined()) {
    flat_grads_ = torch::zeros({layout_.padded}, reduce_options_);
    if (reduce_options_.dtype() == param_options_.dtype()) {
      for (const Unit& unit : layout_.units) bind_grads(unit, flat_grads_, unit.offset);
    } else {
      for (const Unit& unit : layout_.units) {
        int64_t off = unit.offset;
        for (size_t k = 0; k < unit.params.size(); ++k) {
          const int64_t numel = c10::multiply_integers(unit.shapes[k]);
          auto main_grad = flat_grads_.narrow(0, off, numel).view(unit.shapes[k]);
          main_grad_hooks_.push_back(take_each_gradient(
              unit.params[k], [main_grad](const torch::Tensor& g) { main_grad.add_(g); }));
          off += numel;
        }
      }
    }
  } else {
    flat_grads_.zero_();
  }
  auto loss = head_loss(
      model_,
      [&] {
        auto x = embed(model_, batch.inputs);
        for (size_t i = 0; i < model_->h->size(); ++i)
          x = model_->h[i]->as<BlockImpl>()->forward(x);
        return x;
      }(),
      batch.targets);
  loss.backward();
  const float value = loss.item<float>();
  torch::NoGradGuard no_grad;
  // TODO(L07)
  DTC_TODO("L07",
           "the mean gradient over ranks, where this stage reads it: stage 0 all of "
           "flat_grads_ (one allreduce); stage 1 this rank's chunk of each unit, sending only "
           "what "
           "reduce-scatters send (L07Stages.*; hints: README sections 4 and 8)");
  return value;
}

float ZeroEngine::forward_backward_sharded(const Batch& batch) {
  const bool stage3 = options_.stage == 3;
  const size_t blocks = model_->h->size();
  if (!grad_shard_.defined()) grad_shard_ = torch::zeros({layout_.shard}, reduce_options_);
  Unit& outer = layout_.units[0];
  auto gather = [&](size_t u) {
    return comm_.all_gather_start(chunk_of_shard(param_shard_, layout_.units[u]));
  };

  // The outer unit (embeddings, final norm, head) is used first and last: stage 3 gathers it
  // once and keeps it for the whole step (as FSDP does with its root). Its gradient buffer lives
  // through backward, since the head's and the embedding's gradients both land in it (tied).
  if (stage3) {
    Pending p = gather(0);
    bind_unit(outer, CountingComm::all_gather_finish(p));
  }
  auto outer_grads = grad_buffer(outer);
  bind_grads(outer, outer_grads, 0);
  auto x0 = embed(model_, batch.inputs);  // (B, T, h), with the graph back to wte and wpe

  // Forward, block by block. Each block starts from a detached copy of its input, so that
  // backward can be run one block at a time (and its gradients reduced right after).
  // Stage 3 without recompute keeps each block's gathered buffer (emptied) in gathered[i].
  std::vector<torch::Tensor> inputs(blocks), outputs(blocks), gathered(blocks);
  torch::Tensor x = x0.detach();
  // TODO(L07)
  DTC_TODO("L07",
           "the blocks' forward, one block at a time, keeping in inputs / outputs what "
           "backward will need: each block's graph from a detached input (stage 2, and stage 3 "
           "whose "
           "gathered parameters are freed, not released, once the block has run); with recompute "
           "only each block's input. A block's gathered parameters live only while it runs (with "
           "--prefetch, the next gather overlaps the block). Tests: L07Stages.*, L07Memory.*; "
           "hints: "
           "README section 8");

  auto last = x.detach().requires_grad_();
  auto loss = head_loss(model_, last, batch.targets);
  loss.backward();  // the head's gradients (into outer_grads), and d loss / d last
  const float value = loss.item<float>();
  loss = torch::Tensor();
  torch::Tensor g = last.grad();  // (B, T, h)
  last = torch::Tensor();

  // Backward, block by block, last block first. A unit's gradient buffer is reduce-scattered
  // as soon as its block is done (the Work runs while the next block computes) and freed.
  Pending reducing;
  size_t reducing_unit = 0;
  // TODO(L07)
  DTC_TODO("L07",
           "the blocks' backward, last block first, each into a zeroed gradient buffer "
           "of its own that is reduce-scattered while the next block runs backward, then freed "
           "(stage "
           "3 gathers each block again: into the storage its saved activations still view, or, "
           "with "
           "recompute, to recompute it from its input). On exit g is the gradient into block 0's "
           "input, and the last reduce-scatter is still in flight in reducing / reducing_unit "
           "(finished below). Tests: L07Stages.*, L07Memory.*; hints: README section 8");
  x0.backward(g);  // the embeddings' gradients, added to the head's in outer_grads (tied wte)
  x0 = torch::Tensor();
  g = torch::Tensor();
  torch::NoGradGuard no_grad;
  reduce_unit_gradient(reducing, layout_.units[reducing_unit]);
  unbind_grads(outer);
  Pending p = reduce_start(outer_grads);
  outer_grads = torch::Tensor();
  reduce_unit_gradient(p, outer);
  if (stage3) release_unit(outer);
  return value;
}

double ZeroEngine::clip_gradients(double max_norm) {
  torch::NoGradGuard no_grad;
  // What this rank owns of the averaged gradient: stage 0 all of it, stage 1 its chunk of each
  // unit in the full buffer, stages 2-3 its shard (padding is zeros: it adds nothing).
  std::vector<torch::Tensor> owned;
  if (options_.stage == 0) {
    owned.push_back(flat_grads_);
  } else if (options_.stage == 1) {
    for (const Unit& unit : layout_.units) owned.push_back(chunk_of_full(flat_grads_, unit));
  } else {
    owned.push_back(grad_shard_);
  }
  double norm = 0;
  // TODO(L07)
  DTC_TODO("L07",
           "scale every owned gradient by min(1, max_norm / (norm + 1e-6)), where norm "
           "is the 2-norm of the WHOLE averaged gradient, as torch::nn::utils::clip_grad_norm_ "
           "computes "
           "it on one process; return norm (L07Clip.*; hints: README section 8)");
  return norm;
}

void ZeroEngine::optimizer_step() {
  torch::NoGradGuard no_grad;
  ensure_moments();
  if (options_.clip_norm > 0) last_grad_norm_ = clip_gradients(options_.clip_norm);
  ++step_;
  // TODO(L07)
  DTC_TODO("L07",
           "adamw_update on exactly what this rank owns (stage 0: everything; 1-3: its "
           "chunk of each unit, with the moments' (and master_'s) matching chunk), through "
           "update(); "
           "then stages 1-2 hold every updated parameter in flat_params_ again, sending only "
           "what an "
           "all-gather sends (Psi) (L07Stages.*, L07Bf16.*; hints: README sections 4 and 8)");
}

// =============================================================================================
// Part 5: sharded checkpoints
// =============================================================================================

torch::Tensor read_unit_range(const FlatLayout& layout, size_t unit, int64_t begin, int64_t end,
                              int saved_world,
                              const std::function<torch::Tensor(int file)>& shard_of) {
  if (unit >= layout.units.size() || saved_world < 1 || begin < 0 || begin > end ||
      end > layout.units[unit].numel) {
    throw std::invalid_argument(fmt::format(
        "read_unit_range: unit {} of {}, range [{}, {}), saved by {} ranks: out of bounds", unit,
        layout.units.size(), begin, end, saved_world));
  }
  std::vector<torch::Tensor> parts;  // [begin, end), in order
  // TODO(L07)
  DTC_TODO("L07",
           "the pieces of [begin, end) in order, each narrowed from the file whose "
           "N-rank chunk of the unit holds it, asking shard_of only for files that hold a piece "
           "(L07Checkpoint.*; hints: README sections 6 and 8)");
  if (parts.empty()) return torch::empty({0}, torch::kFloat);
  return torch::cat(parts);
}

}  // namespace dtc::l07
// generated from solutions/07_zero/zero.cpp; checksum 32230f8d4a14257d

// Lesson 07: ZeRO stages 1-3. Implements lessons/07_zero/zero.h.
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
  // BEGIN SOLUTION: the smallest multiple of world that is not below numel; 0 stays 0
  //   (L07Layout.PaddedSizeClosedForm)
  return (numel + world - 1) / world * world;
  // END SOLUTION
}

FlatLayout make_layout(Gpt& model, int world) {
  FlatLayout layout;
  layout.world = world;
  const int64_t blocks = static_cast<int64_t>(model->h->size());
  layout.units.resize(static_cast<size_t>(1 + blocks));
  layout.units[0].name = "outer";
  for (int64_t i = 0; i < blocks; ++i)
    layout.units[static_cast<size_t>(1 + i)].name = fmt::format("h.{}", i);
  // named_parameters(): wte, wpe, h.<i>.*, ln_f.*, lm_head (untied only). Tied: the head is
  // wte itself, listed once, so it is stored, gathered and updated once.
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    size_t u = 0;
    if (name.rfind("h.", 0) == 0) u = 1 + std::stoul(name.substr(2, name.find('.', 2) - 2));
    Unit& unit = layout.units[u];
    unit.params.push_back(item.value());
    unit.names.push_back(name);
    unit.shapes.push_back(item.value().sizes().vec());
    unit.numel += item.value().numel();
  }
  for (Unit& unit : layout.units) {
    unit.world = world;
    unit.padded = padded_size(unit.numel, world);
    unit.offset = layout.padded;
    unit.shard_offset = layout.shard;
    layout.numel += unit.numel;
    layout.padded += unit.padded;
    layout.shard += unit.chunk();
  }
  return layout;
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
  // BEGIN SOLUTION: start, without waiting, one collective after which pending.buffer, seen as
  //   (W, chunk), holds rank j's chunk r of its flat in row j; add the ring's (W-1) * chunk * e
  //   bytes, e the element size (L07Comm.ReduceScatter*; calls and hints: README section 8)
  auto input = flat.contiguous();
  pending.buffer = torch::empty_like(input);
  std::vector<int64_t> equal_splits;  // empty: W equal chunks
  pending.work = comm_->alltoall_base(pending.buffer, input, equal_splits, equal_splits);
  bytes_ += (w - 1) * pending.chunk * input.element_size();  // ring: (W-1)/W of the N leave
  // END SOLUTION
  return pending;
}

torch::Tensor CountingComm::reduce_scatter_finish(Pending& pending) {
  // BEGIN SOLUTION: once the collective is done, return chunk r summed over the W ranks, (chunk)
  //   (empty when chunk is 0), and leave pending empty so that its buffer is freed
  //   (L07Comm.ReduceScatter*; hints: README section 8)
  pending.work->wait();
  const int64_t w = pending.buffer.numel() / std::max<int64_t>(pending.chunk, 1);
  auto sum = pending.chunk == 0 ? pending.buffer.narrow(0, 0, 0).clone()
                                : pending.buffer.view({w, pending.chunk}).sum(0);
  pending = Pending{};  // frees the (W, chunk) receive buffer
  return sum;
  // END SOLUTION
}

torch::Tensor CountingComm::reduce_scatter(const torch::Tensor& flat) {
  Pending pending = reduce_scatter_start(flat);
  return reduce_scatter_finish(pending);
}

Pending CountingComm::all_gather_start(const torch::Tensor& chunk) {
  Pending pending;
  pending.chunk = chunk.numel();
  // BEGIN SOLUTION: start, without waiting, one collective that writes rank j's chunk straight
  //   into [j * chunk, (j + 1) * chunk) of a new pending.buffer (W * chunk); add (W-1) * chunk * e
  //   bytes, e the element size (L07Comm.AllGather*; calls and hints: README section 8)
  const int w = world();
  pending.buffer = torch::empty({w * pending.chunk}, chunk.options());
  std::vector<std::vector<at::Tensor>> outputs(1);  // [device][rank]
  for (int j = 0; j < w; ++j) {
    outputs[0].push_back(pending.buffer.narrow(0, j * pending.chunk, pending.chunk));
  }
  std::vector<at::Tensor> inputs{chunk.contiguous()};
  pending.work = comm_->allgather(outputs, inputs);
  bytes_ += (w - 1) * pending.chunk * chunk.element_size();
  // END SOLUTION
  return pending;
}

torch::Tensor CountingComm::all_gather_finish(Pending& pending) {
  pending.work->wait();
  auto full = pending.buffer;
  pending = Pending{};
  return full;
}

torch::Tensor CountingComm::all_gather(const torch::Tensor& chunk) {
  Pending pending = all_gather_start(chunk);
  return all_gather_finish(pending);
}

void CountingComm::all_reduce(torch::Tensor& flat) {
  // BEGIN SOLUTION: on return flat holds, in place, its sum over the ranks; add the ring's
  //   2 (W-1) * (numel / W) * e bytes, e the element size (L07Comm.AllReduce*; calls: README
  //   section 8)
  std::vector<at::Tensor> tensors{flat};
  comm_->allreduce(tensors)->wait();
  // A reduce-scatter and an all-gather.
  bytes_ += 2 * (world() - 1) * (flat.numel() / world()) * flat.element_size();
  // END SOLUTION
}

// =============================================================================================
// Part 3: AdamW, elementwise
// =============================================================================================

void adamw_update(torch::Tensor param, const torch::Tensor& grad, torch::Tensor exp_avg,
                  torch::Tensor exp_avg_sq, int64_t step, const AdamWOptions& o) {
  torch::NoGradGuard no_grad;
  // BEGIN SOLUTION: one torch::optim::AdamW step (the header's four lines, in their order), in
  //   place on param and both moments and elementwise, so that shards update like the whole
  //   (L07AdamW.*; hints: README section 8)
  param.mul_(1 - o.lr * o.weight_decay);
  exp_avg.mul_(o.beta1).add_(grad, 1 - o.beta1);
  exp_avg_sq.mul_(o.beta2).addcmul_(grad, grad, 1 - o.beta2);
  const double bias_correction1 = 1 - std::pow(o.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(o.beta2, static_cast<double>(step));
  auto denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(o.eps);
  param.addcdiv_(exp_avg, denom, -o.lr / bias_correction1);
  // END SOLUTION
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

void free_storage(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));  // the old DataPtr frees it
  impl->set_nbytes(0);
}

void refill_storage(const torch::Tensor& into, const torch::Tensor& from) {
  c10::StorageImpl* dst = into.storage().unsafeGetStorageImpl();
  c10::StorageImpl* src = from.storage().unsafeGetStorageImpl();
  if (dst->nbytes() != 0) {
    throw std::invalid_argument(
        "refill_storage: the target's storage still holds memory: free_storage() it first");
  }
  const auto whole = [](const torch::Tensor& t) {
    return t.is_contiguous() && t.storage_offset() == 0;
  };
  if (!whole(into) || !whole(from) || into.numel() != from.numel() ||
      into.dtype() != from.dtype() || into.device() != from.device() ||
      src->nbytes() != static_cast<size_t>(from.nbytes())) {
    throw std::invalid_argument(
        fmt::format("refill_storage: the tensors must be whole, contiguous and alike (into {} "
                    "elements, from {}, whose storage holds {} bytes)",
                    into.numel(), from.numel(), src->nbytes()));
  }
  const size_t nbytes = src->nbytes();
  dst->set_data_ptr_noswap(src->set_data_ptr(at::DataPtr(nullptr, from.device())));
  dst->set_nbytes(nbytes);
  src->set_nbytes(0);
}

ZeroEngine::ZeroEngine(Gpt model, c10::intrusive_ptr<Comm> comm, const ZeroOptions& options,
                       c10::intrusive_ptr<Comm> replicate)
    : model_(std::move(model)), comm_(std::move(comm)), options_(options) {
  if (options_.stage < 0 || options_.stage > 3) {
    throw UsageError("--stage", fmt::format("{} is not a ZeRO stage", options_.stage),
                     "use 0 (DDP), 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)");
  }
  if (replicate) {
    if (options_.stage < 2) {
      throw UsageError("--hsdp",
                       fmt::format("HSDP shards stage 2 or 3, not stage {}", options_.stage),
                       "pass --stage 2 or --stage 3 with --hsdp");
    }
    replicate_ = std::make_unique<CountingComm>(std::move(replicate));
  }
  const Precision reduce = options_.reduce.value_or(options_.precision);
  check_precision(options_.precision, /*bf16_collectives=*/true);
  if (options_.precision == Precision::kFp32 && reduce != Precision::kFp32) {
    throw UsageError("--reduce-dtype", "an fp32 model reduces its gradients in fp32",
                     "pass --precision bf16 to reduce in bf16");
  }
  check_precision(reduce, /*bf16_collectives=*/true);
  torch::NoGradGuard no_grad;
  const auto device = model_->parameters().front().device();
  float_options_ = torch::TensorOptions().dtype(torch::kFloat).device(device);
  param_options_ = float_options_.dtype(working_dtype(options_.precision));
  reduce_options_ = float_options_.dtype(working_dtype(reduce));
  layout_ = make_layout(model_, comm_.world());
  // The full flat buffer: every unit's parameters one after the other, zeros in the padding.
  auto full = torch::zeros({layout_.padded}, float_options_);
  for (Unit& unit : layout_.units) {
    int64_t off = unit.offset;
    for (auto& p : unit.params) {
      full.narrow(0, off, p.numel()).copy_(p.reshape({-1}));
      off += p.numel();
    }
  }
  if (options_.precision != Precision::kFp32) {
    // The fp32 master weights start as the fp32 initial weights, in the moments' layout; the
    // parameters are their rounding to bf16 from here on.
    master_ = options_.stage == 0 ? full : shard_of_full(full);
    full = full.to(param_options_);
  }
  if (options_.stage <= 2) {
    // Stages 0-2 keep every parameter: make each one a view of the flat buffer (the model's own
    // tensors are freed), so that one collective can move all of them.
    flat_params_ = full;
    for (Unit& unit : layout_.units)
      bind_unit(unit, flat_params_.narrow(0, unit.offset, unit.padded));
  } else {
    // Stage 3 keeps only its chunk of each unit; the parameters are empty until gathered.
    param_shard_ = shard_of_full(full);
    full = torch::Tensor();
    for (Unit& unit : layout_.units) release_unit(unit);
  }
}

torch::Tensor ZeroEngine::chunk_of_full(const torch::Tensor& full, const Unit& unit) const {
  return full.narrow(0, unit.offset + comm_.rank() * unit.chunk(), unit.chunk());
}

torch::Tensor ZeroEngine::chunk_of_shard(const torch::Tensor& shard, const Unit& unit) const {
  if (!shard.defined()) return {};
  return shard.narrow(0, unit.shard_offset, unit.chunk());
}

torch::Tensor ZeroEngine::shard_of_full(const torch::Tensor& full) const {
  std::vector<torch::Tensor> chunks;
  for (const Unit& unit : layout_.units) chunks.push_back(chunk_of_full(full, unit));
  return torch::cat(chunks);
}

torch::Tensor ZeroEngine::pad_full(const torch::Tensor& unpadded) const {
  TORCH_CHECK(unpadded.numel() == layout_.numel, "expected ", layout_.numel, " elements, got ",
              unpadded.numel());
  auto full = torch::zeros({layout_.padded}, float_options_);
  int64_t from = 0;
  for (const Unit& unit : layout_.units) {
    full.narrow(0, unit.offset, unit.numel).copy_(unpadded.narrow(0, from, unit.numel));
    from += unit.numel;
  }
  return full;
}

torch::Tensor ZeroEngine::unpad_full(const torch::Tensor& padded) const {
  std::vector<torch::Tensor> parts;
  for (const Unit& unit : layout_.units) parts.push_back(padded.narrow(0, unit.offset, unit.numel));
  return torch::cat(parts);
}

void ZeroEngine::bind_unit(Unit& unit, const torch::Tensor& full) {
  // Each parameter becomes a view of its range of @p full (the unit's padded buffer).
  int64_t off = 0;
  for (size_t k = 0; k < unit.params.size(); ++k) {
    const int64_t numel = c10::multiply_integers(unit.shapes[k]);
    unit.params[k].set_data(full.narrow(0, off, numel).view(unit.shapes[k]));
    off += numel;
  }
  unit.bound = true;
}

void ZeroEngine::release_unit(Unit& unit) {
  // A gathered unit: bound by bind_unit, every parameter viewing one buffer of the unit's padded
  // size. Its memory is freed here, whoever else still holds the tensor (zero.h); the
  // constructor's first release finds the model's own tensors and leaves them to their owners.
  bool gathered = unit.bound && !unit.params.empty() && unit.params.front().defined();
  const c10::StorageImpl* buffer =
      gathered ? unit.params.front().storage().unsafeGetStorageImpl() : nullptr;
  for (const auto& p : unit.params) {
    gathered = gathered && p.defined() && p.storage().unsafeGetStorageImpl() == buffer;
  }
  if (gathered && buffer->nbytes() == static_cast<size_t>(unit.padded) *
                                          c10::elementSize(param_options_.dtype().toScalarType())) {
    free_storage(unit.params.front());
  }
  // An empty tensor of the same type in each parameter.
  for (auto& p : unit.params) p.set_data(torch::empty({0}, param_options_));
  unit.bound = false;
}

void ZeroEngine::ensure_moments() {
  if (exp_avg_.defined()) return;
  const int64_t n = options_.stage == 0 ? layout_.padded : layout_.shard;
  exp_avg_ = torch::zeros({n}, float_options_);
  exp_avg_sq_ = torch::zeros({n}, float_options_);
}

float ZeroEngine::forward_backward(const Batch& batch) {
  return options_.stage <= 1 ? forward_backward_replicated(batch) : forward_backward_sharded(batch);
}

float ZeroEngine::forward_backward_replicated(const Batch& batch) {
  // The full gradient buffer in the reduce dtype, made on the first step. In the working dtype
  // every parameter's grad is a view of it; in a wider one (bf16 parameters, fp32 reduce:
  // Megatron's
  // main_grad) a hook adds each parameter's gradient into its view as autograd writes it.
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
  // BEGIN SOLUTION: the mean gradient over ranks, where this stage reads it: stage 0 all of
  //   flat_grads_ (one allreduce); stage 1 this rank's chunk of each unit, sending only what
  //   reduce-scatters send (L07Stages.*; hints: README sections 4 and 8)
  const double world = comm_.world();
  if (options_.stage == 0) {
    comm_.all_reduce(flat_grads_);
    flat_grads_.div_(world);
  } else {
    for (const Unit& unit : layout_.units) {
      auto sum = comm_.reduce_scatter(flat_grads_.narrow(0, unit.offset, unit.padded));
      chunk_of_full(flat_grads_, unit).copy_(sum.div_(world));
    }
  }
  // END SOLUTION
  return value;
}

torch::Tensor ZeroEngine::grad_buffer(const Unit& unit) const {
  return torch::zeros({unit.padded}, param_options_);
}

Pending ZeroEngine::reduce_start(const torch::Tensor& grads) {
  const torch::Tensor input = grads.to(reduce_options_.dtype());  // no copy if the same
  Pending pending = comm_.reduce_scatter_start(input);
  pending.input = input;
  return pending;
}

void ZeroEngine::update(torch::Tensor params, const torch::Tensor& grad, torch::Tensor exp_avg,
                        torch::Tensor exp_avg_sq, const torch::Tensor& master) {
  // In pieces of 2^18 elements: AdamW is elementwise, so this is exact, and the temporaries it
  // makes (an fp32 copy of a bf16 gradient, the denominator) stay at 1 MiB each, as in a fused
  // AdamW, instead of growing with what this rank owns.
  constexpr int64_t kPiece = int64_t{1} << 18;
  const int64_t n = params.numel();
  for (int64_t at = 0; at < n; at += kPiece) {
    const int64_t len = std::min(kPiece, n - at);
    auto piece = [&](const torch::Tensor& t) { return t.narrow(0, at, len); };
    if (!master.defined()) {
      adamw_update(piece(params), piece(grad), piece(exp_avg), piece(exp_avg_sq), step_,
                   options_.adamw);
      continue;
    }
    auto m = piece(master);
    adamw_update(m, piece(grad).to(torch::kFloat), piece(exp_avg), piece(exp_avg_sq), step_,
                 options_.adamw);
    piece(params).copy_(m);  // rounded to the working dtype
  }
}

void ZeroEngine::reduce_unit_gradient(Pending& pending, const Unit& unit) {
  if (!pending.work) return;
  const torch::Tensor input = pending.input, received = pending.buffer;
  auto sum = CountingComm::reduce_scatter_finish(pending);
  auto chunk = chunk_of_shard(grad_shard_, unit);
  chunk.copy_(sum.div_(static_cast<double>(comm_.world())));
  if (replicate_) {
    // HSDP: the mean over the shard group, averaged over the replicas of this shard: the mean
    // over all W ranks (equal groups). Blocking, unit by unit (FSDP2 overlaps it too).
    auto mean = chunk.contiguous();
    replicate_->all_reduce(mean);
    chunk.copy_(mean.div_(static_cast<double>(replicate_->world())));
  }
  // Done with both (the sum is in the shard): freed now, not when gloo's thread lets go.
  sum = torch::Tensor();
  // Only a tensor that owns its whole storage: never a view into a buffer that lives on.
  for (const torch::Tensor& t : {input, received}) {
    if (t.defined() && t.storage_offset() == 0 && t.storage().nbytes() > 0 &&
        t.storage().nbytes() == static_cast<size_t>(t.nbytes())) {
      free_storage(t);
    }
  }
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
  // BEGIN SOLUTION: the blocks' forward, one block at a time, keeping in inputs / outputs what
  //   backward will need: each block's graph from a detached input (stage 2, and stage 3 whose
  //   gathered parameters are freed, not released, once the block has run); with recompute
  //   only each block's input. A block's gathered parameters live only while it runs (with
  //   --prefetch, the next gather overlaps the block). Tests: L07Stages.*, L07Memory.*; hints:
  //   README section 8
  Pending next;
  if (stage3 && blocks > 0) next = gather(1);
  for (size_t i = 0; i < blocks; ++i) {
    auto blk = model_->h[i]->as<BlockImpl>();
    if (!stage3) {
      inputs[i] = x.detach().requires_grad_();
      outputs[i] = blk->forward(inputs[i]);
      x = outputs[i].detach();
      continue;
    }
    Unit& unit = layout_.units[1 + i];
    auto full = CountingComm::all_gather_finish(next);  // (padded) this block's parameters
    if (options_.prefetch && i + 1 < blocks) next = gather(2 + i);  // overlaps with the block
    bind_unit(unit, full);
    const bool reshard = options_.reshard_after_forward;
    if (options_.recompute) {
      inputs[i] = x;  // the block's input: all that recomputation keeps of its activations
      {
        torch::NoGradGuard no_grad;  // recomputed in backward instead of saved
        x = blk->forward(x);
      }
      if (reshard) release_unit(unit);  // else it stays bound until its backward
    } else {
      inputs[i] = x.detach().requires_grad_();
      outputs[i] = blk->forward(inputs[i]);  // its activations are saved, as in stage 2
      x = outputs[i].detach();
      if (reshard) free_storage(full);  // but not its parameters: 0 bytes until backward
      gathered[i] = full;
    }
    full = torch::Tensor();
    if (!options_.prefetch && i + 1 < blocks) next = gather(2 + i);
  }
  // END SOLUTION

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
  // BEGIN SOLUTION: the blocks' backward, last block first, each into a zeroed gradient buffer
  //   of its own that is reduce-scattered while the next block runs backward, then freed (stage
  //   3 gathers each block again: into the storage its saved activations still view, or, with
  //   recompute, to recompute it from its input). On exit g is the gradient into block 0's
  //   input, and the last reduce-scatter is still in flight in reducing / reducing_unit
  //   (finished below). Tests: L07Stages.*, L07Memory.*; hints: README section 8
  // Without resharding after forward, a block's parameters are still gathered: no second gather.
  const bool regather = stage3 && options_.reshard_after_forward;
  if (regather && blocks > 0) next = gather(blocks);
  for (size_t i = blocks; i-- > 0;) {
    Unit& unit = layout_.units[1 + i];
    auto grads = grad_buffer(unit);
    bind_grads(unit, grads, 0);
    torch::Tensor input;
    if (!stage3) {
      input = inputs[i];
      outputs[i].backward(g);
      outputs[i] = torch::Tensor();
    } else if (!options_.recompute) {
      if (regather) {
        auto again = CountingComm::all_gather_finish(next);
        if (options_.prefetch && i > 0) next = gather(i);
        refill_storage(gathered[i], again);  // the saved views of the parameters read it again
      }
      input = inputs[i];
      outputs[i].backward(g);
      outputs[i] = torch::Tensor();
      release_unit(unit);
      gathered[i] = torch::Tensor();
      if (regather && !options_.prefetch && i > 0) next = gather(i);
    } else {
      if (regather) {
        auto full = CountingComm::all_gather_finish(next);
        if (options_.prefetch && i > 0) next = gather(i);
        bind_unit(unit, full);
      }
      input = inputs[i].detach().requires_grad_();
      auto y = model_->h[i]->as<BlockImpl>()->forward(input);  // recompute
      y.backward(g);
      y = torch::Tensor();
      release_unit(unit);
      gathered[i] = torch::Tensor();
      if (regather && !options_.prefetch && i > 0) next = gather(i);
    }
    g = input.grad();
    input = torch::Tensor();
    inputs[i] = torch::Tensor();
    unbind_grads(unit);
    torch::NoGradGuard no_grad;
    reduce_unit_gradient(reducing, layout_.units[reducing_unit]);
    reducing = reduce_start(grads);
    reducing_unit = 1 + i;
  }
  // END SOLUTION
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
  // BEGIN SOLUTION: scale every owned gradient by min(1, max_norm / (norm + 1e-6)), where norm
  //   is the 2-norm of the WHOLE averaged gradient, as torch::nn::utils::clip_grad_norm_ computes
  //   it on one process; return norm (L07Clip.*; hints: README section 8)
  auto sq = torch::zeros({1}, float_options_.dtype(torch::kDouble));
  for (const auto& t : owned) sq += t.to(torch::kDouble).pow(2).sum();
  if (options_.stage > 0) comm_.all_reduce(sq);  // the shards partition the gradient
  norm = std::sqrt(sq.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& t : owned) t.mul_(coef);
  }
  // END SOLUTION
  return norm;
}

void ZeroEngine::optimizer_step() {
  torch::NoGradGuard no_grad;
  ensure_moments();
  if (options_.clip_norm > 0) last_grad_norm_ = clip_gradients(options_.clip_norm);
  ++step_;
  // BEGIN SOLUTION: adamw_update on exactly what this rank owns (stage 0: everything; 1-3: its
  //   chunk of each unit, with the moments' (and master_'s) matching chunk), through update();
  //   then stages 1-2 hold every updated parameter in flat_params_ again, sending only what an
  //   all-gather sends (Psi) (L07Stages.*, L07Bf16.*; hints: README sections 4 and 8)
  if (options_.stage == 0) {
    update(flat_params_, flat_grads_, exp_avg_, exp_avg_sq_, master_);
    return;
  }
  if (options_.stage == 3) {
    update(param_shard_, grad_shard_, exp_avg_, exp_avg_sq_, master_);
    return;
  }
  for (const Unit& unit : layout_.units) {
    auto grad =
        options_.stage == 1 ? chunk_of_full(flat_grads_, unit) : chunk_of_shard(grad_shard_, unit);
    update(chunk_of_full(flat_params_, unit), grad, chunk_of_shard(exp_avg_, unit),
           chunk_of_shard(exp_avg_sq_, unit), chunk_of_shard(master_, unit));
  }
  for (const Unit& unit : layout_.units) {
    auto full = comm_.all_gather(chunk_of_full(flat_params_, unit).clone());
    flat_params_.narrow(0, unit.offset, unit.padded).copy_(full);
  }
  // END SOLUTION
}

torch::Tensor ZeroEngine::gather_shards(const torch::Tensor& shard) {
  auto full = torch::empty({layout_.padded}, shard.options());
  for (const Unit& unit : layout_.units) {
    // Not counted: this is inspection (tests, checkpoints), not training.
    std::vector<std::vector<at::Tensor>> out(1);
    for (int j = 0; j < comm_.world(); ++j)
      out[0].push_back(full.narrow(0, unit.offset + j * unit.chunk(), unit.chunk()));
    std::vector<at::Tensor> in{chunk_of_shard(shard, unit).contiguous()};
    comm_.comm().allgather(out, in)->wait();
  }
  return full;
}

torch::Tensor ZeroEngine::full_parameters() {
  torch::NoGradGuard no_grad;
  if (master_.defined()) {
    return unpad_full(options_.stage == 0 ? master_ : gather_shards(master_)).clone();
  }
  if (options_.stage <= 2) return unpad_full(flat_params_).clone();
  return unpad_full(gather_shards(param_shard_));
}

ZeroEngine::ShardState ZeroEngine::shard_state() {
  ShardState s;
  s.step = step_;
  if (master_.defined()) {  // bf16: the weights are the fp32 master weights, not their rounding
    s.params = options_.stage == 0 ? shard_of_full(master_) : master_.clone();
  } else {
    s.params = options_.stage <= 2 ? shard_of_full(flat_params_) : param_shard_.clone();
  }
  if (!exp_avg_.defined()) {
    s.exp_avg = torch::zeros({layout_.shard}, float_options_);
    s.exp_avg_sq = torch::zeros({layout_.shard}, float_options_);
  } else if (options_.stage == 0) {
    s.exp_avg = shard_of_full(exp_avg_);
    s.exp_avg_sq = shard_of_full(exp_avg_sq_);
  } else {
    s.exp_avg = exp_avg_.clone();
    s.exp_avg_sq = exp_avg_sq_.clone();
  }
  return s;
}

void ZeroEngine::load_owned_state(const torch::Tensor& params, const torch::Tensor& exp_avg,
                                  const torch::Tensor& exp_avg_sq, int64_t step) {
  torch::NoGradGuard no_grad;
  const int64_t whole_params = options_.stage <= 2 ? layout_.numel : layout_.shard;
  const int64_t whole_moments = options_.stage == 0 ? layout_.numel : layout_.shard;
  if (params.numel() != whole_params || exp_avg.numel() != whole_moments ||
      exp_avg_sq.numel() != whole_moments) {
    throw std::invalid_argument(fmt::format(
        "load_owned_state at stage {}: {} parameters and {}/{} moment elements, expected {} "
        "and {}",
        options_.stage, params.numel(), exp_avg.numel(), exp_avg_sq.numel(), whole_params,
        whole_moments));
  }
  // A copy of its own, on the engine's device (one copy, whatever the input's device).
  auto here = [&](const torch::Tensor& t) {
    return t.to(float_options_, /*non_blocking=*/false, /*copy=*/true).contiguous();
  };
  // bf16: @p params are the fp32 master weights, kept in the moments' layout; the parameters
  // become their rounding to bf16.
  if (options_.stage <= 2) {
    const torch::Tensor full = pad_full(here(params));
    flat_params_.copy_(full);  // the parameters stay views of it
    if (master_.defined()) master_ = options_.stage == 0 ? full : shard_of_full(full);
  } else if (master_.defined()) {
    master_ = here(params);
    param_shard_ = master_.to(param_options_);
  } else {
    param_shard_ = here(params);
  }
  exp_avg_ = options_.stage == 0 ? pad_full(here(exp_avg)) : here(exp_avg);
  exp_avg_sq_ = options_.stage == 0 ? pad_full(here(exp_avg_sq)) : here(exp_avg_sq);
  step_ = step;
  if (step == 0) {
    exp_avg_ = torch::Tensor();
    exp_avg_sq_ = torch::Tensor();
  }
}

// =============================================================================================
// Part 5: sharded checkpoints
// =============================================================================================

namespace {

std::string shard_file(const std::string& dir, int rank, int world) {
  return (std::filesystem::path(dir) / fmt::format("shard-{}-of-{}.pt", rank, world)).string();
}

// The marker that a save of @p world ranks completed: written last, by rank 0, after every rank's
// file is in place.
std::string complete_file(const std::string& dir) {
  return (std::filesystem::path(dir) / "COMPLETE").string();
}

// Writes @p archive to @p path atomically: to path.tmp, then rename (atomic on POSIX): a crash
// halfway leaves path.tmp, never half of path. (A machine crash would also need fsync of the
// file and of the directory: lesson 06's pitfalls.)
void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path) {
  const std::string tmp = path + ".tmp";
  archive.save_to(tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error(fmt::format("cannot rename {} to {}", tmp, path));
  }
}

torch::Tensor unit_numels(const FlatLayout& layout) {
  std::vector<int64_t> n;
  for (const Unit& unit : layout.units) n.push_back(unit.numel);
  return torch::tensor(n, torch::kLong);
}

}  // namespace

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
  // BEGIN SOLUTION: the pieces of [begin, end) in order, each narrowed from the file whose
  //   N-rank chunk of the unit holds it, asking shard_of only for files that hold a piece
  //   (L07Checkpoint.*; hints: README sections 6 and 8)
  int64_t offset = 0;  // where the unit's chunk starts in every file: the earlier units' chunks
  for (size_t k = 0; k < unit; ++k) {
    offset += padded_size(layout.units[k].numel, saved_world) / saved_world;
  }
  const int64_t chunk = padded_size(layout.units[unit].numel, saved_world) / saved_world;
  for (int64_t r = chunk > 0 ? begin / chunk : 0; begin < end && r * chunk < end; ++r) {
    const int64_t lo = std::max(begin, r * chunk);
    const int64_t hi = std::min(end, (r + 1) * chunk);
    parts.push_back(shard_of(static_cast<int>(r)).narrow(0, offset + lo - r * chunk, hi - lo));
  }
  // END SOLUTION
  if (parts.empty()) return torch::empty({0}, torch::kFloat);
  return torch::cat(parts);
}

void save_sharded(ZeroEngine& engine, const std::string& dir) {
  if (engine.replicate_comm() != nullptr) {
    throw UsageError("--save-sharded", "this lesson's checkpoints are for plain ZeRO, not HSDP",
                     "drop --hsdp, or save without it");
  }
  const auto s = engine.shard_state();
  torch::serialize::OutputArchive archive;
  archive.write("params", s.params.cpu());
  archive.write("exp_avg", s.exp_avg.cpu());
  archive.write("exp_avg_sq", s.exp_avg_sq.cpu());
  archive.write("step", torch::tensor({s.step}, torch::kLong));
  archive.write("world",
                torch::tensor({static_cast<int64_t>(engine.layout().world)}, torch::kLong));
  archive.write("unit_numels", unit_numels(engine.layout()));
  const int world = engine.layout().world;
  // Not counted (checkpointing, not training): two barriers. The old COMPLETE goes before any
  // rank replaces its shard, and the new one comes after every rank has.
  auto barrier = [&] {
    std::vector<at::Tensor> done{torch::zeros({1}, s.params.options())};
    engine.comm().comm().allreduce(done)->wait();
  };
  if (engine.comm().rank() == 0) std::filesystem::remove(complete_file(dir));  // a new save
  barrier();
  save_atomically(archive, shard_file(dir, engine.comm().rank(), world));
  barrier();
  if (engine.comm().rank() == 0) {
    torch::serialize::OutputArchive marker;
    marker.write("world", torch::tensor({static_cast<int64_t>(world)}, torch::kLong));
    marker.write("step", torch::tensor({s.step}, torch::kLong));
    save_atomically(marker, complete_file(dir));
  }
}

void load_sharded(ZeroEngine& engine, const std::string& dir) {
  if (engine.replicate_comm() != nullptr) {
    throw UsageError("--load-sharded", "this lesson's checkpoints are for plain ZeRO, not HSDP",
                     "drop --hsdp, or load without it");
  }
  // How many ranks saved it: the N in the COMPLETE marker, written last by a finished save.
  if (!std::filesystem::is_directory(dir)) {
    throw UsageError("--load-sharded", fmt::format("'{}' is not a directory", dir),
                     "pass a directory written by --save-sharded");
  }
  if (!std::filesystem::exists(complete_file(dir))) {
    throw UsageError("--load-sharded",
                     fmt::format("'{}' has no COMPLETE marker: its save did not finish (a rank "
                                 "died, or it is not a --save-sharded directory)",
                                 dir),
                     "load an earlier checkpoint, or save again");
  }
  int saved_world = 0;
  int64_t saved_step = 0;
  {
    torch::serialize::InputArchive marker;
    marker.load_from(complete_file(dir));
    torch::Tensor w, st;
    marker.read("world", w);
    marker.read("step", st);
    saved_world = static_cast<int>(w.item<int64_t>());
    saved_step = st.item<int64_t>();
  }
  // Every file is there: checked on every rank before any is read, so that all ranks agree.
  for (int r = 0; r < saved_world; ++r) {
    const std::string file = shard_file(dir, r, saved_world);
    if (!std::filesystem::exists(file)) {
      throw UsageError(
          "--load-sharded", fmt::format("'{}' is missing", file),
          fmt::format("a checkpoint of {} ranks has {} files", saved_world, saved_world));
    }
  }
  // The files, each read when first needed and checked: the same model, the marker's step.
  struct Saved {
    torch::Tensor params, exp_avg, exp_avg_sq;
  };
  std::map<int, Saved> files;
  auto file_of = [&](int r) -> const Saved& {
    if (auto it = files.find(r); it != files.end()) return it->second;
    const std::string file = shard_file(dir, r, saved_world);
    torch::serialize::InputArchive archive;
    archive.load_from(file);
    torch::Tensor numels, st;
    Saved saved;
    archive.read("unit_numels", numels);
    if (!torch::equal(numels, unit_numels(engine.layout()))) {
      throw UsageError("--load-sharded", fmt::format("'{}' is a checkpoint of another model", file),
                       "use the same model flags (--layers, --hidden, --seq, --untied, ...)");
    }
    archive.read("params", saved.params);
    archive.read("exp_avg", saved.exp_avg);
    archive.read("exp_avg_sq", saved.exp_avg_sq);
    archive.read("step", st);
    if (st.item<int64_t>() != saved_step) {
      throw UsageError("--load-sharded",
                       fmt::format("'{}' is from step {}, but the checkpoint's COMPLETE marker "
                                   "says step {}: shards of two saves are mixed",
                                   file, st.item<int64_t>(), saved_step),
                       "load a directory that one finished save wrote");
    }
    return files.emplace(r, std::move(saved)).first->second;
  };
  // What this rank keeps of each unit, in the current layout: the whole unit, unpadded, where
  // the stage replicates it; else its chunk, zero-padded to unit.chunk() (the shard layout).
  const FlatLayout& layout = engine.layout();
  const int64_t rank = engine.comm().rank();
  auto owned = [&](bool whole, torch::Tensor Saved::*which) {
    std::vector<torch::Tensor> parts;
    for (size_t u = 0; u < layout.units.size(); ++u) {
      const Unit& unit = layout.units[u];
      const int64_t begin = whole ? 0 : std::min(unit.numel, rank * unit.chunk());
      const int64_t end = whole ? unit.numel : std::min(unit.numel, (rank + 1) * unit.chunk());
      auto part = read_unit_range(layout, u, begin, end, saved_world,
                                  [&](int r) { return file_of(r).*which; });
      parts.push_back(part.to(torch::kFloat));
      if (!whole && part.numel() < unit.chunk()) {
        parts.push_back(torch::zeros({unit.chunk() - part.numel()}, torch::kFloat));
      }
    }
    return torch::cat(parts);
  };
  torch::Tensor params, exp_avg, exp_avg_sq;
  std::exception_ptr failed;
  try {
    params = owned(engine.stage() <= 2, &Saved::params);
    exp_avg = owned(engine.stage() == 0, &Saved::exp_avg);
    exp_avg_sq = owned(engine.stage() == 0, &Saved::exp_avg_sq);
  } catch (...) {
    failed = std::current_exception();
  }
  // A rank reads only some files, so only it may find one bad: agree on the outcome (one
  // allreduce, MAX, not counted), so that every rank stops, instead of the others waiting in
  // the first collective until the timeout.
  const auto device = engine.model()->parameters().front().device();
  std::vector<at::Tensor> bad{
      torch::full({1}, failed ? 1.0f : 0.0f, torch::TensorOptions().device(device))};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  engine.comm().comm().allreduce(bad, max)->wait();
  if (failed) std::rethrow_exception(failed);
  if (bad[0].cpu().item<float>() > 0) {
    throw UsageError("--load-sharded", "another rank could not load the checkpoint",
                     "that rank's error says which file and why");
  }
  engine.load_owned_state(params, exp_avg, exp_avg_sq, saved_step);
}

void consolidate(ZeroEngine& engine, const std::string& file) {
  auto full = engine.full_parameters().cpu();  // collective: every rank gathers
  if (engine.comm().rank() != 0) return;
  torch::serialize::OutputArchive archive;
  int64_t off = 0;
  for (const Unit& unit : engine.layout().units) {
    for (size_t k = 0; k < unit.names.size(); ++k) {
      const int64_t numel = c10::multiply_integers(unit.shapes[k]);
      archive.write(unit.names[k], full.narrow(0, off, numel).view(unit.shapes[k]).clone());
      off += numel;
    }
  }
  archive.save_to(file);
}

}  // namespace dtc::l07

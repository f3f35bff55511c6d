// Lesson 10's given pieces: the sequence split and the attention of one block (declared in
// context_parallel.h, which your context_parallel.cpp implements the rest of), then the mesh,
// the training loop, activation memory and communication volume (context_parallel_given.h).
#include "context_parallel_given.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dtc/digest.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/program.h"
#include "dtc/trace.h"

namespace dtc::l10 {

// ---------------------------------------------------------------------------------------------
// The rank grid
// ---------------------------------------------------------------------------------------------

Mesh make_mesh(int world, int dp, int cp, int tp) {
  if (tp == 0) tp = 1;
  if (dp == 0 && cp == 0) dp = 1;  // neither: cp takes what is left
  // Listed so that the flag blamed for a mismatch is the one the learner gave last: cp, else
  // tp when only tp was given (dtc::Mesh blames the last dimension given a degree).
  return Mesh::build(world, {{"dp_replicate", dp, "--dp"}, {"tp", tp, "--tp"}, {"cp", cp, "--cp"}});
}

Groups make_groups(const c10::intrusive_ptr<c10d::Store>& store, const Mesh& mesh, int rank,
                   BackendKind backend, std::chrono::milliseconds timeout,
                   const std::string& master_addr) {
  const MeshGroups groups(store, mesh, rank, {{"tp"}, {"cp"}, {"dp_replicate", "cp"}}, backend,
                          timeout, master_addr);
  return Groups{groups.get({"tp"}), groups.get({"cp"}), groups.get({"dp_replicate", "cp"})};
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

void check_config(const CpConfig& c, int dp, int cp, int tp) {
  if (tp > 1) l08::validate_tp(c.run.model, tp);
  validate_cp(c.run.model.ctx, c.run.model.heads / tp, cp, c.attention, c.zigzag);
  check_precision(c.run.precision, /*bf16_collectives=*/true);
  if (c.run.batch % dp != 0) {
    throw UsageError("--global-batch",
                     fmt::format("{} sequences do not split over dp {}", c.run.batch, dp),
                     "pass a global batch that --dp divides, e.g. --global-batch 8 --dp 2");
  }
  if (c.sequence_parallel && tp == 1) {
    throw UsageError("--sequence-parallel", "splits the LayerNorm regions over the TP ranks",
                     "add --tp 2 (or more), or drop --sequence-parallel");
  }
  if (c.sequence_parallel) validate_sequence_parallel(c.run.model.ctx, cp, tp);
}

namespace {

void allreduce_sum(torch::Tensor& t, Comm& comm) {
  std::vector<torch::Tensor> tensors{t};
  comm.allreduce(tensors)->wait();
}

// The digest of the full model from TP shards: a split parameter from every TP rank, a
// replicated one from TP rank 0, and only from the first of the ranks holding the same weights.
nlohmann::json tp_digest(const GptConfig& config, const TpCpGpt& model,
                         const std::vector<torch::Tensor>& master, Comm& tp, Comm& replicas) {
  std::vector<std::string> names;
  std::map<std::string, int64_t> full_numel;
  for (const auto& item : Gpt(config)->named_parameters()) {
    names.push_back(item.key());
    full_numel[item.key()] = item.value().numel();
  }
  std::vector<NamedPiece> pieces;
  const auto named = model->model->named_parameters();
  const auto& wte = model->model->wte;
  for (size_t i = 0; i < named.size(); ++i) {
    const std::string name = named[i].key() == "lm_head" ? "lm_head.weight" : named[i].key();
    torch::Tensor value = master[i];
    if (name == "wte.weight" || name == "lm_head.weight") {  // without the padding rows
      value = value.narrow(0, 0, wte->vocab_end - wte->vocab_begin);
    }
    const bool split = value.numel() != full_numel.at(name);
    if (replicas.getRank() == 0 && (split || tp.getRank() == 0)) pieces.emplace_back(name, value);
  }
  return param_digest(names, pieces, std::vector<Comm*>{&tp, &replicas});
}

}  // namespace

CpRunResult train_cp(const CpConfig& c, Comm& cp, Comm& replicas, Comm* tp,
                     const CpRunOptions& options) {
  const int64_t steps = options.steps;
  const torch::Device& device = options.device;
  const auto& on_step = options.on_step;
  CpRunResult result;
  nlohmann::json* digest = options.digest ? &result.digest : nullptr;
  std::vector<torch::Tensor>* weights = options.weights ? &result.weights : nullptr;
  const int t = tp == nullptr ? 1 : tp->getSize();
  const int dp = replicas.getSize() / cp.getSize();
  check_config(c, dp, cp.getSize(), t);
  Gpt full = make_gpt(c.run.model, c.run.seed, device);  // the same weights on every rank
  // tp 1: the whole model on every rank (CpGpt); tp > 1: this rank's TP slices (TpCpGpt).
  CpGpt cp_model{nullptr};
  TpCpGpt tp_model{nullptr};
  torch::nn::Module* trained = nullptr;
  if (t == 1) {
    cp_model = CpGpt(full, cp, c.attention, c.zigzag);
    trained = full.get();
  } else {
    tp_model = TpCpGpt(full, *tp, cp, c.attention, c.zigzag, c.sequence_parallel);
    trained = tp_model->model.get();
    full = Gpt(nullptr);  // each rank keeps its slices only
  }
  MasterAdamW optimizer(*trained, c.run.precision, adamw_options(c.run));  // bf16: casts it
  {  // NCCL creates a group's communicator with its first collective, before any send or
     // receive of the ring (dtc::batch_isend_irecv)
    torch::Tensor one = torch::ones({1}, torch::TensorOptions().device(device));
    allreduce_sum(one, cp);
  }
  const ByteDataset data = ByteDataset::builtin();
  const int64_t rows = c.run.batch / dp;
  const int64_t first_row = replicas.getRank() / cp.getSize() * rows;  // cp fastest in replicas
  std::vector<float> losses;
  for (int64_t step = 0; step < steps; ++step) {
    const Batch batch = data.batch(c.run.seed, step, rows, c.run.model.ctx, first_row);
    Batch mine;  // this rank's tokens of each of its replica's rows
    mine.inputs = shard_sequence(batch.inputs, cp.getRank(), cp.getSize(), c.zigzag).to(device);
    mine.targets = shard_sequence(batch.targets, cp.getRank(), cp.getSize(), c.zigzag).to(device);
    optimizer.zero_grad();
    torch::Tensor loss = t == 1 ? cp_model->loss(mine) : tp_model->loss(mine);
    loss.backward();
    if (t > 1) tp_model->reduce_replicated_gradients();  // sequence parallel: rows of each rank
    // The sum over the tokens of every rank, / dp: one allreduce of every gradient, flat. (One
    // per parameter took longer than the attention itself: 52 small messages, see the timeline
    // in README section 3.)
    std::vector<torch::Tensor> grads;
    for (auto& p : trained->parameters()) grads.push_back(p.mutable_grad().reshape({-1}));
    torch::Tensor flat = torch::cat(grads);
    allreduce_sum(flat, replicas);
    flat.div_(dp);
    int64_t at = 0;
    for (auto& p : trained->parameters()) {
      torch::Tensor g = p.mutable_grad();
      g.copy_(flat.narrow(0, at, g.numel()).view_as(g));
      at += g.numel();
    }
    optimizer.step();
    torch::Tensor global = loss.detach().clone();
    allreduce_sum(global, replicas);
    const float value = global.item<float>() / static_cast<float>(dp);
    losses.push_back(value);
    if (on_step) on_step(step, value);
  }
  if (weights) {
    weights->clear();
    for (const auto& w : optimizer.master()) weights->push_back(w.detach().clone());
  }
  if (digest && t > 1)
    *digest = tp_digest(c.run.model, tp_model, optimizer.master(), *tp, replicas);
  if (digest && t == 1) {  // every rank holds every weight: this rank's own digest is the model's
    std::vector<std::string> names;
    std::vector<NamedPiece> pieces;
    const auto named = full->named_parameters();
    for (size_t i = 0; i < named.size(); ++i) {
      names.push_back(named[i].key());
      pieces.emplace_back(named[i].key(), optimizer.master()[i]);
    }
    *digest = param_digest(names, pieces);
  }
  result.losses = std::move(losses);
  return result;
}

// ---------------------------------------------------------------------------------------------
// Activation memory
// ---------------------------------------------------------------------------------------------

namespace {

// The bytes @p loss's forward leaves allocated on this thread until backward; then backward and
// the gradients cleared.
int64_t held_by_forward(const std::function<torch::Tensor()>& loss, torch::nn::Module& module) {
  // gloo's worker threads drop their references to a collective's buffers a moment after the
  // collective's wait() returns: let them, before each reading, so that a buffer of this
  // thread's is not freed (or still held) by them in between.
  auto settled = [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return thread_cpu_memory().current;
  };
  const int64_t before = settled();
  torch::Tensor l = loss();
  const int64_t held = settled() - before;
  l.backward();
  for (auto& p : module.parameters()) p.mutable_grad().reset();
  return held;
}

}  // namespace

int64_t measure_activation_bytes(CpGpt& model, const Batch& batch) {
  return held_by_forward([&] { return model->loss(batch); }, *model);
}

int64_t measure_activation_bytes(TpCpGpt& model, const Batch& batch) {
  return held_by_forward([&] { return model->loss(batch); }, *model);
}

int64_t predict_layer_activation_bytes(Attention kind, int64_t b, int64_t s, int64_t h, int64_t a,
                                       int cp, int64_t e, int tp, bool sequence_parallel) {
  const int64_t n = b * s / cp;  // this CP rank's tokens
  const int64_t t = tp;
  // The LayerNorm regions (x, ln_1's output, the residual after attention, ln_2's output, and
  // both LayerNorms' mean and rstd): replicated on the TP ranks, or split by sequence parallelism.
  const int64_t split = sequence_parallel ? t : 1;
  const int64_t norms = e * 4 * n * h / split + 2 * 2 * n * e / split;
  // The TP-split tensors: qkv (3 n h), c_proj's input (n h), the MLP's two 4h-wide ones.
  const int64_t split_by_tp = e * 12 * n * h / t;
  const int64_t heads = a / t;                        // this rank's heads
  const int64_t scores = e * heads * s * s * b / cp;  // its queries' scores
  switch (kind) {
    case Attention::kUlysses: return norms + split_by_tp + scores + s * s;
    case Attention::kAllGather:  // q's copy instead of qkv; the whole K and V of its heads
      return norms + split_by_tp - e * 2 * n * h / t + e * 2 * s * b * h / t + scores + s * s / cp;
    case Attention::kRing: {
      // In fp32 with one head a rank, c_proj's input is a view of the fp32 output (a (b, 1, n, d)
      // tensor is already (b, n, d) in memory): no copy, so the output is counted once.
      const int64_t output = e == 4 && heads == 1 ? 0 : 4 * n * h / t;
      return norms + split_by_tp + output + 4 * n * heads;
    }
  }
  return 0;
}

int64_t predict_activation_bytes(Attention kind, int64_t layers, int64_t b, int64_t s, int64_t h,
                                 int64_t a, int64_t vocab, int cp, int64_t e) {
  const int64_t n = b * s / cp;
  const int64_t head = 2 * e * n * h + 2 * e * n + 4 * n * vocab;
  const int64_t loss = 8;  // the loss and nll_loss's total weight, two fp32 scalars
  return layers * predict_layer_activation_bytes(kind, b, s, h, a, cp, e) + head + loss;
}

// ---------------------------------------------------------------------------------------------
// Communication volume
// ---------------------------------------------------------------------------------------------

AttentionVolume attention_volume(Attention kind, int64_t b, int64_t s, int64_t h, int cp) {
  const double block = static_cast<double>(b * s * h) / cp;  // one rank's K (or V): b (s/cp) h
  const double n = cp;
  AttentionVolume v;
  switch (kind) {
    case Attention::kRing:
      v.forward = 2 * (n - 1) * block;   // K and V, cp - 1 rotations
      v.backward = 2 * (n - 1) * block;  // K and V again
      v.backward_fp32 = 2 * n * block;   // and their gradients, cp times, in fp32
      v.forward_formula = "2(cp-1) bsh/cp";
      v.backward_formula = "2(cp-1) bsh/cp + 2 bsh fp32";
      break;
    case Attention::kAllGather:
      v.forward = 2 * (n - 1) * block;   // each rank's K and V block to the cp - 1 others
      v.backward = 2 * (n - 1) * block;  // dK, dV: cp - 1 slices of the gathered gradient
      v.forward_formula = "2(cp-1) bsh/cp";
      v.backward_formula = "2(cp-1) bsh/cp";
      break;
    case Attention::kUlysses:
      v.forward = 4 * (n - 1) / n * block;  // q, k, v and the output; 1/cp of each stays
      v.backward = 4 * (n - 1) / n * block;
      v.forward_formula = "4(cp-1) bsh/cp^2";
      v.backward_formula = "4(cp-1) bsh/cp^2";
      break;
  }
  return v;
}

}  // namespace dtc::l10

namespace dtc::l10 {

namespace F = torch::nn::functional;

// ---------------------------------------------------------------------------------------------
// Given: splitting the sequence, and the attention of one block
// ---------------------------------------------------------------------------------------------

const char* attention_name(Attention kind) {
  switch (kind) {
    case Attention::kRing: return "ring";
    case Attention::kUlysses: return "ulysses";
    case Attention::kAllGather: return "allgather";
  }
  return "?";
}

void validate_cp(int64_t seq, int64_t heads, int cp, Attention kind, bool zigzag) {
  if (cp < 1) {
    throw UsageError("--cp", fmt::format("is {}, but must be at least 1", cp),
                     "pass the number of ranks that split each sequence, e.g. --cp 2");
  }
  if (zigzag && kind == Attention::kUlysses) {
    throw UsageError("--zigzag", "does not apply to --attention ulysses",
                     "Ulysses attends over the whole gathered sequence on each rank, so its "
                     "work is balanced already: drop --zigzag, or use --attention ring");
  }
  const int64_t parts = zigzag ? 2 * cp : cp;
  if (seq % parts != 0) {
    std::string fits;
    for (int c = 1; c <= 64; ++c) {
      if (seq % (zigzag ? 2 * c : c) == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(c);
    }
    throw UsageError("--seq",
                     fmt::format("{} tokens do not split into {} equal chunks ({}cp = {})", seq,
                                 parts, zigzag ? "2 " : "", parts),
                     fmt::format("choose --seq a multiple of {}, or a cp that fits {} tokens: {}",
                                 parts, seq, fits));
  }
  if (kind == Attention::kUlysses && heads % cp != 0) {
    std::string fits;
    for (int c = 1; c <= heads; ++c) {
      if (heads % c == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(c);
    }
    throw UsageError("--heads",
                     fmt::format("{} heads do not split over cp {}: Ulysses gives each rank "
                                 "whole heads",
                                 heads, cp),
                     fmt::format("use --cp {} with --heads {}, or --attention ring", fits, heads));
  }
}

torch::Tensor local_positions(int64_t seq, int rank, int cp, bool zigzag) {
  const auto options = torch::dtype(torch::kLong);
  if (!zigzag) return torch::arange(rank * (seq / cp), (rank + 1) * (seq / cp), options);
  const int64_t chunk = seq / (2 * cp);
  return torch::cat({torch::arange(rank * chunk, (rank + 1) * chunk, options),
                     torch::arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, options)});
}

torch::Tensor shard_sequence(const torch::Tensor& x, int rank, int cp, bool zigzag, int64_t dim) {
  const auto pos = local_positions(x.size(dim), rank, cp, zigzag).to(x.device());
  return x.index_select(dim, pos).contiguous();
}

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

thread_local BlockObserver observer;

void observe(const torch::Tensor& q, const torch::Tensor& k, bool backward) {
  if (observer) observer(q.size(2), k.size(2), backward);
}

// (Tq, Tk) bool: true where key j lies in query i's future.
torch::Tensor future(const torch::Tensor& q_pos, const torch::Tensor& k_pos,
                     const torch::Device& device) {
  return k_pos.to(device).unsqueeze(0) > q_pos.to(device).unsqueeze(1);
}

// The scores of one block, fp32, the future masked to -inf.
torch::Tensor block_scores(const torch::Tensor& q, const torch::Tensor& k,
                           const torch::Tensor& q_pos, const torch::Tensor& k_pos, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  torch::Tensor s = q.to(torch::kFloat).matmul(k.to(torch::kFloat).transpose(-2, -1)) * scale;
  if (causal) s = s.masked_fill(future(q_pos, k_pos, q.device()), -kInf);
  return s;
}

}  // namespace

torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& q_pos,
                               const torch::Tensor& k_pos, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  torch::Tensor att = q.matmul(k.transpose(-2, -1)) * scale;
  if (causal) att = att.masked_fill(future(q_pos, k_pos, q.device()), -kInf);
  return att.softmax(-1).matmul(v);
}

BlockOut block_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& q_pos, const torch::Tensor& k_pos, bool causal) {
  observe(q, k, /*backward=*/false);
  TraceSpan span("attn");  // with --trace: one span per block on the timeline
  torch::NoGradGuard no_grad;
  const torch::Tensor s = block_scores(q, k, q_pos, k_pos, causal);  // (B, H, Tq, Tk)
  torch::Tensor m = std::get<0>(s.max(-1, /*keepdim=*/true));        // -inf: a row sees nothing
  m = torch::where(torch::isinf(m), torch::zeros_like(m), m);
  const torch::Tensor p = (s - m).exp();  // the future: exp(-inf) = 0
  const torch::Tensor l = p.sum(-1, /*keepdim=*/true);
  BlockOut b;
  b.out = p.matmul(v.to(torch::kFloat)) / torch::where(l > 0, l, torch::ones_like(l));
  b.lse = (l.log() + m).squeeze(-1);  // log 0 = -inf where the row saw no key
  return b;
}

BlockGrads block_attention_backward(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& q_pos,
                                    const torch::Tensor& k_pos, bool causal,
                                    const torch::Tensor& out, const torch::Tensor& lse,
                                    const torch::Tensor& dout) {
  observe(q, k, /*backward=*/true);
  TraceSpan span("attn bwd");
  torch::NoGradGuard no_grad;
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const torch::Tensor s = block_scores(q, k, q_pos, k_pos, causal);
  const torch::Tensor finite = torch::where(torch::isinf(lse), torch::zeros_like(lse), lse);
  const torch::Tensor p = (s - finite.unsqueeze(-1)).exp();  // (B, H, Tq, Tk), in the whole softmax
  const torch::Tensor dO = dout.to(torch::kFloat);
  const torch::Tensor dp = dO.matmul(v.to(torch::kFloat).transpose(-2, -1));
  const torch::Tensor delta = (dO * out.to(torch::kFloat)).sum(-1, /*keepdim=*/true);
  const torch::Tensor ds = p * (dp - delta);
  BlockGrads g;
  g.dv = p.transpose(-2, -1).matmul(dO);
  g.dq = ds.matmul(k.to(torch::kFloat)) * scale;
  g.dk = ds.transpose(-2, -1).matmul(q.to(torch::kFloat)) * scale;
  return g;
}

BlockObserver set_block_observer(BlockObserver o) {
  BlockObserver previous = std::move(observer);
  observer = std::move(o);
  return previous;
}

std::vector<torch::Tensor> Rotation::finish() {
  for (auto& w : work) w->wait();
  work.clear();
  return received;
}

Rotation start_rotation(const std::vector<torch::Tensor>& tensors, Comm& cp, int tag) {
  const int r = cp.getRank(), n = cp.getSize();
  Rotation rotation;
  if (n == 1) {  // a ring of one: what is sent comes straight back (gloo cannot send to itself)
    for (const auto& t : tensors) rotation.received.push_back(t.clone());
    return rotation;
  }
  std::vector<P2POp> ops;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::Tensor t = tensors[i].contiguous();
    rotation.received.push_back(torch::empty_like(t));
    ops.push_back({P2POp::kSend, t, (r + 1) % n, tag + static_cast<int>(i)});
    ops.push_back(
        {P2POp::kRecv, rotation.received.back(), (r + n - 1) % n, tag + static_cast<int>(i)});
  }
  rotation.work = batch_isend_irecv(cp, ops);
  return rotation;
}

}  // namespace dtc::l10

// Lesson 10's given pieces (context_parallel_given.h): the mesh, the training loop, activation
// memory and communication volume.
#include "context_parallel_given.h"

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <thread>

#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/program.h"

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

std::vector<float> train_cp(const CpConfig& c, Comm& cp, Comm& replicas, int64_t steps,
                            const torch::Device& device,
                            const std::function<void(int64_t, float)>& on_step,
                            nlohmann::json* digest, std::vector<torch::Tensor>* weights, Comm* tp) {
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
  return losses;
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
    case Attention::kRing: return norms + split_by_tp + 4 * n * h / t + 4 * n * heads;
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

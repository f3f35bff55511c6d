// Lesson 13, given: the router, the experts, the single-device MoE, the model, the groups and
// the training loop (moe_given.h). The parallel parts are in moe.cpp.
#include "moe_given.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtc/data.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/mesh.h"
#include "moe.h"

namespace dtc::l13 {

const char* score_func_name(ScoreFunc f) {
  return f == ScoreFunc::kSoftmax ? "softmax" : "sigmoid";
}

const char* balance_name(Balance b) {
  switch (b) {
    case Balance::kNone: return "none";
    case Balance::kAux: return "aux";
    case Balance::kBias: return "bias";
  }
  return "?";
}

void check_moe(const MoeConfig& c, int world, int ep) {
  if (c.experts < 1) {
    throw UsageError("--experts", fmt::format("{} experts: a layer needs at least one", c.experts),
                     "pass --experts 4 (or more)");
  }
  if (c.top_k < 1 || c.top_k > c.experts) {
    throw UsageError("--top-k",
                     fmt::format("top-{} of {} experts: each token picks between 1 and --experts",
                                 c.top_k, c.experts),
                     fmt::format("pass --top-k 1 to {}", c.experts));
  }
  if (c.shared < 0) {
    throw UsageError("--shared-experts", fmt::format("{} shared experts", c.shared),
                     "pass --shared-experts 0 (none) or more");
  }
  if (c.capacity_factor < 0 || !std::isfinite(c.capacity_factor)) {
    throw UsageError("--capacity-factor",
                     fmt::format("a capacity factor of {:g}: it must be 0 (dropless) or above",
                                 c.capacity_factor),
                     "pass --capacity-factor 0 (dropless) or e.g. 1.25 (Switch's range 1.0-1.25)");
  }
  const std::pair<double, const char*> nonneg[] = {
      {c.aux_coef, "--aux-loss-coef"}, {c.z_coef, "--z-loss-coef"}, {c.bias_rate, "--bias-rate"}};
  for (const auto& [v, flag] : nonneg) {
    if (v < 0 || !std::isfinite(v)) {
      throw UsageError(flag, fmt::format("{:g}: it must be 0 or above", v),
                       fmt::format("pass e.g. {} 0.001", flag));
    }
  }
  if (ep < 1) {
    throw UsageError("--ep", fmt::format("ep {}: it must be 1 or more", ep), "pass --ep 2");
  }
  if (c.experts % ep != 0) {
    throw UsageError("--ep",
                     fmt::format("{} experts do not split evenly over ep {}", c.experts, ep),
                     fmt::format("pass an --ep that divides --experts {} (or --experts {})",
                                 c.experts, ep * std::max<int64_t>(1, c.experts / ep)));
  }
  if (world % ep != 0) {
    throw UsageError(
        "--ep",
        fmt::format("ep {} does not divide the {} ranks: ep is folded over the data-parallel "
                    "ranks, it never multiplies the world size",
                    ep, world),
        fmt::format("launch a multiple of {} ranks (--nproc_per_node={}), or pass an --ep that "
                    "divides {}",
                    ep, ep, world));
  }
}

int64_t expert_capacity(const MoeConfig& c, int64_t tokens) {
  if (c.capacity_factor <= 0) return -1;
  return static_cast<int64_t>(std::ceil(c.capacity_factor * static_cast<double>(tokens * c.top_k) /
                                        static_cast<double>(c.experts)));
}

bool is_expert(const std::string& name) { return name.find(".mlp.experts.") != std::string::npos; }

// ---------------------------------------------------------------------------------------------
// The router
// ---------------------------------------------------------------------------------------------

Routing route(const torch::Tensor& x, const torch::Tensor& router_weight, const torch::Tensor& bias,
              const MoeConfig& c, RouterStats& stats) {
  const int64_t n = x.size(0);
  const int64_t e = c.experts;
  torch::Tensor logits = torch::matmul(x.to(torch::kFloat), router_weight.to(torch::kFloat).t());
  torch::Tensor s = c.score == ScoreFunc::kSoftmax ? logits.softmax(-1) : logits.sigmoid();
  Routing r;
  // the bias picks experts, it never weights them (DeepSeek-V3 sec. 2.1.2)
  r.experts = std::get<1>((s.detach() + bias.to(torch::kFloat)).topk(c.top_k, -1));
  r.weights = s.gather(-1, r.experts);
  if (c.route_norm) r.weights = r.weights / r.weights.sum(-1, /*keepdim=*/true);
  const torch::Tensor flat = r.experts.reshape({-1});
  const int64_t cap = expert_capacity(c, n);
  if (cap < 0) {
    r.keep = torch::ones_like(r.experts, torch::kBool);
  } else {
    // copy (t, j)'s place among the copies of its expert, in token order, then choice order
    const torch::Tensor onehot = torch::one_hot(flat, e);  // (N k, E)
    const torch::Tensor before = (onehot.cumsum(0) - onehot) * onehot;
    r.keep = (before.sum(1) < cap).reshape({n, c.top_k});
  }
  stats.logits = logits;
  stats.shares = c.score == ScoreFunc::kSoftmax ? s : s / s.sum(-1, /*keepdim=*/true);
  stats.counts = torch::bincount(flat, {}, e).to(torch::kLong);
  stats.kept = torch::bincount(flat.masked_select(r.keep.reshape({-1})), {}, e).to(torch::kLong);
  return r;
}

// ---------------------------------------------------------------------------------------------
// The experts
// ---------------------------------------------------------------------------------------------

StackedLinearImpl::StackedLinearImpl(int64_t n, int64_t in, int64_t out) {
  weight = register_parameter("weight", torch::empty({n, out, in}));
  bias = register_parameter("bias", torch::zeros({n, out}));
}

ExpertsImpl::ExpertsImpl(int64_t count, int64_t hidden, int64_t ffn, int64_t first)
    : first_(first) {
  c_fc = register_module("c_fc", StackedLinear(count, hidden, ffn));
  c_proj = register_module("c_proj", StackedLinear(count, ffn, hidden));
}

torch::Tensor ExpertsImpl::forward(const torch::Tensor& tokens,
                                   const std::vector<int64_t>& tokens_per_expert) {
  TORCH_CHECK(static_cast<int64_t>(tokens_per_expert.size()) == count(),
              "run the experts: ", tokens_per_expert.size(), " counts for ", count(), " experts");
  int64_t total = 0;
  for (int64_t n : tokens_per_expert) {
    TORCH_CHECK(n >= 0, "run the experts: a negative count");
    total += n;
  }
  TORCH_CHECK(total == tokens.size(0), "run the experts: the counts sum to ", total, " but ",
              tokens.size(0), " rows came");
  std::vector<torch::Tensor> out;
  int64_t row = 0;
  for (int64_t j = 0; j < count(); ++j) {
    // every expert, even with no rows: the result stays in the autograd graph, so that this
    // rank's backward all-to-all runs when its experts got nothing (a rank that skipped it would
    // leave the others waiting: the zero-size hang of nccl#1593, torchtitan PR#1166)
    out.push_back(run(j, tokens.narrow(0, row, tokens_per_expert[j])));
    row += tokens_per_expert[j];
  }
  return torch::cat(out, 0);
}

torch::Tensor ExpertsImpl::run(int64_t j, const torch::Tensor& x, bool proj_bias) {
  const torch::Tensor hid = torch::gelu(torch::matmul(x, c_fc->weight[j].t()) + c_fc->bias[j]);
  const torch::Tensor y = torch::matmul(hid, c_proj->weight[j].t());
  return proj_bias ? y + c_proj->bias[j] : y;
}

void ExpertsImpl::keep(int64_t first, int64_t n) {
  TORCH_CHECK(first >= first_ && first + n <= first_ + count(), "keep experts [", first, ", ",
              first + n, ") of the [", first_, ", ", first_ + count(), ") held");
  for (StackedLinear* lin : {&c_fc, &c_proj}) {
    torch::NoGradGuard no_grad;
    (*lin)->weight.set_data((*lin)->weight.narrow(0, first - first_, n).clone());
    (*lin)->bias.set_data((*lin)->bias.narrow(0, first - first_, n).clone());
  }
  first_ = first;
}

FfnImpl::FfnImpl(int64_t hidden, int64_t width) {
  c_fc = register_module("c_fc", torch::nn::Linear(hidden, width));
  c_proj = register_module("c_proj", torch::nn::Linear(width, hidden));
}

torch::Tensor FfnImpl::forward(const torch::Tensor& x) { return c_proj(torch::gelu(c_fc(x))); }

// ---------------------------------------------------------------------------------------------
// The MoE layer
// ---------------------------------------------------------------------------------------------

MoeLayerImpl::MoeLayerImpl(const GptConfig& model, const MoeConfig& moe) : moe_(moe) {
  router = register_module(
      "router", torch::nn::Linear(torch::nn::LinearOptions(model.hidden, moe.experts).bias(false)));
  experts = register_module("experts", Experts(moe.experts, model.hidden, model.ffn()));
  if (moe.shared > 0)
    shared = register_module("shared", Ffn(model.hidden, moe.shared * model.ffn()));
  expert_bias = register_buffer("expert_bias", torch::zeros({moe.experts}));
}

void MoeLayerImpl::shard_experts(Comm* ep) {
  if (ep == nullptr || ep->getSize() == 1) return;
  const int64_t local = moe_.experts / ep->getSize();
  experts->keep(ep->getRank() * local, local);
  ep_ = ep;
}

void MoeLayerImpl::split_experts(Comm* group) {
  if (group == nullptr || group->getSize() == 1) return;
  const int64_t p = group->getSize();
  const int64_t ffn = experts->c_fc->weight.size(1);
  TORCH_CHECK(ffn % p == 0, "tensor-parallel experts: 4h = ", ffn, " does not split over ", p,
              " ranks");
  const int64_t w = ffn / p, at = group->getRank() * w;
  torch::NoGradGuard no_grad;
  experts->c_fc->weight.set_data(experts->c_fc->weight.narrow(1, at, w).clone());
  experts->c_fc->bias.set_data(experts->c_fc->bias.narrow(1, at, w).clone());
  experts->c_proj->weight.set_data(experts->c_proj->weight.narrow(2, at, w).clone());
  tp_ = group;
}

namespace {

// An all-to-all of equal splits: rows [q n, (q+1) n) of x to rank q.
torch::Tensor even_exchange(const torch::Tensor& x, Comm& comm) {
  torch::Tensor in = x.contiguous();
  torch::Tensor out = torch::empty_like(in);
  std::vector<int64_t> none;
  comm.alltoall_base(out, in, none, none)->wait();
  return out;
}

torch::Tensor repeat_rows(const torch::Tensor& x, int64_t p) {
  std::vector<torch::Tensor> copies(static_cast<size_t>(p), x);
  return torch::cat(copies, 0);
}

torch::Tensor sum_blocks(const torch::Tensor& x, int64_t p) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] /= p;
  shape.insert(shape.begin(), p);
  return x.reshape(shape).sum(0);
}

class GatherRows : public torch::autograd::Function<GatherRows> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               int64_t comm) {
    ctx->saved_data["comm"] = comm;
    Comm& c = comm_from(comm);
    return even_exchange(repeat_rows(x, c.getSize()), c);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list g) {
    Comm& c = comm_of(ctx);
    return {sum_blocks(even_exchange(g[0], c), c.getSize()), torch::Tensor()};
  }
};

class ScatterSum : public torch::autograd::Function<ScatterSum> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               int64_t comm) {
    ctx->saved_data["comm"] = comm;
    Comm& c = comm_from(comm);
    return sum_blocks(even_exchange(x, c), c.getSize());
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list g) {
    Comm& c = comm_of(ctx);
    return {even_exchange(repeat_rows(g[0], c.getSize()), c), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor gather_rows(const torch::Tensor& x, Comm& group) {
  if (!x.requires_grad()) {
    torch::NoGradGuard no_grad;
    return even_exchange(repeat_rows(x, group.getSize()), group);
  }
  return GatherRows::apply(x, comm_handle(group));
}

torch::Tensor scatter_sum(const torch::Tensor& partial, Comm& group) {
  return ScatterSum::apply(partial, comm_handle(group));
}

namespace {

// The MoE expert by expert: for each expert e, the kept copies that chose it (@p chosen, @p weight
// and @p keep flattened over x's rows and their k choices), through expert e, each times its
// router weight, added into its row of x.
torch::Tensor expert_by_expert(ExpertsImpl& experts, const torch::Tensor& x,
                               const torch::Tensor& chosen, const torch::Tensor& weight,
                               const torch::Tensor& keep, int64_t k, bool proj_bias = true) {
  const torch::Tensor token = torch::arange(x.size(0), chosen.options()).repeat_interleave(k);
  torch::Tensor out = torch::zeros_like(x);
  for (int64_t e = 0; e < experts.count(); ++e) {
    const torch::Tensor sel = torch::nonzero(chosen.eq(e).logical_and(keep)).reshape({-1});
    if (sel.numel() == 0) continue;
    const torch::Tensor t = token.index_select(0, sel);
    const torch::Tensor y = experts.run(e, x.index_select(0, t), proj_bias);
    out = out.index_add(0, t, y * weight.index_select(0, sel).unsqueeze(1).to(y.dtype()));
  }
  return out;
}

}  // namespace

torch::Tensor MoeLayerImpl::forward(const torch::Tensor& x) {
  const torch::Tensor xf = x.reshape({-1, x.size(-1)});
  const Routing r = route(xf, router->weight, expert_bias, moe_, stats);
  torch::Tensor out;
  if (tp_ != nullptr) {
    // every rank's tokens and routing, this rank's slice of every expert over all of them
    const torch::Tensor xs = gather_rows(xf, *tp_);
    const torch::Tensor chosen = gather_rows(r.experts, *tp_).reshape({-1});
    const torch::Tensor weight = gather_rows(r.weights, *tp_).reshape({-1});
    const torch::Tensor keep = gather_rows(r.keep.to(torch::kLong), *tp_).reshape({-1}).gt(0);
    const torch::Tensor partial =
        expert_by_expert(*experts, xs, chosen, weight, keep, moe_.top_k, /*proj_bias=*/false);
    // each token's output: its partial sums from every rank, and the c_proj bias of its kept
    // choices, added once, here
    const torch::Tensor w_kept = r.weights * r.keep.to(r.weights.dtype());  // (N, k)
    const torch::Tensor bias = experts->c_proj->bias.index_select(0, r.experts.reshape({-1}))
                                   .reshape({r.experts.size(0), moe_.top_k, -1});
    out = scatter_sum(partial, *tp_) + (w_kept.unsqueeze(2) * bias).sum(1);
  } else if (ep_ == nullptr) {
    // the single-device MoE
    out = expert_by_expert(*experts, xf, r.experts.reshape({-1}), r.weights.reshape({-1}),
                           r.keep.reshape({-1}), moe_.top_k);
  } else {
    const Dispatch d = dispatch(xf, r, moe_.experts, *ep_);
    if (on_experts) on_experts(d.tokens, d.tokens_per_expert);
    out = combine(experts->forward(d.tokens, d.tokens_per_expert), d, r, *ep_);
  }
  if (shared) out = out + shared->forward(xf);
  return out.reshape(x.sizes());
}

Gpt make_moe_gpt(const GptConfig& model, const MoeConfig& moe, uint64_t seed) {
  Gpt gpt(model);
  for (int64_t i = 0; i < model.layers; ++i) {
    gpt->h[i]->as<Block>()->swap_mlp(MoeLayer(model, moe));
  }
  init_weights(gpt, seed);
  return gpt;
}

MoeLayerImpl& moe_layer(Gpt& model, int64_t i) {
  return model->h[i]->as<BlockImpl>()->part<MoeLayerImpl>("mlp");
}

void shard_experts(Gpt& model, Comm* ep) {
  for (int64_t i = 0; i < model->config().layers; ++i) {
    moe_layer(model, i).shard_experts(ep);
  }
}

// ---------------------------------------------------------------------------------------------
// Groups and training
// ---------------------------------------------------------------------------------------------

Mesh moe_mesh(int world, int ep) {
  return Mesh::build(world, {{"dp_replicate", world / ep, "--ep"}, {"dp_shard", ep, "--ep"}});
}

std::vector<int> ep_group(int rank, int world, int ep) {
  return moe_mesh(world, ep).group(rank, {"dp_shard"});
}

std::vector<int> expert_data_group(int rank, int world, int ep) {
  return moe_mesh(world, ep).group(rank, {"dp_replicate"});
}

MoeGroups make_moe_groups(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int ep,
                          BackendKind backend, std::chrono::milliseconds timeout,
                          const std::string& master_addr) {
  const Mesh mesh = moe_mesh(world, ep);
  const std::vector<std::string> data = {"dp_replicate", "dp_shard"}, eps = {"dp_shard"},
                                 edp = {"dp_replicate"};
  const MeshGroups groups(store, mesh, rank, {data, eps, edp}, backend, timeout, master_addr);
  MoeGroups g;
  g.rank = rank;
  g.world = world;
  g.ep_size = ep;
  g.data = c10::make_intrusive<RecordingComm>(groups.get(data));
  g.ep = c10::make_intrusive<RecordingComm>(groups.get(eps));
  g.expert_data = c10::make_intrusive<RecordingComm>(groups.get(edp));
  return g;
}

MoeTrainer::MoeTrainer(const RunConfig& run, const MoeConfig& moe, MoeGroups& groups,
                       torch::Device device)
    : run_(run), moe_(moe), g_(groups), device_(device) {
  model_ = make_moe_gpt(run.model, moe, run.seed);
  for (const auto& p : model_->named_parameters()) names_.push_back(p.key());
  if (g_.ep_size > 1) shard_experts(model_, g_.ep.get());
  model_->to(device_);
  // AdamW whose step is an "optimizer" span on the timeline with --trace
  adamw_ = std::make_unique<TracedAdamW>(model_->parameters(), adamw_options(run_));
}

std::vector<std::pair<std::string, torch::Tensor>> MoeTrainer::named_parameters() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : model_->named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

MoeStep MoeTrainer::step(int64_t step) {
  const int64_t rows = run_.batch / g_.world;
  const GptConfig& m = run_.model;
  const Batch batch = ByteDataset::builtin()
                          .batch(run_.seed, step, rows, m.ctx, static_cast<int64_t>(g_.rank) * rows)
                          .to(device_);
  adamw_->zero_grad();
  const torch::Tensor logits = model_->forward(batch.inputs);
  const torch::Tensor ce = torch::nn::functional::cross_entropy(logits.reshape({-1, m.vocab}),
                                                                batch.targets.reshape({-1}));
  std::vector<RouterStats> stats;
  for (int64_t i = 0; i < m.layers; ++i) {
    stats.push_back(moe_layer(model_, i).stats);
  }
  const torch::Tensor loss = moe_loss(ce, stats, moe_, *g_.data);
  loss.backward();
  if (after_backward) after_backward();
  reduce_gradients(named_parameters(), *g_.data, *g_.expert_data);
  if (after_reduce) after_reduce();
  adamw_->step();
  if (moe_.balance == Balance::kBias) {
    for (int64_t i = 0; i < m.layers; ++i) {
      MoeLayerImpl& layer = moe_layer(model_, i);
      torch::NoGradGuard no_grad;
      update_expert_bias(layer.expert_bias, stats[i].counts, moe_.bias_rate, *g_.data);
    }
  }

  // The report, over the whole job (the unrecorded communicator under `data`: the learner's
  // collectives are what the tests count).
  Comm& report = *g_.data->inner();
  std::vector<torch::Tensor> counts;
  for (const RouterStats& s : stats) {
    counts.push_back(s.counts);
    counts.push_back(s.kept);
  }
  std::vector<torch::Tensor> all{torch::cat({torch::stack(counts).to(torch::kDouble).reshape({-1}),
                                             loss.detach().to(torch::kDouble).reshape({1})})};
  report.allreduce(all)->wait();
  const torch::Tensor sums = all[0].cpu();
  MoeStep out;
  out.loss = static_cast<float>(sums[sums.size(0) - 1].item<double>() / g_.world);
  const int64_t e = moe_.experts;
  const int ep = g_.ep_size;
  out.imbalance = 1;
  out.expert_imbalance = 1;
  for (int64_t i = 0; i < m.layers; ++i) {
    const torch::Tensor c = sums.narrow(0, 2 * i * e, e);
    const torch::Tensor k = sums.narrow(0, (2 * i + 1) * e, e);
    std::vector<int64_t> cv, kv;
    for (int64_t j = 0; j < e; ++j) {
      cv.push_back(std::llround(c[j].item<double>()));
      kv.push_back(std::llround(k[j].item<double>()));
    }
    out.counts.push_back(cv);
    out.kept.push_back(kv);
    const double mean = c.mean().item<double>();
    if (mean > 0)
      out.expert_imbalance = std::max(out.expert_imbalance, c.max().item<double>() / mean);
    const torch::Tensor per_rank = k.reshape({ep, e / ep}).sum(1);
    const double rank_mean = per_rank.mean().item<double>();
    if (rank_mean > 0) {
      out.imbalance = std::max(out.imbalance, per_rank.max().item<double>() / rank_mean);
    }
  }
  return out;
}

nlohmann::json MoeTrainer::digest() {
  // each element once over the job: the replicated parameters from rank 0, each expert shard from
  // the first rank of its expert-data group
  std::vector<NamedPiece> pieces;
  const bool first_replica = g_.expert_data->getRank() == 0;
  for (const auto& [name, p] : named_parameters()) {
    if (is_expert(name) ? first_replica : g_.rank == 0) pieces.emplace_back(name, p.detach());
  }
  return param_digest(names_, pieces, g_.data->inner().get());
}

}  // namespace dtc::l13

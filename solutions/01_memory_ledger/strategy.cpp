// Lesson 01, part 2: the five parallelism strategies, and choosing a mix. Implements
// lessons/01_memory_ledger/strategy.h.
//
// Fill in every TODO(L01) below, top to bottom; `make test-lesson01` checks the collectives
// against nccl-tests' factors, the traffic against closed forms, and your plans against
// published set-ups (Megatron's GPT-3 175B, Llama 3 405B, a 7B model on one node).
// The cluster presets, the candidate mixes, the reasons and the plan around your decision tree are
// given, in strategy_given.cpp.
#include "strategy.h"

#include <optional>

#include "dtc/todo.h"

namespace dtc::l01 {

namespace {

constexpr double kGB = 1e9;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Traffic, links and the ledger of a mix (your part)
// ---------------------------------------------------------------------------------------------

double collective_bytes(Collective c, double bytes, int64_t n) {
  // BEGIN SOLUTION: return what each of n ranks sends: the array's bytes times its collective's
  //   bus-bandwidth factor (strategy.h); a group of one sends nothing, but send/recv always
  //   sends its array. Tests: L01Collectives.*
  const double k = static_cast<double>(n);
  switch (c) {
    case Collective::kAllReduce: return n <= 1 ? 0.0 : 2.0 * (k - 1) / k * bytes;
    case Collective::kReduceScatter:
    case Collective::kAllGather:
    case Collective::kAllToAll: return n <= 1 ? 0.0 : (k - 1) / k * bytes;  // keeps its own 1/n
    case Collective::kSendRecv: return bytes;
  }
  return 0.0;
  // END SOLUTION
}

double step_bytes_per_gpu(Strategy s, const PlanRequest& req, const Mix& mix) {
  // BEGIN SOLUTION: return README's "one formula per strategy" for s in this mix, every term a
  //   collective_bytes() (a group of degree 1 sends nothing). Tests: L01Traffic.*; hints:
  //   README part 2, "The exercise"
  const ModelConfig& model = req.model;
  const double params = static_cast<double>(count_params(model));
  const double replica = params / static_cast<double>(mix.tp * mix.pp);  // P_r
  const double weights = weight_wire_bytes(req.setup) * replica;  // one replica's weights, w P_r
  const double grads = gradient_wire_bytes(req.setup) * replica;  // ... its gradients, g P_r
  const double m = micro_batches(req, mix);
  const double tokens = static_cast<double>(req.setup.seq) / static_cast<double>(mix.cp) *
                        static_cast<double>(mix.micro_batch);           // (s/cp) b per GPU
  const double act = tokens * static_cast<double>(model.hidden) * 2.0;  // (s/cp) b h, 16-bit
  const double layers = static_cast<double>(model.layers) / static_cast<double>(mix.pp);
  const bool full = mix.recompute == Recompute::kFull;
  const int64_t n_dp = mix.zero_degree();
  switch (s) {
    case Strategy::kDdp:
      if (mix.shard > 0) {  // HSDP: each rank's gradient shard, allreduced across the groups
        return collective_bytes(Collective::kAllReduce, grads / static_cast<double>(mix.shard),
                                mix.dp * mix.cp / mix.shard);
      }
      return collective_bytes(Collective::kAllReduce, grads, mix.dp * mix.cp);
    case Strategy::kZero1:
      return collective_bytes(Collective::kReduceScatter, grads, n_dp) +
             collective_bytes(Collective::kAllGather, weights, n_dp);
    case Strategy::kZero2:
      return m * collective_bytes(Collective::kReduceScatter, grads, n_dp) +
             collective_bytes(Collective::kAllGather, weights, n_dp);
    case Strategy::kZero3:
      return m * (2 * collective_bytes(Collective::kAllGather, weights, n_dp) +
                  collective_bytes(Collective::kReduceScatter, grads, n_dp));
    case Strategy::kTp: {
      // sequence parallel: 2 (all-gather + reduce-scatter) forward, 2 backward, and the 2
      // inputs all-gathered again backward: 5 allreduces' bytes (+2 recomputed)
      const double allreduces = full ? 7.0 : 5.0;
      return m * layers * allreduces * collective_bytes(Collective::kAllReduce, act, mix.tp);
    }
    case Strategy::kPp:
      if (mix.pp <= 1) return 0.0;
      // activations forward, their gradients backward, per model chunk; each tp rank sends its
      // 1/tp slice
      return m * 2.0 * static_cast<double>(mix.virtual_stages) *
             collective_bytes(Collective::kSendRecv, act / static_cast<double>(mix.tp), mix.pp);
    case Strategy::kCp: {
      // K and V of the whole sequence: 2 s b kv_dim values, 16-bit, kv heads split over tp
      const double kv = 2.0 * static_cast<double>(req.setup.seq * mix.micro_batch) *
                        static_cast<double>(model.kv_dim()) * 2.0 / static_cast<double>(mix.tp);
      const double collectives = full ? 3.0 : 2.0;  // gather fwd, scatter grads bwd (+regather)
      return m * layers * collectives * collective_bytes(Collective::kAllGather, kv, mix.cp);
    }
    case Strategy::kEp: {
      // each of this GPU's (s/cp) b / tp tokens goes to k experts: T k h values, 16-bit
      const double routed = tokens / static_cast<double>(mix.tp) *
                            static_cast<double>(model.top_k * model.hidden) * 2.0;
      const double moe_layers =
          static_cast<double>(model.moe_layers()) / static_cast<double>(mix.pp);
      const double all_to_alls = full ? 6.0 : 4.0;  // dispatch, combine; forward and backward
      return m * moe_layers * all_to_alls * collective_bytes(Collective::kAllToAll, routed, mix.ep);
    }
  }
  return 0.0;
  // END SOLUTION
}

bool crosses_nodes(Strategy s, const Mix& mix, int64_t gpus_per_node) {
  // BEGIN SOLUTION: return whether the group of s spans more than one node under the rank order
  //   tp, cp, pp, dp; the data-parallel flavours cross when their dp or cp group does.
  //   Tests: L01Links.*; hints: README part 2, "The exercise"
  const auto crosses = [&](int64_t n, int64_t stride) {
    if (n <= 1) return false;
    const int64_t span = n * stride;
    return span > gpus_per_node || gpus_per_node % span != 0;
  };
  const int64_t dp_stride = mix.tp * mix.cp * mix.pp;
  switch (s) {
    case Strategy::kTp: return crosses(mix.tp, 1);
    case Strategy::kCp: return crosses(mix.cp, mix.tp);
    case Strategy::kPp: return crosses(mix.pp, mix.tp * mix.cp);
    case Strategy::kEp: return crosses(mix.ep, dp_stride);  // ep consecutive dp ranks
    case Strategy::kDdp:
      if (mix.shard > 0) return crosses(mix.dp / mix.shard, dp_stride * mix.shard);
      return crosses(mix.dp, dp_stride) || crosses(mix.cp, mix.tp);
    default:
      if (mix.shard > 0) return crosses(mix.shard, dp_stride);
      return crosses(mix.dp, dp_stride) || crosses(mix.cp, mix.tp);
  }
  // END SOLUTION
}
Ledger mix_ledger(const PlanRequest& req, const Mix& mix) {
  // BEGIN SOLUTION: return part 1's ledger of this mix as strategy.h specifies it: ZeRO over
  //   dp * cp, sequence parallel with tp, activations per cp, ZeRO-3's gathered layer on top.
  //   Tests: L01MixLedger.*; hints: README part 2, "The exercise"
  TrainingSetup s = req.setup;
  s.dp = mix.zero_degree();
  s.tp = mix.tp;
  s.pp = mix.pp;
  s.ep = mix.ep;
  s.micro_batch = mix.micro_batch;
  s.zero_stage = mix.zero_stage;
  s.recompute = mix.recompute;
  s.sequence_parallel = mix.tp > 1;
  Ledger l = compute_ledger(count_params(req.model), s, &req.model);
  const double cp = static_cast<double>(mix.cp);
  const double layers_held = l.activation_bytes / l.per_layer_activation_bytes;
  l.per_layer_activation_bytes /= cp;
  if (mix.cp > 1 && mix.recompute != Recompute::kFull) {  // the gathered K and V, kept whole
    l.per_layer_activation_bytes += 2.0 * static_cast<double>(s.seq * s.micro_batch) *
                                    static_cast<double>(req.model.kv_dim()) * 2.0 *
                                    (1.0 - 1.0 / cp) / static_cast<double>(mix.tp);
  }
  l.activation_bytes = l.per_layer_activation_bytes * layers_held;
  if (mix.virtual_stages > 1) {  // interleaved: (pp - 1) / v more stages' worth in flight
    const double pp = static_cast<double>(mix.pp);
    const double stage = static_cast<double>((req.model.layers + mix.pp - 1) / mix.pp);
    l.activation_bytes = l.per_layer_activation_bytes * stage *
                         (pp + (pp - 1.0) / static_cast<double>(mix.virtual_stages));
  }
  if (mix.zero_stage == 3) {  // one layer's weights gathered, and its gradient before scattering
    const double layer =
        static_cast<double>(l.params) / static_cast<double>(mix.tp * req.model.layers);
    l.state.params += l.per_param.params * layer;
    l.state.grads += l.per_param.grads * layer;
  }
  return l;
  // END SOLUTION
}

Evaluation evaluate(const PlanRequest& req, const Mix& mix) {
  Evaluation e;
  e.mix = mix;
  // BEGIN SOLUTION: fill every other field of e as Evaluation documents it (traffic: one entry
  //   per group of degree > 1, in the order dp, tp, pp, cp, ep; step = compute x (1 + bubble)
  //   + comm). Tests: L01Evaluate.*; hints: README part 2, "The exercise"
  e.ledger = mix_ledger(req, mix);
  e.capacity_bytes = kUsableMemory * req.cluster.gpu_mem_gb * kGB;
  e.fits = e.ledger.total_bytes() <= e.capacity_bytes;
  e.micro_batches = micro_batches(req, mix);
  e.batch_ok = mix.dp * mix.micro_batch <= req.batch() &&
               (mix.pp == 1 || e.micro_batches >= static_cast<double>(mix.pp));
  const auto add = [&](Strategy s, int64_t degree) {
    if (degree <= 1) return;
    GroupTraffic t;
    t.strategy = s;
    t.degree = degree;
    t.bytes_per_gpu = step_bytes_per_gpu(s, req, mix);
    t.crosses_nodes = crosses_nodes(s, mix, req.cluster.gpus_per_node);
    t.gbps = link_gbps(req.cluster, s, mix);
    t.seconds = t.bytes_per_gpu / (t.gbps * kGB);
    e.comm_time_s += t.seconds;
    e.traffic.push_back(t);
  };
  add(zero_strategy(mix.zero_stage), mix.zero_degree());
  if (mix.shard > 0) add(Strategy::kDdp, mix.dp * mix.cp / mix.shard);  // HSDP's replication
  add(Strategy::kTp, mix.tp);
  add(Strategy::kPp, mix.pp);
  add(Strategy::kCp, mix.cp);
  add(Strategy::kEp, mix.ep);
  const double tokens = static_cast<double>(req.batch() * req.setup.seq);
  e.compute_time_s = train_time_seconds(static_cast<double>(active_params(req.model)), tokens,
                                        req.cluster.peak_tflops * 1e12, req.mfu, mix.gpus()) *
                     recompute_flops_factor(req.model, req.setup.seq, mix.recompute);
  e.bubble =
      static_cast<double>(mix.pp - 1) / (static_cast<double>(mix.virtual_stages) * e.micro_batches);
  e.step_time_s = e.compute_time_s * (1.0 + e.bubble) + e.comm_time_s;
  // END SOLUTION
  return e;
}

// ---------------------------------------------------------------------------------------------
// The decision tree (your part)
// ---------------------------------------------------------------------------------------------

namespace {

const Family kFamilies[] = {Family::kDdp, Family::kZero, Family::kTensor, Family::kPipeline,
                            Family::kContext};

}  // namespace

Plan choose_mix(const PlanRequest& req) {
  Plan p;
  // BEGIN SOLUTION: fill p.branches (each family's fastest fitting, fed candidate), then
  //   p.eval, p.family and p.reasons with the fastest of them, a later branch only when it is
  //   more than kSimplerWithin faster (strategy.h); or the least-memory candidate when nothing
  //   fits. Tests: L01Plan.*; hints: README part 2, "The exercise"
  std::optional<Evaluation> chosen;
  for (Family f : kFamilies) {
    Branch branch;
    branch.family = f;
    for (const Mix& mix : candidates(req, f)) {
      Evaluation e = evaluate(req, mix);
      if (e.fits && e.batch_ok && (!branch.best || e.step_time_s < branch.best->step_time_s)) {
        branch.best = std::move(e);
      }
    }
    if (branch.best &&
        (!chosen || branch.best->step_time_s < (1.0 - kSimplerWithin) * chosen->step_time_s)) {
      chosen = branch.best;
      p.family = f;
    }
    p.branches.push_back(std::move(branch));
  }
  if (!chosen) {  // nothing fits: show the mix that comes closest
    for (Family f : kFamilies) {
      for (const Mix& mix : candidates(req, f)) {
        Evaluation e = evaluate(req, mix);
        if (!chosen || e.ledger.total_bytes() < chosen->ledger.total_bytes()) {
          chosen = std::move(e);
          p.family = f;
        }
      }
    }
  }
  p.eval = *chosen;
  p.reasons = explain(req, p.eval, p.family);
  // END SOLUTION
  return p;
}

}  // namespace dtc::l01

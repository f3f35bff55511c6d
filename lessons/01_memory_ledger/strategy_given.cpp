// Lesson 01, part 2 (given): the cluster presets and checks, the strategies' names, the candidate
// mixes and the reasons given for them, the plan and the comparison table. Your part, the traffic
// and the decision tree, is in strategy.cpp; both implement strategy.h.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>

#include "dtc/errors.h"
#include "strategy.h"

namespace dtc::l01 {

namespace {

constexpr double kGB = 1e9;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Clusters and validation (given)
// ---------------------------------------------------------------------------------------------

const std::vector<Cluster>& cluster_presets() {
  // name, GPUs per node, GB per GPU, intra-node GB/s and inter-node GB/s (per GPU, per
  // direction), dense BF16 TFLOP/s per GPU.
  static const std::vector<Cluster> all = {
      // NVIDIA DGX H100: 8x H100 SXM 80 GB; NVLink 4 at 900 GB/s per GPU counting both
      // directions, 450 GB/s each way; eight 400 Gb/s ConnectX-7 InfiniBand ports, one per GPU:
      // 50 GB/s; H100 SXM 989 TFLOP/s dense BF16 (H100 datasheet).
      {"dgx-h100", 8, 80, 450, 50, 989},
      // NVIDIA HGX H200: the same board with 141 GB H200s (same NVLink 4, same peak).
      {"h200x8", 8, 141, 450, 50, 989},
      // NVIDIA DGX A100 80 GB (Selene, where Korthikanti et al. 2022 ran): NVLink 3 at 600 GB/s
      // both ways (300 each way); eight 200 Gb/s HDR InfiniBand ports: 25 GB/s; 312 TFLOP/s.
      {"dgx-a100", 8, 80, 300, 25, 312},
      // A budget node: 8x H100 PCIe 80 GB without NVLink bridges, talking over PCIe 5.0 x16
      // (~64 GB/s each way), and 100 Gb/s Ethernet per GPU (12.5 GB/s); 756 TFLOP/s dense BF16.
      {"pcie-ethernet", 8, 80, 64, 12.5, 756},
      // The course's own cluster: 8 CPU ranks of one machine (lesson 11 runs the plan on them).
      // 8 MiB a rank, a budget the course's GPT (course-gpt: 834,304 parameters, 13.3 MB with
      // fp32 AdamW's 16 bytes each) does not fit whole, so that the plan must split it; gloo
      // over loopback, 0.5 to 1.3 GB/s of bus bandwidth in lesson 03's bench_collectives on the
      // course's 2-core machine: 1 GB/s both ways (lesson 04's namespace "nodes" share the same
      // kernel); 0.1 TFLOP/s: a 1024 x 1024 fp32 matmul on one thread measured 103 GFLOP/s there
      // (LibTorch 2.x). A rough machine: measure yours (lesson 03's bench, lesson 02's MFU).
      {"course-cpu", 8, 8.0 * 1024 * 1024 / 1e9, 1, 1, 0.1},
  };
  return all;
}

std::string memory_text(double bytes, int decimals) {
  if (bytes >= 0.1 * kGB || bytes == 0) return fmt::format("{:.{}f} GB", bytes / kGB, decimals);
  return fmt::format("{:.{}f} MiB", bytes / (1024.0 * 1024.0), decimals);
}

Cluster cluster_preset(const std::string& name) {
  return find_by_name(cluster_presets(), name, "--cluster", "cluster",
                      "change one with --gpus-per-node --gpu-mem --intra-bw --inter-bw "
                      "--peak-tflops");
}

void validate(const Cluster& c, int64_t gpus) {
  if (c.gpus_per_node < 1) {
    throw UsageError("--gpus-per-node", fmt::format("{} GPUs per node", c.gpus_per_node),
                     "a node has at least one GPU: e.g. --gpus-per-node 8");
  }
  const auto positive = [](double v, const char* flag, const char* what, const char* example) {
    if (!(v > 0) || !std::isfinite(v)) {
      throw UsageError(flag, fmt::format("{} is {}, but must be positive", what, v),
                       fmt::format("pass it in {}", example));
    }
  };
  positive(c.gpu_mem_gb, "--gpu-mem", "the memory per GPU", "GB, e.g. --gpu-mem 80");
  positive(c.intra_gbps, "--intra-bw", "the intra-node bandwidth",
           "GB/s per GPU per direction, e.g. --intra-bw 450 (NVLink 4: 900 GB/s both ways)");
  positive(c.inter_gbps, "--inter-bw", "the inter-node bandwidth",
           "GB/s per GPU per direction, e.g. --inter-bw 50 (InfiniBand 400 Gb/s)");
  positive(c.peak_tflops, "--peak-tflops", "the peak TFLOP/s",
           "TFLOP/s per GPU, e.g. --peak-tflops 989 (H100 BF16 dense)");
  const int64_t g = c.gpus_per_node;
  if (gpus < 1) {
    throw UsageError("--gpus", fmt::format("{} GPUs", gpus), "use at least one GPU: --gpus 8");
  }
  if (gpus < g ? g % gpus != 0 : gpus % g != 0) {
    throw UsageError("--gpus",
                     fmt::format("{} GPUs is not a whole number of {}-GPU nodes", gpus, g),
                     fmt::format("use whole nodes, e.g. --gpus {} or --gpus {}, or part of one "
                                 "node that divides it",
                                 (gpus / g) * g > 0 ? (gpus / g) * g : g, (gpus / g + 1) * g));
  }
}

int64_t PlanRequest::batch() const {
  if (global_batch > 0) return global_batch;
  return std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(1, setup.seq));
}

void validate(const PlanRequest& r) {
  validate(r.model);
  TrainingSetup chosen_by_plan = r.setup;  // the degrees are the plan's to choose
  chosen_by_plan.dp = chosen_by_plan.tp = chosen_by_plan.pp = 1;
  chosen_by_plan.zero_stage = 0;
  chosen_by_plan.ep = 1;
  validate(chosen_by_plan, &r.model);
  if (r.setup.ep != 1) {  // ep is the request's: the model's checks with dp = ep, then the GPUs
    TrainingSetup with_ep = chosen_by_plan;
    with_ep.dp = with_ep.ep = r.setup.ep;
    validate(with_ep, &r.model);
    if (r.gpus % r.setup.ep != 0) {
      throw UsageError("--ep",
                       fmt::format("expert parallelism over {} GPUs does not divide the {} GPUs "
                                   "of the plan",
                                   r.setup.ep, r.gpus),
                       "the ep ranks are data-parallel ranks: use an --ep that divides --gpus");
    }
  }
  validate(r.cluster, r.gpus);
  if (r.global_batch < 0) {
    throw UsageError("--global-batch", fmt::format("{} sequences per step", r.global_batch),
                     "pass a global batch of at least one sequence, or 0 for 4M tokens per step");
  }
  if (r.max_micro_batch < 1) {
    throw UsageError("--max-micro-batch", fmt::format("{} sequences", r.max_micro_batch),
                     "the plan tries micro-batches of 1, 2, 4, ... up to it: e.g. "
                     "--max-micro-batch 8");
  }
  if (!(r.mfu > 0) || r.mfu > 1) {
    throw UsageError("--mfu", fmt::format("{} is not a fraction in (0, 1]", r.mfu),
                     "model FLOPs utilisation is typically 0.3-0.5: e.g. --mfu 0.4");
  }
  if (!(r.tokens > 0)) {
    throw UsageError("--tokens", "must be positive", "e.g. --tokens 1e12");
  }
}

// ---------------------------------------------------------------------------------------------
// Names (given)
// ---------------------------------------------------------------------------------------------

const std::vector<Strategy>& all_strategies() {
  static const std::vector<Strategy> all = {Strategy::kDdp,   Strategy::kZero1, Strategy::kZero2,
                                            Strategy::kZero3, Strategy::kTp,    Strategy::kPp,
                                            Strategy::kCp};
  return all;
}

std::string strategy_name(Strategy s) {
  switch (s) {
    case Strategy::kDdp: return "DP/DDP";
    case Strategy::kZero1: return "ZeRO-1";
    case Strategy::kZero2: return "ZeRO-2";
    case Strategy::kZero3: return "ZeRO-3/FSDP";
    case Strategy::kTp: return "TP(+SP)";
    case Strategy::kPp: return "PP";
    case Strategy::kCp: return "SP/CP";
    case Strategy::kEp: return "EP";
  }
  return "?";
}

Strategy zero_strategy(int zero_stage) {
  switch (zero_stage) {
    case 1: return Strategy::kZero1;
    case 2: return Strategy::kZero2;
    case 3: return Strategy::kZero3;
    default: return Strategy::kDdp;
  }
}

std::string family_name(Family f) {
  switch (f) {
    case Family::kDdp: return "DDP";
    case Family::kZero: return "ZeRO";
    case Family::kTensor: return "TP";
    case Family::kPipeline: return "TP+PP (3D)";
    case Family::kContext: return "TP+PP+CP";
  }
  return "?";
}

double micro_batches(const PlanRequest& req, const Mix& mix) {
  return static_cast<double>(req.batch()) / static_cast<double>(mix.dp * mix.micro_batch);
}

double weight_wire_bytes(const TrainingSetup& s) {
  return bytes_per_param(s.precision, s.optimizer, s.fp32_grad_accum).params;
}

double gradient_wire_bytes(const TrainingSetup& s) {
  return s.precision == Precision::kMixed && !s.fp32_grad_accum ? weight_wire_bytes(s) : 4.0;
}

double recompute_flops_factor(const ModelConfig& model, int64_t seq, Recompute recompute) {
  const double s = static_cast<double>(seq);
  const double h = static_cast<double>(model.hidden);
  switch (recompute) {
    case Recompute::kNone: return 1.0;
    case Recompute::kSelective: return 1.0 + s / (3.0 * (6.0 * h + s));
    case Recompute::kFull: return 4.0 / 3.0;
  }
  return 1.0;
}

// Given: which GPUs of a group share a node, and the bandwidth the group gets.
int64_t group_ranks_per_node(Strategy s, const Mix& mix, int64_t gpus_per_node) {
  // Walk node 0's ranks, split each into its coordinates (tp fastest, then cp, pp, dp), and
  // count those whose coordinates outside the group are rank 0's.
  int64_t count = 0;
  for (int64_t r = 0; r < std::min(gpus_per_node, mix.gpus()); ++r) {
    const int64_t t = r % mix.tp, c = r / mix.tp % mix.cp, p = r / (mix.tp * mix.cp) % mix.pp;
    const int64_t d = r / (mix.tp * mix.cp * mix.pp);
    bool member = false;
    switch (s) {
      case Strategy::kTp: member = c == 0 && p == 0 && d == 0; break;
      case Strategy::kCp: member = t == 0 && p == 0 && d == 0; break;
      case Strategy::kPp: member = t == 0 && c == 0 && d == 0; break;
      case Strategy::kEp: member = t == 0 && c == 0 && p == 0 && d < mix.ep; break;
      case Strategy::kDdp:
        member = t == 0 && p == 0 && (mix.shard > 0 ? c == 0 && d % mix.shard == 0 : true);
        break;
      default:  // kZero1..3: dp x cp, or HSDP's shard group
        member = t == 0 && p == 0 && (mix.shard > 0 ? c == 0 && d < mix.shard : true);
    }
    count += member ? 1 : 0;
  }
  return std::max<int64_t>(count, 1);
}

double link_gbps(const Cluster& cluster, Strategy s, const Mix& mix) {
  if (!crosses_nodes(s, mix, cluster.gpus_per_node)) return cluster.intra_gbps;
  if (s == Strategy::kPp) return cluster.inter_gbps;
  const double k = static_cast<double>(group_ranks_per_node(s, mix, cluster.gpus_per_node));
  return std::min(cluster.intra_gbps, k * cluster.inter_gbps);
}

// ---------------------------------------------------------------------------------------------
// Candidates and reasons (given)
// ---------------------------------------------------------------------------------------------

namespace {

// Powers of two 2..min(g, G) that divide heads, kv heads, the MLP and the GPUs.
std::vector<int64_t> tp_degrees(const PlanRequest& r) {
  std::vector<int64_t> out;
  const int64_t limit = std::min(r.cluster.gpus_per_node, r.gpus);
  for (int64_t t = 2; t <= limit; t *= 2) {
    if (r.model.heads % t == 0 && r.model.kv_heads % t == 0 && r.model.ffn % t == 0 &&
        r.model.expert_ffn() % t == 0 && r.gpus % t == 0) {
      out.push_back(t);
    }
  }
  return out;
}

const Recompute kRecomputes[] = {Recompute::kNone, Recompute::kSelective, Recompute::kFull};

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

}  // namespace

std::vector<Mix> candidates(const PlanRequest& req, Family f) {
  std::vector<Mix> out;
  const int64_t G = req.gpus;
  const int64_t B = req.batch();
  // One layout (tp, pp, cp, shard) with every ZeRO stage in [min_zero, max_zero], recompute,
  // micro-batch and (with a pipeline) virtual-stage count it allows.
  const auto push = [&](int64_t tp, int64_t pp, int64_t cp, int min_zero, int max_zero,
                        int64_t shard) {
    const int64_t dp = G / (tp * pp * cp);
    const int64_t ep = req.setup.ep;  // folded over dp (and the shard group)
    if (dp % ep != 0 || (shard > 0 && shard % ep != 0)) return;
    const int64_t stage_layers = (req.model.layers + pp - 1) / pp;
    for (int z = min_zero; z <= max_zero; ++z) {
      for (Recompute r : kRecomputes) {
        // b = 1 always, even when dp > B: evaluate() then reports the batch too small
        for (int64_t b = 1; b == 1 || (b <= req.max_micro_batch && dp * b <= B); b *= 2) {
          if (b > 1 && B % (dp * b) != 0) continue;
          for (int64_t v = 1; v == 1 || (pp > 1 && v <= stage_layers); v *= 2) {
            if (v > 1 && (stage_layers % v != 0 || B % (dp * b) != 0 || (B / (dp * b)) % pp != 0)) {
              continue;
            }
            Mix m;
            m.tp = tp;
            m.pp = pp;
            m.cp = cp;
            m.dp = dp;
            m.zero_stage = z;
            m.recompute = r;
            m.micro_batch = b;
            m.virtual_stages = v;
            m.shard = shard;
            m.ep = ep;
            out.push_back(m);
          }
        }
      }
    }
  };
  std::vector<int64_t> tps = tp_degrees(req);
  switch (f) {
    case Family::kDdp: push(1, 1, 1, 0, 0, 0); break;
    case Family::kZero:
      push(1, 1, 1, 1, 3, 0);
      for (int64_t sh = 2; sh <= std::min(req.cluster.gpus_per_node, G / 2); sh *= 2) {
        if (G % sh == 0) push(1, 1, 1, 3, 3, sh);  // HSDP: ZeRO-3 inside, replicas across
      }
      break;
    case Family::kTensor:
      for (int64_t t : tps) push(t, 1, 1, 0, 1, 0);
      break;
    case Family::kPipeline:
    case Family::kContext:
      tps.insert(tps.begin(), 1);
      for (int64_t t : tps) {
        for (int64_t p = f == Family::kContext ? 1 : 2; p <= req.model.layers; ++p) {
          if ((G / t) % p != 0) continue;
          if (f == Family::kPipeline) {
            push(t, p, 1, 0, 1, 0);
            continue;
          }
          for (int64_t c = 2; c <= G / (t * p); c *= 2) {
            if ((G / (t * p)) % c != 0 || req.setup.seq % (2 * c) != 0) continue;
            if (req.setup.seq / c < kMinCpTokens) continue;
            push(t, p, c, 0, 1, 0);
          }
        }
      }
      break;
  }
  return out;
}

std::vector<std::string> explain(const PlanRequest& req, const Evaluation& e, Family f) {
  const Mix& mix = e.mix;
  const Cluster& c = req.cluster;
  const auto gb = [](double bytes) {
    return bytes >= 1e12 ? fmt::format("{:.3g} TB", bytes / 1e12)
                         : fmt::format("{:.3g} GB", bytes / kGB);
  };
  const auto secs = [](double s) { return fmt::format("{:.3g} s", s); };
  const auto traffic = [&](Strategy s) -> const GroupTraffic* {
    for (const auto& t : e.traffic) {
      if (t.strategy == s) return &t;
    }
    return nullptr;
  };
  const auto link = [&](const GroupTraffic* t) {
    if (!t->crosses_nodes) return fmt::format("the intra-node link at {:g} GB/s", c.intra_gbps);
    const double k = t->gbps / c.inter_gbps;
    return k > 1.01 ? fmt::format("the network between nodes at {:g} GB/s ({:g} links of {:g})",
                                  t->gbps, k, c.inter_gbps)
                    : fmt::format("the network between nodes at {:g} GB/s", t->gbps);
  };
  std::vector<std::string> out;

  // dp
  const Strategy dp_kind = zero_strategy(mix.zero_stage);
  std::string dp = fmt::format("dp {}: ", mix.dp);
  if (f == Family::kDdp) {
    dp += fmt::format(
        "the whole training state fits on one GPU ({} of {} usable), so every GPU "
        "holds a replica and takes 1/{} of the batch (DDP)",
        gb(e.ledger.total_bytes()), gb(e.capacity_bytes), mix.dp);
  } else if (f == Family::kZero && mix.shard > 0) {
    dp += fmt::format(
        "the model does not fit on one GPU; HSDP shards its states over groups of {} GPUs "
        "inside a node and replicates them across the {} groups",
        mix.shard, mix.dp / mix.shard);
  } else if (f == Family::kZero) {
    dp += fmt::format(
        "the model does not fit on one GPU, but sharding its states over all {} "
        "data-parallel GPUs does",
        mix.dp);
  } else if (mix.dp > 1) {
    dp += fmt::format(
        "{} replicas of the model, each on tp x pp x cp = {} GPUs, split the "
        "batch of {} sequences",
        mix.dp, mix.tp * mix.pp * mix.cp, req.batch());
  } else {
    dp += "every GPU is needed to hold one replica of the model";
  }
  if (mix.shard > 0) {
    const GroupTraffic* in = traffic(dp_kind);
    const GroupTraffic* across = traffic(Strategy::kDdp);
    if (in != nullptr && across != nullptr) {
      dp += fmt::format(
          "; the per-micro-batch gathers and reduce-scatters send {} per GPU a step, {} on {}, "
          "and only the once-a-step allreduce of the gradient shards, {}, {}, crosses {}",
          gb(in->bytes_per_gpu), secs(in->seconds), link(in), gb(across->bytes_per_gpu),
          secs(across->seconds), link(across));
    }
  } else if (const GroupTraffic* t = traffic(dp_kind)) {
    dp += fmt::format(
        "; the gradient sync sends {} per GPU a step, {} on {}: DP is the least "
        "demanding on bandwidth and takes the outermost, slowest links",
        gb(t->bytes_per_gpu), secs(t->seconds), link(t));
  }
  out.push_back(dp);

  // tp
  std::string tp = fmt::format("tp {}: ", mix.tp);
  if (const GroupTraffic* t = traffic(Strategy::kTp)) {
    tp += fmt::format(
        "each layer's matrices are split over {} GPUs, kept inside one {}-GPU node: {} "
        "all-gathers and reduce-scatters per layer per micro-batch send {} per GPU a step, {} on "
        "{}, but {} if they crossed nodes at {:g} GB/s",
        mix.tp, c.gpus_per_node, mix.recompute == Recompute::kFull ? 14 : 10, gb(t->bytes_per_gpu),
        secs(t->seconds), link(t), secs(t->bytes_per_gpu / (c.inter_gbps * kGB)), c.inter_gbps);
  } else if (f == Family::kDdp || f == Family::kZero) {
    tp +=
        "not needed: data parallelism (with ZeRO) fits, and TP's per-layer allreduces are the "
        "heaviest traffic of all";
  } else {
    tp += "no tensor split: the mixes with it were slower or did not fit";
  }
  out.push_back(tp);

  // pp
  std::string pp = fmt::format("pp {}: ", mix.pp);
  if (const GroupTraffic* t = traffic(Strategy::kPp)) {
    pp += fmt::format(
        "{} layers in {} stages of at most {} (the first also holds the input embedding); only "
        "activations cross a stage boundary, {} per GPU a step, {} on {}, so stages may sit on "
        "different nodes; ",
        req.model.layers, mix.pp, (req.model.layers + mix.pp - 1) / mix.pp, gb(t->bytes_per_gpu),
        secs(t->seconds), link(t));
    if (mix.virtual_stages > 1) {
      pp += fmt::format(
          "interleaved 1F1B with {} virtual stages (model chunks) per GPU: the bubble "
          "(pp-1)/(v m) costs {:.1f}% of compute, {}x less than plain 1F1B's, for {}x the "
          "sends and more activations in flight",
          mix.virtual_stages, 100.0 * e.bubble, mix.virtual_stages, mix.virtual_stages);
    } else {
      pp += fmt::format("the 1F1B bubble (pp-1)/m costs {:.1f}% of compute", 100.0 * e.bubble);
    }
  } else {
    pp += "no pipeline: the layers fit without one, and there is no bubble";
  }
  out.push_back(pp);

  // cp
  std::string cp = fmt::format("cp {}: ", mix.cp);
  if (const GroupTraffic* t = traffic(Strategy::kCp)) {
    cp += fmt::format(
        "the sequence of {} tokens is split, so each GPU holds the activations of {} tokens; "
        "gathering K and V sends {} per GPU a step, {} on {}",
        req.setup.seq, req.setup.seq / mix.cp, gb(t->bytes_per_gpu), secs(t->seconds), link(t));
  } else {
    cp += fmt::format("the sequence of {} tokens fits without splitting it", req.setup.seq);
  }
  out.push_back(cp);

  // zero
  const Ledger& l = e.ledger;
  const int64_t n = mix.dp * mix.cp;
  std::string zero = fmt::format("zero {}: ", mix.zero_stage);
  switch (mix.zero_stage) {
    case 0:
      zero += n > 1 ? "every replica keeps its whole optimizer state: it fits, and sharding "
                      "would only add traffic"
                    : "a single replica: nothing to shard over";
      break;
    case 1:
      zero += fmt::format("optimizer states sharded over {} ranks ({} per GPU); ", n,
                          gb(l.state.optimizer));
      zero += gradient_wire_bytes(req.setup) == weight_wire_bytes(req.setup)
                  ? "same traffic as DDP (reduce-scatter + all-gather = allreduce)"
                  : fmt::format(
                        "less traffic than DDP: the gradients are reduce-scattered in {:g} bytes, "
                        "the updated parameters all-gathered in {:g} (Megatron's distributed "
                        "optimizer)",
                        gradient_wire_bytes(req.setup), weight_wire_bytes(req.setup));
      break;
    case 2:
      zero += fmt::format(
          "optimizer states and gradients sharded over {} ranks ({} per GPU); "
          "gradients are reduce-scattered after every micro-batch",
          n, gb(l.state.optimizer + l.state.grads));
      break;
    default:
      zero += fmt::format(
          "parameters too are sharded over {} ranks ({} of states per GPU); they "
          "are gathered for every forward and backward",
          mix.zero_degree(), gb(l.state.total()));
  }
  if (f != Family::kDdp && f != Family::kZero) {
    std::optional<Evaluation> alt;
    for (const Mix& m : candidates(req, Family::kZero)) {
      Evaluation z = evaluate(req, m);
      if (z.fits && z.batch_ok && (!alt || z.step_time_s < alt->step_time_s)) alt = z;
    }
    if (alt) {
      zero += fmt::format(
          "; ZeRO-{} over all {} GPUs alone would fit ({}), but its step takes {} ({} of it "
          "traffic) against this mix's {}",
          alt->mix.zero_stage, req.gpus, gb(alt->ledger.total_bytes()), secs(alt->step_time_s),
          secs(alt->comm_time_s), secs(e.step_time_s));
    } else if (req.gpus > req.batch()) {
      zero += fmt::format(
          "; data parallelism alone would need {} replicas, more than the batch "
          "of {} sequences feeds",
          req.gpus, req.batch());
    }
  }
  out.push_back(zero);

  // recompute
  std::string rc = fmt::format("recompute {}: ", recompute_name(mix.recompute));
  const double extra =
      100.0 * (recompute_flops_factor(req.model, req.setup.seq, mix.recompute) - 1.0);
  switch (mix.recompute) {
    case Recompute::kNone:
      rc += fmt::format("every activation is stored ({} per GPU)", gb(l.activation_bytes));
      break;
    case Recompute::kSelective:
      rc += fmt::format(
          "the attention scores are recomputed in backward instead of stored "
          "(activations {} per GPU), for {:.1f}% more compute",
          gb(l.activation_bytes), extra);
      break;
    case Recompute::kFull:
      rc += fmt::format(
          "only each layer's input is stored ({} per GPU); every layer is "
          "recomputed in backward, {:.0f}% more compute",
          gb(l.activation_bytes), extra);
      break;
  }
  out.push_back(rc);

  // micro-batch
  std::string mb = fmt::format("micro-batch {}: ", mix.micro_batch);
  mb += fmt::format("{:g} micro-batches of {} sequence{} per replica a step", e.micro_batches,
                    mix.micro_batch, mix.micro_batch == 1 ? "" : "s");
  if (mix.pp > 1) {
    mb += "; more of them shrink the pipeline bubble";
  } else if (mix.zero_stage >= 2) {
    mb += "; fewer, larger ones cut ZeRO's per-micro-batch traffic";
  }
  out.push_back(mb);

  // ep (only with expert parallelism)
  if (const GroupTraffic* t = traffic(Strategy::kEp)) {
    out.push_back(fmt::format(
        "ep {}: each GPU holds {} of each MoE block's {} routed experts ({:.3g}B parameters); "
        "the all-to-alls that send every token to its {} experts and back send {} per GPU a "
        "step, {} on {}",
        mix.ep, req.model.experts / mix.ep, req.model.experts, l.expert_params / 1e9,
        req.model.top_k, gb(t->bytes_per_gpu), secs(t->seconds), link(t)));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The plan and the comparison table (given)
// ---------------------------------------------------------------------------------------------

namespace {

// What decided branch @p b of a plan whose pick is @p pick.
std::string verdict(const PlanRequest& req, const Branch& b, const Plan& pick) {
  const auto layout = [](const Mix& m) {
    std::string out =
        fmt::format("dp {} x tp {} x pp {} x cp {}, ZeRO {}", m.dp, m.tp, m.pp, m.cp, m.zero_stage);
    if (m.shard > 0) out += fmt::format(" (HSDP, shard {})", m.shard);
    out +=
        fmt::format(", recompute {}, micro-batch {}", recompute_name(m.recompute), m.micro_batch);
    if (m.virtual_stages > 1) out += fmt::format(", {} virtual stages", m.virtual_stages);
    return out;
  };
  const auto step = [](const Evaluation& e) {
    return fmt::format("compute {:.3g} s x (1 + bubble {:.3f}) + communication {:.3g} s = {:.3g} s",
                       e.compute_time_s, e.bubble, e.comm_time_s, e.step_time_s);
  };
  if (!b.best) {
    double least = 0;
    bool any_fits = false;
    bool first = true;
    for (const Mix& m : candidates(req, b.family)) {
      const Evaluation e = evaluate(req, m);
      any_fits = any_fits || e.fits;
      if (first || e.ledger.total_bytes() < least) least = e.ledger.total_bytes();
      first = false;
    }
    if (first && b.family == Family::kContext && req.setup.seq / 2 < kMinCpTokens) {
      return fmt::format(
          "not needed: the sequence of {} tokens is kept whole (context parallelism splits it "
          "into chunks of at least {} tokens a GPU, kMinCpTokens)",
          req.setup.seq, kMinCpTokens);
    }
    if (first) return "no valid layout on these GPUs";
    if (any_fits) {
      return fmt::format(
          "no mix that fits is fed: each needs more than the batch of {} sequences (a "
          "micro-batch a replica, and as many micro-batches as pipeline stages)",
          req.batch());
    }
    return fmt::format("does not fit: its leanest mix needs {} of {} per GPU",
                       memory_text(least, 2),
                       memory_text(kUsableMemory * req.cluster.gpu_mem_gb * kGB, 1));
  }
  const Evaluation& e = *b.best;
  if (pick.fits && b.family == pick.family) {
    return fmt::format("chosen: {}; {}", layout(e.mix), step(e));
  }
  const double ratio = e.step_time_s / pick.eval.step_time_s;
  if (ratio < 1.0) {
    return fmt::format(
        "fits ({}, {}) and is {:.1f}% faster, within the {:.0f}% a later, more complex "
        "branch must win by: {}",
        layout(e.mix), memory_text(e.ledger.total_bytes(), 2), (1.0 - ratio) * 100,
        kSimplerWithin * 100, step(e));
  }
  return fmt::format("fits ({}, {}), but {:.2f}x the pick's step: {}", layout(e.mix),
                     memory_text(e.ledger.total_bytes(), 2), ratio, step(e));
}

}  // namespace

Plan plan(const PlanRequest& req) {
  validate(req);
  Plan p = choose_mix(req);
  p.fits = p.eval.fits && p.eval.batch_ok;
  if (!p.fits) {
    // The smallest G * 2^k on the same kind of nodes that fits ("needs N GPUs").
    for (int64_t g = req.gpus * 2; g <= (int64_t{1} << 20); g *= 2) {
      PlanRequest bigger = req;
      bigger.gpus = g;
      try {
        validate(bigger.cluster, g);
      } catch (const UsageError&) {
        continue;
      }
      const Plan q = choose_mix(bigger);
      if (q.eval.fits && q.eval.batch_ok) {
        p.needs_gpus = g;
        break;
      }
    }
  }
  if (p.fits) {
    // The runner-up: the fastest other layout that fits, in any branch.
    const Mix& chosen = p.eval.mix;
    for (const Branch& b : p.branches) {
      const Family f = b.family;
      for (const Mix& m : candidates(req, f)) {
        if (m.dp == chosen.dp && m.tp == chosen.tp && m.pp == chosen.pp && m.cp == chosen.cp) {
          continue;
        }
        const Evaluation e = evaluate(req, m);
        if (!e.fits || !e.batch_ok) continue;
        if (!p.runner_up || e.step_time_s < p.runner_up->step_time_s) {
          p.runner_up = e;
          p.runner_up_family = f;
        }
      }
    }
  }
  for (Branch& b : p.branches) b.verdict = verdict(req, b, p);
  const double params = static_cast<double>(active_params(req.model));  // the FLOPs' N
  const double peak = req.cluster.peak_tflops * 1e12;
  p.train_time_s = train_time_seconds(params, req.tokens, peak, req.mfu, req.gpus);
  p.train_time_1gpu_s = train_time_seconds(params, req.tokens, peak, req.mfu, 1);
  return p;
}

std::vector<StrategyRow> strategy_table(const PlanRequest& req, int64_t n) {
  Mix one;
  one.recompute = req.setup.recompute;
  one.micro_batch = req.setup.micro_batch;
  const Ledger base = mix_ledger(req, one);
  const auto largest = [&](auto valid) {
    int64_t best = 1;
    for (int64_t d = 2; d <= n; d *= 2) {
      if (valid(d)) best = d;
    }
    return best;
  };
  std::vector<StrategyRow> rows;
  for (Strategy s : all_strategies()) {
    StrategyRow row;
    row.strategy = s;
    Mix mix = one;
    switch (s) {
      case Strategy::kDdp:
      case Strategy::kZero1:
      case Strategy::kZero2:
      case Strategy::kZero3:
        mix.dp = n;
        mix.zero_stage = static_cast<int>(s) - static_cast<int>(Strategy::kDdp);
        row.degree = n;
        break;
      case Strategy::kTp:
        mix.tp = row.degree = largest([&](int64_t t) {
          return req.model.heads % t == 0 && req.model.kv_heads % t == 0 &&
                 req.model.ffn % t == 0 && req.model.expert_ffn() % t == 0;
        });
        break;
      case Strategy::kPp: mix.pp = row.degree = std::min(n, req.model.layers); break;
      case Strategy::kCp:
        mix.cp = row.degree = largest([&](int64_t c) { return req.setup.seq % (2 * c) == 0; });
        break;
      case Strategy::kEp: break;  // not a row of the outline's table (all_strategies())
    }
    switch (s) {
      case Strategy::kDdp:
        row.splits = "the batch";
        row.collectives = "allreduce(grads) once a step";
        row.formula = "2(n-1)/n g P";
        break;
      case Strategy::kZero1:
        row.splits = "the batch; optimizer states";
        row.collectives = "reduce-scatter(grads) + all-gather(params) once a step";
        row.formula = "(n-1)/n (g+w) P";
        break;
      case Strategy::kZero2:
        row.splits = "the batch; + gradients";
        row.collectives = "reduce-scatter(grads) each micro-batch + all-gather(params)";
        row.formula = "(n-1)/n (mg+w) P";
        break;
      case Strategy::kZero3:
        row.splits = "the batch; + parameters";
        row.collectives = "all-gather(params) fwd+bwd + reduce-scatter(grads) each micro-batch";
        row.formula = "m(n-1)/n (2w+g) P";
        break;
      case Strategy::kTp:
        row.splits = "each layer's matrices (heads, MLP columns)";
        row.collectives = "all-gather+reduce-scatter x4, all-gather x2, per layer per micro-batch";
        row.formula = "10mL (n-1)/n 2sbh";
        break;
      case Strategy::kPp:
        row.splits = "the layers (L/n per stage)";
        row.collectives = "send/recv(activations fwd, gradients bwd) per micro-batch";
        row.formula = "2m 2sbh";
        break;
      case Strategy::kCp:
        row.splits = "the sequence (s/n tokens per GPU)";
        row.collectives = "all-gather(K,V) fwd + reduce-scatter(dK,dV) bwd per layer";
        row.formula = "2mL (n-1)/n 4sb kv";
        break;
      case Strategy::kEp: break;
    }
    const Ledger l = mix_ledger(req, mix);
    const auto shrinks = [](double got, double was) { return got < was * (1 - 1e-9); };
    if (shrinks(l.state.params, base.state.params)) row.shards.push_back("params");
    if (shrinks(l.state.grads, base.state.grads)) row.shards.push_back("grads");
    if (shrinks(l.state.optimizer, base.state.optimizer)) row.shards.push_back("optimizer");
    if (shrinks(l.activation_bytes, base.activation_bytes)) row.shards.push_back("activations");
    row.bytes_per_gpu = step_bytes_per_gpu(s, req, mix);
    row.intra_s = row.bytes_per_gpu / (req.cluster.intra_gbps * kGB);
    row.inter_s = row.bytes_per_gpu / (req.cluster.inter_gbps * kGB);
    row.memory_bytes = l.total_bytes();
    row.fits = row.memory_bytes <= kUsableMemory * req.cluster.gpu_mem_gb * kGB;
    rows.push_back(row);
  }
  return rows;
}

}  // namespace dtc::l01

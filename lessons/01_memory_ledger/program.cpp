// The lesson01 program: command line, the ledger table, the 7B / 70B / 405B comparison, and
// (--plan) the five strategies compared and a recommended mix for a model on a cluster.
// Given in full; the arithmetic it prints is yours, in ledger.cpp and strategy.cpp.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <cmath>
#include <iostream>
#include <map>
#include <optional>
#include <ostream>

#include "dtc/cli.h"
#include "dtc/errors.h"
#include "dtc/format.h"
#include "dtc/mix.h"
#include "ledger.h"
#include "strategy.h"

namespace dtc::l01 {
namespace {

constexpr double kGB = 1e9;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

const std::map<std::string, Precision> kPrecisions = {
    {"fp32", Precision::kFp32},
    {"mixed", Precision::kMixed},
    {"mixed-fp32-grads", Precision::kMixedFp32Grads}};
const std::map<std::string, Optimizer> kOptimizers = {{"sgd", Optimizer::kSgd},
                                                      {"momentum", Optimizer::kMomentum},
                                                      {"adam", Optimizer::kAdam},
                                                      {"adamw", Optimizer::kAdam},
                                                      {"adam8bit", Optimizer::kAdam8bit}};
const std::map<std::string, Recompute> kRecomputes = {
    {"none", Recompute::kNone}, {"selective", Recompute::kSelective}, {"full", Recompute::kFull}};
const std::map<std::string, Attention> kAttentions = {
    {"auto", Attention::kAuto}, {"eager", Attention::kEager}, {"flash", Attention::kFlash}};
const std::map<std::string, Arch> kArchs = {{"llama", Arch::kLlama}, {"gpt", Arch::kGpt}};

template <class Map>
std::string name_of(const Map& map, typename Map::mapped_type value) {
  for (const auto& [name, v] : map) {
    if (v == value) return name;
  }
  return "?";
}

// "7e9", "7.5e9", "6738415616" -> a whole, positive count.
double parse_count(const std::string& text, const char* flag) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || !std::isfinite(v) || v < 1 || v > 1e18 || v != std::floor(v)) {
    throw UsageError(flag, fmt::format("'{}' is not a positive whole number", text),
                     fmt::format("write it in full or with an exponent, e.g. {} 7e9", flag));
  }
  return v;
}

std::string human_time(double seconds) {
  const double days = seconds / 86400.0;
  if (days >= 365.0) return fmt::format("{:.1f} years", days / 365.0);
  if (days >= 1.0) return fmt::format("{:.1f} days", days);
  return fmt::format("{:.1f} hours", seconds / 3600.0);
}

struct Options {
  std::string model;
  std::string params;
  std::string arch;
  ModelConfig shape;
  TrainingSetup setup;
  std::string precision;  // empty: mixed, and with --plan mixed-fp32-grads (what practice runs)
  std::string optimizer = "adam";
  std::string recompute = "none";
  std::string attention = "auto";
  std::string compare;  // --plan --compare DPxTPxPPxCP[:ZERO[:RECOMPUTE]]
  std::string tokens;
  int64_t gpus = 0;
  double peak_tflops = 989.0;  // H100 SXM, dense BF16
  double mfu = 0.4;
  double gpu_mem_gb = 80.0;
  double mem_mib = 0;  // --mem-mib: the same in MiB (a CPU rank's budget)
  bool json = false;
  // --plan: a mix for the model on a cluster
  bool plan = false;
  std::string cluster = "dgx-h100";
  int64_t gpus_per_node = 0;  // used when set_gpus_per_node
  double intra_bw = 0;        // GB/s per GPU per direction; used when set_intra
  double inter_bw = 0;
  int64_t global_batch = 0;     // sequences per step; 0: 4M tokens
  int64_t max_micro_batch = 8;  // --plan tries micro-batches 1, 2, 4, ... up to it
  bool set_gpus_per_node = false, set_gpu_mem = false, set_peak = false, set_intra = false,
       set_inter = false;
};

nlohmann::json model_json(const ModelConfig& m) {
  nlohmann::json j = {{"name", m.name},     {"arch", name_of(kArchs, m.arch)},
                      {"hidden", m.hidden}, {"layers", m.layers},
                      {"heads", m.heads},   {"kv_heads", m.kv_heads},
                      {"ffn", m.ffn},       {"vocab", m.vocab},
                      {"ctx", m.ctx}};
  j["attention"] = m.attention_kind == AttentionKind::kLatent ? "latent" : "multi-head";
  if (m.is_moe()) {
    j["experts"] = m.experts;
    j["top_k"] = m.top_k;
    j["shared_experts"] = m.shared_experts;
    j["moe_ffn"] = m.expert_ffn();
    j["first_dense_layers"] = m.first_dense_layers;
  }
  return j;
}

nlohmann::json ledger_json(const Ledger& l, const ModelConfig* model, const Options& o) {
  const TrainingSetup& s = o.setup;
  nlohmann::json j;
  j["model"] = model ? model_json(*model) : nlohmann::json(nullptr);
  j["params"] = l.params;
  // The parameters a token goes through: all of them in a dense model (or a bare count).
  j["active_params"] = model ? active_params(*model) : l.params;
  j["setup"] = {{"precision", name_of(kPrecisions, s.precision)},
                {"fp32_grad_accum", s.fp32_grad_accum},
                {"optimizer", name_of(kOptimizers, s.optimizer)},
                {"zero_stage", s.zero_stage},
                {"dp", s.dp},
                {"tp", s.tp},
                {"pp", s.pp},
                {"ep", s.ep},
                {"seq", s.seq},
                {"micro_batch", s.micro_batch},
                {"recompute", name_of(kRecomputes, s.recompute)},
                {"sequence_parallel", s.sequence_parallel}};
  if (model) j["setup"]["attention"] = name_of(kAttentions, resolved_attention(*model, s));
  j["params_per_replica"] = l.params_per_replica;
  j["expert_params_per_gpu"] = l.expert_params;
  j["bytes_per_param"] = {{"params", l.per_param.params},
                          {"grads", l.per_param.grads},
                          {"optimizer", l.per_param.optimizer},
                          {"total", l.per_param.total()}};
  j["per_device_bytes"] = {{"params", l.state.params},
                           {"grads", l.state.grads},
                           {"optimizer", l.state.optimizer},
                           {"activations", l.activation_bytes},
                           {"total", l.total_bytes()}};
  j["per_layer_activation_bytes"] = l.per_layer_activation_bytes;
  j["gpu_memory_bytes"] = o.gpu_mem_gb * kGB;
  j["fits"] = l.total_bytes() <= o.gpu_mem_gb * kGB;
  return j;
}

void print_ledger(std::ostream& out, const Ledger& l, const ModelConfig* model, const Options& o) {
  const TrainingSetup& s = o.setup;
  if (model && model->is_moe()) {
    const int64_t active = active_params(*model);
    fmt::print(out,
               "Training memory ledger: {} ({} mixture of experts, {:.1f}B parameters, {:.1f}B "
               "active per token)\n",
               model->name, model->arch == Arch::kLlama ? "LLaMA-style" : "GPT-style",
               static_cast<double>(l.params) / 1e9, static_cast<double>(active) / 1e9);
    fmt::print(out,
               "  {} of {} blocks route each token to {} of {} experts{}: {} parameters, {} "
               "active\n",
               model->moe_layers(), model->layers, model->top_k, model->experts,
               model->shared_experts > 0 ? fmt::format(" + {} shared", model->shared_experts)
                                         : std::string(),
               with_commas(l.params), with_commas(active));
    fmt::print(out,
               "  expert parallelism {}: this GPU holds {} of each MoE block's {} routed experts "
               "({:.4g}B of the {:.4g}B parameters it holds)\n",
               s.ep, model->experts / s.ep, model->experts, l.expert_params / 1e9,
               l.params_per_replica / 1e9);
  } else if (model) {
    fmt::print(out, "Training memory ledger: {} ({}, {} parameters)\n", model->name,
               model->arch == Arch::kLlama ? "LLaMA-style" : "GPT-style", with_commas(l.params));
  } else {
    fmt::print(out, "Training memory ledger: {:.4g} parameters (no shape: no activations)\n",
               static_cast<double>(l.params));
  }
  fmt::print(out, "  set-up: {} precision{}, {}, ZeRO stage {}, dp {} x tp {} x pp {}{}",
             name_of(kPrecisions, s.precision), s.fp32_grad_accum ? " (+fp32 grad accum)" : "",
             name_of(kOptimizers, s.optimizer), s.zero_stage, s.dp, s.tp, s.pp,
             s.ep > 1 ? fmt::format(", ep {} (of the dp ranks)", s.ep) : std::string());
  if (model) {
    fmt::print(out, ", seq {}, micro-batch {}, recompute {}, {} attention{}", s.seq, s.micro_batch,
               name_of(kRecomputes, s.recompute),
               name_of(kAttentions, resolved_attention(*model, s)),
               s.sequence_parallel ? ", sequence parallel" : "");
  }
  fmt::print(out, "\n\n  {:<18} {:>12} {:>12} {:>12} {:>8}\n", "per device", "bytes/param", "GB",
             "GiB", "share");
  const double total = l.total_bytes();
  const auto row = [&](const char* name, std::optional<double> per_param, double bytes) {
    fmt::print(out, "  {:<18} {:>12} {:>12.2f} {:>12.2f} {:>7.1f}%\n", name,
               per_param ? fmt::format("{:.2f}", *per_param) : std::string("-"), bytes / kGB,
               bytes / kGiB, total > 0 ? 100.0 * bytes / total : 0.0);
  };
  row("parameters", l.per_param.params, l.state.params);
  row("gradients", l.per_param.grads, l.state.grads);
  row("optimizer states", l.per_param.optimizer, l.state.optimizer);
  row("activations", std::nullopt, l.activation_bytes);
  row("total", l.per_param.total(), total);
  if (model) {
    fmt::print(out,
               "\n  activations: {:.3f} GB per layer x {} layers (16-bit, Korthikanti et al.)\n",
               l.per_layer_activation_bytes / kGB, model->layers);
  }
  const double cap = o.gpu_mem_gb * kGB;
  if (total <= cap) {
    fmt::print(out, "  fits on one {:g} GB GPU ({:.0f}% used)\n", o.gpu_mem_gb,
               100.0 * total / cap);
  } else {
    fmt::print(out, "  does NOT fit on one {:g} GB GPU: needs {:.1f} GB ({:.2f}x)\n", o.gpu_mem_gb,
               total / kGB, total / cap);
  }
}

std::vector<ModelConfig> comparison_models() {
  return {preset("llama-7b"), preset("llama2-70b"), preset("llama3-405b")};
}

int compare_family(std::ostream& out, const Options& o) {
  const double tokens = o.tokens.empty() ? 1e12 : parse_count(o.tokens, "--tokens");
  const double peak = o.peak_tflops * 1e12;
  const int64_t many = 1024;
  nlohmann::json rows = nlohmann::json::array();
  if (!o.json) {
    fmt::print(out,
               "Why distributed training: the LLaMA family, {} precision + {}, seq {}, "
               "micro-batch {}\n\n",
               name_of(kPrecisions, o.setup.precision), name_of(kOptimizers, o.setup.optimizer),
               o.setup.seq, o.setup.micro_batch);
    fmt::print(out, "  {:<12} {:>9} {:>10} {:>10} {:>10} {:>14}   {:>12} {:>12}\n", "model",
               "params", "static GB", "activ. GB", "total GB",
               fmt::format("{:g} GB GPUs", o.gpu_mem_gb), "1 GPU", fmt::format("{} GPUs", many));
  }
  for (const auto& m : comparison_models()) {
    validate(o.setup, &m);
    const Ledger l = compute_ledger(count_params(m), o.setup, &m);
    const double p = static_cast<double>(l.params);
    const double t1 = train_time_seconds(p, tokens, peak, o.mfu, 1);
    const double tn = train_time_seconds(p, tokens, peak, o.mfu, many);
    const int64_t gpus_for_memory =
        static_cast<int64_t>(std::ceil(l.total_bytes() / (o.gpu_mem_gb * kGB)));
    if (o.json) {
      auto j = ledger_json(l, &m, o);
      j["train_time_s"] = {{"tokens", tokens}, {"gpus_1", t1}, {fmt::format("gpus_{}", many), tn}};
      rows.push_back(j);
      continue;
    }
    fmt::print(out, "  {:<12} {:>7.1f} B {:>10.1f} {:>10.1f} {:>10.1f} {:>14}   {:>12} {:>12}\n",
               m.name, p / 1e9, l.state.total() / kGB, l.activation_bytes / kGB,
               l.total_bytes() / kGB,
               gpus_for_memory <= 1 ? std::string("fits on 1")
                                    : fmt::format("needs >= {}", gpus_for_memory),
               human_time(t1), human_time(tn));
  }
  if (o.json) {
    print_json_line(out, {{"comparison", rows}});
    return kExitOk;
  }
  fmt::print(out,
             "\n  static = parameters + gradients + optimizer states ({:.0f} bytes/param); "
             "activations for one micro-batch.\n"
             "  Training time: 6 N D FLOPs for D = {:.0e} tokens at {:.0f}% MFU of {:g} TFLOP/s "
             "per GPU.\n"
             "  Won't fit: not even 7B's training state fits on one GPU. Won't finish: years "
             "on one GPU, days on a thousand.\n",
             bytes_per_param(o.setup.precision, o.setup.optimizer, o.setup.fp32_grad_accum).total(),
             tokens, o.mfu * 100, o.peak_tflops);
  return kExitOk;
}

// ---------------------------------------------------------------------------------------------
// --plan: the comparison table and the recommended mix
// ---------------------------------------------------------------------------------------------

std::string shards_text(const std::vector<std::string>& shards) {
  std::string text;
  for (const auto& s : shards) text += (text.empty() ? "" : ",") + s;
  return text.empty() ? "-" : text;
}

// A mix in --compare's grammar (dtc/mix.h), every field written, so that
// `--compare "$(... | jq -r .plan.mix)"` costs the same mix and lesson 11's --mix runs it.
MixSpec spec_of(const Mix& m) {
  MixSpec spec;
  spec.dp = m.dp;
  spec.tp = m.tp;
  spec.pp = m.pp;
  spec.cp = m.cp;
  spec.zero_stage = m.zero_stage;
  spec.shard = m.shard;
  spec.recompute = name_of(kRecomputes, m.recompute);
  spec.micro_batch = m.micro_batch;
  spec.virtual_stages = m.virtual_stages;
  return spec;
}

std::string mix_text(const Mix& m) { return spec_of(m).text(); }

// A costed mix: its layout, its per-GPU memory and step time (the plan, its runner-up, --compare).
nlohmann::json evaluation_json(const Evaluation& e) {
  return {{"mix", mix_text(e.mix)},
          {"dp", e.mix.dp},
          {"tp", e.mix.tp},
          {"pp", e.mix.pp},
          {"cp", e.mix.cp},
          {"zero_stage", e.mix.zero_stage},
          {"recompute", name_of(kRecomputes, e.mix.recompute)},
          {"micro_batch", e.mix.micro_batch},
          {"virtual_stages", e.mix.virtual_stages},
          {"shard", e.mix.shard},
          {"ep", e.mix.ep},
          {"per_gpu_bytes", e.ledger.total_bytes()},
          {"fits", e.fits && e.batch_ok},
          {"bubble", e.bubble},
          {"step_time_s", e.step_time_s}};
}

nlohmann::json plan_json(const PlanRequest& req, const Plan& p,
                         const std::vector<StrategyRow>& rows) {
  const Evaluation& e = p.eval;
  nlohmann::json traffic = nlohmann::json::array();
  for (const auto& t : e.traffic) {
    traffic.push_back({{"strategy", strategy_name(t.strategy)},
                       {"degree", t.degree},
                       {"bytes_per_gpu", t.bytes_per_gpu},
                       {"crosses_nodes", t.crosses_nodes},
                       {"seconds", t.seconds}});
  }
  nlohmann::json branches = nlohmann::json::array();
  for (const auto& b : p.branches) {
    branches.push_back({{"family", family_name(b.family)},
                        {"verdict", b.verdict},
                        {"best", b.best ? evaluation_json(*b.best) : nlohmann::json(nullptr)}});
  }
  nlohmann::json plan = evaluation_json(e);  // its "fits" is p.fits: the eval fits, batch fed
  plan.update({{"family", family_name(p.family)},
               {"reasons", p.reasons},
               {"branches", branches},
               {"per_gpu",
                {{"params", e.ledger.state.params},
                 {"grads", e.ledger.state.grads},
                 {"optimizer", e.ledger.state.optimizer},
                 {"activations", e.ledger.activation_bytes}}},
               {"capacity_bytes", e.capacity_bytes},
               {"traffic", traffic},
               {"comm_time_s", e.comm_time_s},
               {"compute_time_s", e.compute_time_s},
               {"needs_gpus", p.needs_gpus},
               {"train_time_s", p.train_time_s},
               {"train_time_1gpu_s", p.train_time_1gpu_s}});
  nlohmann::json strategies = nlohmann::json::array();
  for (const auto& r : rows) {
    strategies.push_back({{"strategy", strategy_name(r.strategy)},
                          {"degree", r.degree},
                          {"splits", r.splits},
                          {"shards", r.shards},
                          {"collectives", r.collectives},
                          {"formula", r.formula},
                          {"bytes_per_gpu", r.bytes_per_gpu},
                          {"intra_s", r.intra_s},
                          {"inter_s", r.inter_s},
                          {"memory_bytes", r.memory_bytes},
                          {"fits", r.fits}});
  }
  const Cluster& c = req.cluster;
  return {{"model", model_json(req.model)},
          {"params", count_params(req.model)},
          {"active_params", active_params(req.model)},
          {"cluster",
           {{"name", c.name},
            {"gpus_per_node", c.gpus_per_node},
            {"gpu_mem_gb", c.gpu_mem_gb},
            {"intra_gbps", c.intra_gbps},
            {"inter_gbps", c.inter_gbps},
            {"peak_tflops", c.peak_tflops}}},
          {"gpus", req.gpus},
          {"global_batch", req.batch()},
          {"seq", req.setup.seq},
          {"precision", name_of(kPrecisions, req.setup.precision)},
          {"fp32_grad_accum", req.setup.fp32_grad_accum},
          {"weight_wire_bytes", weight_wire_bytes(req.setup)},
          {"gradient_wire_bytes", gradient_wire_bytes(req.setup)},
          {"tokens", req.tokens},
          {"mfu", req.mfu},
          {"plan", plan},
          {"strategies", strategies}};
}

// One line for a mix and what it costs: the runner-up and --compare use it.
std::string mix_line(const Mix& m) {
  std::string line = fmt::format("dp {} x tp {} x pp {} x cp {} = {} GPUs, ZeRO stage {}", m.dp,
                                 m.tp, m.pp, m.cp, m.gpus(), m.zero_stage);
  if (m.shard > 0) line += fmt::format(" (HSDP: shard {}, {} replicas)", m.shard, m.dp / m.shard);
  line += fmt::format(", recompute {}, micro-batch {}", name_of(kRecomputes, m.recompute),
                      m.micro_batch);
  if (m.virtual_stages > 1) line += fmt::format(", {} virtual stages", m.virtual_stages);
  if (m.ep > 1) line += fmt::format(", ep {}", m.ep);
  return line;
}

std::string cost_line(const Evaluation& e) {
  return fmt::format(
      "{} of {} per GPU ({}); step: compute {:.3g} s x (1 + bubble {:.3f}) + "
      "communication {:.3g} s = {:.3g} s",
      memory_text(e.ledger.total_bytes(), 2), memory_text(e.capacity_bytes, 1),
      !e.fits ? "does NOT fit"
              : (!e.batch_ok ? "fits, but the batch does not feed it: a micro-batch a replica, "
                               "as many as pipeline stages"
                             : "fits"),
      e.compute_time_s, e.bubble, e.comm_time_s, e.step_time_s);
}

void print_plan(std::ostream& out, const PlanRequest& req, const Plan& p,
                const std::vector<StrategyRow>& rows, int64_t n) {
  const Cluster& c = req.cluster;
  const TrainingSetup& s = req.setup;
  const double params = static_cast<double>(count_params(req.model));
  // Memory in MiB on a cluster of a few MiB a rank (course-cpu), else in GB.
  const bool mib = c.gpu_mem_gb < 0.1;
  const double unit = mib ? 1024.0 * 1024.0 : kGB;
  const char* u = mib ? "MiB" : "GB";
  const std::string capacity = mib ? fmt::format("{:g} MiB", c.gpu_mem_gb * kGB / unit)
                                   : fmt::format("{:g} GB", c.gpu_mem_gb);
  fmt::print(out, "Plan: {} ({} parameters) on {} GPUs of {}\n", req.model.name,
             params >= 1e8 ? fmt::format("{:.1f} B", params / 1e9) : fmt::format("{:.3g}", params),
             req.gpus, c.name);
  fmt::print(out,
             "  cluster: {} GPUs per node, {} each; per GPU per direction: intra-node "
             "{:g} GB/s, inter-node {:g} GB/s; {:g} TFLOP/s\n",
             c.gpus_per_node, capacity, c.intra_gbps, c.inter_gbps, c.peak_tflops);
  fmt::print(out,
             "  one step: {} sequences x {} tokens = {:.3g} tokens, micro-batch {} in the table "
             "(the plan tries 1 to {}); {} precision + {}; {:.0f}% MFU\n\n",
             req.batch(), s.seq, static_cast<double>(req.batch() * s.seq), s.micro_batch,
             req.max_micro_batch, name_of(kPrecisions, s.precision),
             name_of(kOptimizers, s.optimizer), req.mfu * 100);

  const double compute_s = train_time_seconds(static_cast<double>(active_params(req.model)),
                                              static_cast<double>(req.batch() * s.seq),
                                              c.peak_tflops * 1e12, req.mfu, n);
  fmt::print(out,
             "The five strategies, each alone on {} GPUs: one step computes for {:.3g} s there\n"
             "(w = {:g} bytes a weight and g = {:g} a gradient on the wire, P = {:.3g} parameters, "
             "m = micro-batches per replica, L layers, s b h = one micro-batch's activations)\n\n",
             n, compute_s, weight_wire_bytes(s), gradient_wire_bytes(s), params);
  fmt::print(out, "  {:<12} {:>3}  {:<35} {:>11} {:>9} {:>9} {:>8}  {}\n", "strategy", "n",
             "shards (per GPU)", fmt::format("sent {}/GPU", u), "intra s", "inter s",
             fmt::format("mem {}", u), "fits");
  for (const auto& r : rows) {
    fmt::print(out, "  {:<12} {:>3}  {:<35} {:>11.1f} {:>9.3g} {:>9.3g} {:>8.1f}  {}\n",
               strategy_name(r.strategy), r.degree, shards_text(r.shards), r.bytes_per_gpu / unit,
               r.intra_s, r.inter_s, r.memory_bytes / unit, r.fits ? "yes" : "no");
  }
  fmt::print(out, "\n  {:<12} {:<42} {:<70} {}\n", "strategy", "splits", "collectives",
             "bytes sent per GPU per step");
  for (const auto& r : rows) {
    fmt::print(out, "  {:<12} {:<42} {:<70} {}\n", strategy_name(r.strategy), r.splits,
               r.collectives, r.formula);
  }

  const Evaluation& e = p.eval;
  const Mix& m = e.mix;
  fmt::print(out,
             "\nThe decision tree, branch by branch (a later, more complex branch must be {:.0f}% "
             "faster to win):\n",
             kSimplerWithin * 100);
  for (const auto& b : p.branches) {
    fmt::print(out, "  {:<11} {}\n", family_name(b.family), b.verdict);
  }
  fmt::print(out, "\n{} mix ({}): {}\n", p.fits ? "Recommended" : "Closest", family_name(p.family),
             mix_line(m));
  for (const auto& reason : p.reasons) fmt::print(out, "  - {}\n", reason);
  const Ledger& l = e.ledger;
  fmt::print(out,
             "  per GPU: params {:.2f} + grads {:.2f} + optimizer {:.2f} + activations {:.2f} = "
             "{:.2f} {} of {:.1f} {} usable ({:.0f}% of {})\n",
             l.state.params / unit, l.state.grads / unit, l.state.optimizer / unit,
             l.activation_bytes / unit, l.total_bytes() / unit, u, e.capacity_bytes / unit, u,
             kUsableMemory * 100, capacity);
  if (!e.traffic.empty()) {
    fmt::print(out, "  traffic per step:\n");
    for (const auto& t : e.traffic) {
      fmt::print(out, "    {:<12} n={:<5} {:>10.4g} {} per GPU on {:<10} {:>9.3g} s\n",
                 strategy_name(t.strategy), t.degree, t.bytes_per_gpu / unit, u,
                 t.crosses_nodes ? "inter-node" : "intra-node", t.seconds);
    }
  }
  fmt::print(out,
             "  step: compute {:.3g} s x (1 + bubble {:.3f}) + communication {:.3g} s (no overlap) "
             "= {:.3g} s\n",
             e.compute_time_s, e.bubble, e.comm_time_s, e.step_time_s);
  if (p.runner_up) {
    const Evaluation& r = *p.runner_up;
    const double ratio = r.step_time_s / e.step_time_s;
    fmt::print(out, "  runner-up ({}): {}\n    {}\n    {}\n", family_name(p.runner_up_family),
               mix_line(r.mix), cost_line(r),
               ratio >= 1 ? fmt::format("{:.1f}% slower a step than the pick", (ratio - 1) * 100)
                          : fmt::format("{:.1f}% faster a step, within the {:.0f}% a more "
                                        "complex branch must win by",
                                        (1 - ratio) * 100, kSimplerWithin * 100));
  }
  if (!p.fits) {
    if (p.needs_gpus > 0) {
      fmt::print(out, "  does NOT fit on this cluster: needs {} GPUs ({} nodes of {})\n",
                 p.needs_gpus, std::max<int64_t>(1, p.needs_gpus / c.gpus_per_node),
                 c.gpus_per_node);
    } else {
      fmt::print(out,
                 "  does NOT fit on any number of these GPUs (up to {}): even the most sharded "
                 "mix needs more memory than one GPU has\n",
                 int64_t{1} << 20);
    }
  }
  const double steps = req.tokens / static_cast<double>(req.batch() * s.seq);
  fmt::print(out,
             "\n  time to train on {:.3g} tokens (6ND at {:.0f}% MFU): {} on 1 GPU, {} on {} GPUs "
             "({:.0f}x faster); with this mix's communication and bubble: {}\n",
             req.tokens, req.mfu * 100, human_time(p.train_time_1gpu_s), human_time(p.train_time_s),
             req.gpus, p.train_time_1gpu_s / p.train_time_s, human_time(steps * e.step_time_s));
}

// --compare DPxTPxPPxCP[:ZERO[:RECOMPUTE[:MICRO[:VIRTUAL]]]]: a mix of exactly req.gpus GPUs
// that the model allows (the ledger's own checks of tp and pp, validate()); ZERO is 0-3, or
// hsdpN for ZeRO-3 sharded over groups of N data-parallel ranks.
Mix parse_compare(const std::string& text, const PlanRequest& req) {
  const auto bad = [&](const std::string& why) {
    return UsageError("--compare", "'" + text + "' " + why,
                      "give DPxTPxPPxCP[:ZERO[:RECOMPUTE[:MICRO[:VIRTUAL]]]], e.g. --compare "
                      "128x8x16x1:1:none:1:8 (Llama 3 405B's layout); ZERO 0-3 or hsdpN");
  };
  const MixSpec spec = parse_mix(text, "--compare");  // the grammar, and degrees of at least 1
  Mix m;
  m.dp = spec.dp;
  m.tp = spec.tp;
  m.pp = spec.pp;
  m.cp = spec.cp;
  m.zero_stage = spec.zero_stage;
  m.shard = spec.shard;
  m.recompute = kRecomputes.at(spec.recompute);
  m.micro_batch = spec.micro_batch;
  m.virtual_stages = spec.virtual_stages;
  m.ep = req.setup.ep;  // --ep, as every mix of the plan has it
  if (m.gpus() != req.gpus) {
    throw bad(fmt::format("uses {} GPUs, not the --gpus {} of the plan", m.gpus(), req.gpus));
  }
  if (m.shard > 0 && (m.cp != 1 || m.dp % m.shard != 0)) {
    throw bad(
        fmt::format("asks HSDP over groups of {}, which needs cp 1 and a group that divides "
                    "dp {}",
                    m.shard, m.dp));
  }
  const int64_t stage_layers = (req.model.layers + m.pp - 1) / m.pp;
  if (m.virtual_stages > 1 && (m.pp < 2 || stage_layers % m.virtual_stages != 0)) {
    throw bad(
        fmt::format("asks {} virtual stages, which needs pp >= 2 and a count that divides "
                    "a stage's {} layers",
                    m.virtual_stages, stage_layers));
  }
  TrainingSetup s = req.setup;
  s.dp = m.dp;
  s.tp = m.tp;
  s.pp = m.pp;
  s.ep = m.ep;
  try {
    validate(s, &req.model);
  } catch (const UsageError& e) {
    const std::string what = e.what();
    throw bad("does not suit the model (" + what.substr(0, what.find('\n')) + ")");
  }
  return m;
}

int run_plan(const Options& o, const std::optional<ModelConfig>& model, std::ostream& out) {
  if (!model) {
    throw UsageError("--plan", "needs the model's shape, not just a parameter count",
                     "pass --model NAME (e.g. --model llama3-70b) or describe it with --arch "
                     "--hidden --layers --heads --ffn --vocab");
  }
  PlanRequest req;
  req.model = *model;
  req.setup = o.setup;
  req.cluster = cluster_preset(o.cluster);
  if (o.set_gpus_per_node) req.cluster.gpus_per_node = o.gpus_per_node;
  if (o.set_gpu_mem) req.cluster.gpu_mem_gb = o.gpu_mem_gb;
  if (o.set_peak) req.cluster.peak_tflops = o.peak_tflops;
  if (o.set_intra) req.cluster.intra_gbps = o.intra_bw;
  if (o.set_inter) req.cluster.inter_gbps = o.inter_bw;
  if (o.set_gpus_per_node || o.set_gpu_mem || o.set_peak || o.set_intra || o.set_inter) {
    req.cluster.name += " (modified)";
  }
  req.gpus = o.gpus != 0 ? o.gpus : req.cluster.gpus_per_node;
  req.global_batch = o.global_batch;
  req.max_micro_batch = o.max_micro_batch;
  req.mfu = o.mfu;
  req.tokens = o.tokens.empty() ? 1e12 : parse_count(o.tokens, "--tokens");
  validate(req);  // all input checked before any arithmetic
  const std::optional<Mix> compared =
      o.compare.empty() ? std::nullopt : std::optional<Mix>(parse_compare(o.compare, req));
  const Plan p = plan(req);
  const int64_t n = std::min(req.gpus, req.cluster.gpus_per_node);
  const std::vector<StrategyRow> rows = strategy_table(req, n);
  const std::optional<Evaluation> cmp =
      compared ? std::optional<Evaluation>(evaluate(req, *compared)) : std::nullopt;
  if (o.json) {
    auto j = plan_json(req, p, rows);
    j["runner_up"] = p.runner_up ? evaluation_json(*p.runner_up) : nlohmann::json(nullptr);
    if (cmp) j["compare"] = evaluation_json(*cmp);
    print_json_line(out, j);
  } else {
    print_plan(out, req, p, rows, n);
    if (cmp) {
      fmt::print(out, "\nCompared mix: {}\n  {}\n  {:.2f}x the pick's step time\n",
                 mix_line(cmp->mix), cost_line(*cmp), cmp->step_time_s / p.eval.step_time_s);
    }
  }
  return kExitOk;
}

int run(const Options& o_in, std::ostream& out) {
  Options o = o_in;
  TrainingSetup& s = o.setup;
  // The plan's default is what a bf16 run of Megatron-LM or NeMo holds: fp32 gradients, summed
  // over hundreds of micro-batches and reduced in fp32 (README part 2, "The numerics a plan
  // assumes"); the ledger's own default is the textbook 2 + 2 + 12 of the ZeRO paper.
  if (o.precision.empty()) {
    o.precision = o.plan && !s.fp32_grad_accum ? "mixed-fp32-grads" : "mixed";
  }
  s.precision = kPrecisions.at(o.precision);
  s.optimizer = kOptimizers.at(o.optimizer);
  s.recompute = kRecomputes.at(o.recompute);
  s.attention = kAttentions.at(o.attention);
  if (o.gpu_mem_gb <= 0) {
    throw UsageError("--gpu-mem", "must be positive", "pass the GPU's memory in GB, e.g. 80");
  }
  if (o.mfu <= 0 || o.mfu > 1) {
    throw UsageError("--mfu", fmt::format("{} is not a fraction in (0, 1]", o.mfu),
                     "model FLOPs utilisation is typically 0.3-0.5: e.g. --mfu 0.4");
  }
  if (o.peak_tflops <= 0) {
    throw UsageError("--peak-tflops", "must be positive",
                     "H100 SXM dense BF16 is 989: --peak-tflops 989");
  }

  std::optional<ModelConfig> model;
  int64_t params = 0;
  if (!o.model.empty()) {
    model = preset(o.model);
  } else if (!o.arch.empty()) {
    model = o.shape;
    model->name = "custom";
    model->arch = kArchs.at(o.arch);
    if (model->kv_heads == 0) model->kv_heads = model->heads;
  } else if (!o.params.empty() && !o.plan) {
    params = static_cast<int64_t>(parse_count(o.params, "--params"));
  } else if (!o.plan) {
    validate(s, nullptr);
    return compare_family(out, o);
  }
  if (o.plan) return run_plan(o, model, out);
  const ModelConfig* shape = model ? &*model : nullptr;
  if (model) validate(*model);
  validate(s, shape);  // all input checked before any arithmetic
  if (model) params = count_params(*model);
  const Ledger ledger = compute_ledger(params, s, shape);
  // Training FLOPs follow the parameters a token goes through: the active ones of an MoE.
  const int64_t flops_params = model ? active_params(*model) : params;

  nlohmann::json j = ledger_json(ledger, shape, o);
  std::optional<double> time_s;
  const int64_t gpus = o.gpus > 0 ? o.gpus : s.dp * s.tp * s.pp;
  if (!o.tokens.empty()) {
    const double tokens = parse_count(o.tokens, "--tokens");
    time_s = train_time_seconds(static_cast<double>(flops_params), tokens, o.peak_tflops * 1e12,
                                o.mfu, gpus);
    j["train_time_s"] = *time_s;
    j["train"] = {
        {"tokens", tokens}, {"gpus", gpus}, {"peak_tflops", o.peak_tflops}, {"mfu", o.mfu}};
  }
  if (o.json) {
    print_json_line(out, j);
    return kExitOk;
  }
  print_ledger(out, ledger, shape, o);
  if (time_s) {
    fmt::print(out,
               "  time to train on {:.3g} tokens: {} on {} GPU(s) at {:.0f}% MFU of {:g} "
               "TFLOP/s\n",
               j["train"]["tokens"].get<double>(), human_time(*time_s), gpus, o.mfu * 100,
               o.peak_tflops);
  }
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{
      "Lesson 01: the training memory ledger, per device.\n"
      "With no model: the LLaMA 7B / 70B / 405B comparison.\n"
      "With --plan: the five parallelism strategies compared, and a mix for the model on a "
      "cluster.",
      "lesson01"};
  Options o;
  auto* model = app.add_option("--model", o.model, "a published model, e.g. llama-7b");
  auto* params = app.add_option("--params", o.params, "a bare parameter count, e.g. 7e9");
  auto* arch = app.add_option("--arch", o.arch, "describe a model: llama or gpt")
                   ->check(CLI::IsMember({"llama", "gpt"}));
  model->excludes(params)->excludes(arch);
  params->excludes(arch);
  std::vector<CLI::Option*> shape = {
      app.add_option("--hidden", o.shape.hidden, "hidden size h"),
      app.add_option("--layers", o.shape.layers, "transformer blocks L"),
      app.add_option("--heads", o.shape.heads, "attention heads a"),
      app.add_option("--ffn", o.shape.ffn, "MLP width F"),
      app.add_option("--vocab", o.shape.vocab, "vocabulary size V")};
  for (auto* opt : shape) opt->needs(arch);
  for (auto* opt : shape) arch->needs(opt);
  app.add_option("--kv-heads", o.shape.kv_heads, "key/value heads (default: heads)")->needs(arch);
  app.add_option("--ctx", o.shape.ctx, "context length (GPT's position embeddings)")->needs(arch);
  app.add_option("--experts", o.shape.experts,
                 "a mixture of experts: routed experts E per MoE block (default: dense)")
      ->needs(arch);
  app.add_option("--top-k", o.shape.top_k, "with --experts: experts each token goes through")
      ->needs(arch);
  app.add_option("--shared-experts", o.shape.shared_experts,
                 "with --experts: experts every token goes through (default 0)")
      ->needs(arch);
  app.add_option("--moe-ffn", o.shape.moe_ffn,
                 "with --experts: one expert's MLP width (default: --ffn)")
      ->needs(arch);
  app.add_option("--first-dense-layers", o.shape.first_dense_layers,
                 "with --experts: leading blocks that keep a dense MLP (default 0)")
      ->needs(arch);

  app.add_option("--precision", o.precision,
                 "fp32, mixed (16-bit weights and gradients) or mixed-fp32-grads (16-bit weights, "
                 "fp32 gradients: Megatron-LM's bf16 default); default: mixed, with --plan "
                 "mixed-fp32-grads")
      ->check(CLI::IsMember({"fp32", "mixed", "mixed-fp32-grads"}));
  app.add_flag("--fp32-grad-accum", o.setup.fp32_grad_accum,
               "mixed precision: accumulate gradients in fp32 (+4 bytes/param)");
  app.add_option("--optimizer", o.optimizer, "sgd, momentum, adam (= adamw) or adam8bit")
      ->check(CLI::IsMember({"sgd", "momentum", "adam", "adamw", "adam8bit"}))
      ->capture_default_str();
  app.add_option("--zero", o.setup.zero_stage, "ZeRO stage 0-3")->capture_default_str();
  app.add_option("--dp", o.setup.dp, "data-parallel degree")->capture_default_str();
  app.add_option("--tp", o.setup.tp, "tensor-parallel degree")->capture_default_str();
  app.add_option("--pp", o.setup.pp, "pipeline-parallel degree")->capture_default_str();
  app.add_option("--ep", o.setup.ep,
                 "expert-parallel degree (MoE): each GPU holds E/ep of the routed experts; the "
                 "ep ranks are dp ranks, so ep divides --dp (with --plan: every mix's dp)")
      ->capture_default_str();
  app.add_option("--seq", o.setup.seq, "sequence length s")->capture_default_str();
  app.add_option("--micro-batch", o.setup.micro_batch,
                 "micro-batch size b (with --plan: the comparison table's; the plan searches it)")
      ->capture_default_str();
  app.add_option("--recompute", o.recompute, "none, selective or full")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  app.add_option("--attention", o.attention,
                 "auto (flash for LLaMA, eager for GPT), eager (stores the s x s scores) or flash")
      ->check(CLI::IsMember({"auto", "eager", "flash"}))
      ->capture_default_str();
  app.add_flag("--sequence-parallel", o.setup.sequence_parallel,
               "Megatron sequence parallelism (with --tp)");
  app.add_option("--tokens", o.tokens, "training tokens, e.g. 1e12: prints the time to train");
  app.add_option("--gpus", o.gpus,
                 "GPUs for the time to train (default dp x tp x pp); with --plan, the GPUs to "
                 "plan for (default one node)");
  app.add_option("--peak-tflops", o.peak_tflops, "peak TFLOP/s per GPU (H100 BF16 dense: 989)")
      ->capture_default_str();
  app.add_option("--mfu", o.mfu, "model FLOPs utilisation, 0-1")->capture_default_str();
  auto* gpu_mem =
      app.add_option("--gpu-mem", o.gpu_mem_gb, "memory per GPU in GB")->capture_default_str();
  app.add_option("--mem-mib", o.mem_mib,
                 "memory per GPU (or CPU rank) in MiB, instead of --gpu-mem: e.g. 8 on the "
                 "course's CPU ranks")
      ->check(CLI::PositiveNumber)
      ->excludes(gpu_mem);
  app.add_flag("--json", o.json, "print one JSON object instead of the table");

  auto* plan = app.add_flag("--plan", o.plan,
                            "compare the five strategies and recommend a mix (dp, tp, pp, cp, "
                            "ZeRO, recompute) for --model on --cluster with --gpus");
  app.add_option("--compare", o.compare,
                 "with --plan: also cost this mix, DPxTPxPPxCP[:ZERO[:RECOMPUTE]] "
                 "(e.g. 128x8x16x1:1:none)")
      ->needs(plan);
  app.add_option("--cluster", o.cluster,
                 "with --plan: dgx-h100, h200x8, dgx-a100, pcie-ethernet, or course-cpu (the "
                 "course's 8 CPU ranks, 8 MiB each: lesson 11 runs the plan)")
      ->capture_default_str()
      ->needs(plan);
  app.add_option("--gpus-per-node", o.gpus_per_node, "with --plan: override the preset's")
      ->needs(plan);
  app.add_option("--intra-bw", o.intra_bw,
                 "with --plan: intra-node GB/s per GPU per direction (NVLink 4: 450)")
      ->needs(plan);
  app.add_option("--inter-bw", o.inter_bw,
                 "with --plan: inter-node GB/s per GPU per direction (InfiniBand 400 Gb/s: 50)")
      ->needs(plan);
  app.add_option("--global-batch", o.global_batch,
                 "with --plan: sequences per optimizer step (default: 4M tokens / seq)")
      ->needs(plan);
  app.add_option("--max-micro-batch", o.max_micro_batch,
                 "with --plan: try micro-batches of 1, 2, 4, ... up to this many sequences")
      ->capture_default_str()
      ->needs(plan);

  return run_cli(
      app, argc, argv,
      [&] {
        o.set_gpus_per_node = app.count("--gpus-per-node") > 0;
        if (app.count("--mem-mib") > 0) o.gpu_mem_gb = o.mem_mib * 1024 * 1024 / 1e9;
        o.set_gpu_mem = app.count("--gpu-mem") > 0 || app.count("--mem-mib") > 0;
        o.set_peak = app.count("--peak-tflops") > 0;
        o.set_intra = app.count("--intra-bw") > 0;
        o.set_inter = app.count("--inter-bw") > 0;
        return run(o, out);
      },
      err);
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l01

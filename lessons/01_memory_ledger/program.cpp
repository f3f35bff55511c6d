// The lesson01 program: command line, the ledger table, the 7B / 70B / 405B comparison.
// Given in full; the arithmetic it prints is yours, in ledger.cpp.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <cmath>
#include <map>
#include <optional>
#include <ostream>

#include "dtc/cli.h"
#include "dtc/errors.h"
#include "ledger.h"

namespace dtc::l01 {
namespace {

constexpr double kGB = 1e9;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

const std::map<std::string, Precision> kPrecisions = {{"fp32", Precision::kFp32},
                                                      {"mixed", Precision::kMixed}};
const std::map<std::string, Optimizer> kOptimizers = {{"sgd", Optimizer::kSgd},
                                                      {"momentum", Optimizer::kMomentum},
                                                      {"adam", Optimizer::kAdam},
                                                      {"adamw", Optimizer::kAdam},
                                                      {"adam8bit", Optimizer::kAdam8bit}};
const std::map<std::string, Recompute> kRecomputes = {
    {"none", Recompute::kNone}, {"selective", Recompute::kSelective}, {"full", Recompute::kFull}};
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
  std::string precision = "mixed";
  std::string optimizer = "adam";
  std::string recompute = "none";
  std::string tokens;
  int64_t gpus = 0;
  double peak_tflops = 989.0;  // H100 SXM, dense BF16
  double mfu = 0.4;
  double gpu_mem_gb = 80.0;
  bool json = false;
};

nlohmann::json model_json(const ModelConfig& m) {
  return {{"name", m.name},     {"arch", name_of(kArchs, m.arch)},
          {"hidden", m.hidden}, {"layers", m.layers},
          {"heads", m.heads},   {"kv_heads", m.kv_heads},
          {"ffn", m.ffn},       {"vocab", m.vocab},
          {"ctx", m.ctx}};
}

nlohmann::json ledger_json(const Ledger& l, const ModelConfig* model, const Options& o) {
  const TrainingSetup& s = o.setup;
  nlohmann::json j;
  j["model"] = model ? model_json(*model) : nlohmann::json(nullptr);
  j["params"] = l.params;
  j["setup"] = {{"precision", name_of(kPrecisions, s.precision)},
                {"fp32_grad_accum", s.fp32_grad_accum},
                {"optimizer", name_of(kOptimizers, s.optimizer)},
                {"zero_stage", s.zero_stage},
                {"dp", s.dp},
                {"tp", s.tp},
                {"pp", s.pp},
                {"seq", s.seq},
                {"micro_batch", s.micro_batch},
                {"recompute", name_of(kRecomputes, s.recompute)},
                {"sequence_parallel", s.sequence_parallel}};
  j["params_per_replica"] = l.params_per_replica;
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
  if (model) {
    fmt::print(out, "Training memory ledger: {} ({}, {:L} parameters)\n", model->name,
               model->arch == Arch::kLlama ? "LLaMA-style" : "GPT-style", l.params);
  } else {
    fmt::print(out, "Training memory ledger: {:.4g} parameters (no shape: no activations)\n",
               static_cast<double>(l.params));
  }
  fmt::print(out, "  set-up: {} precision{}, {}, ZeRO stage {}, dp {} x tp {} x pp {}",
             name_of(kPrecisions, s.precision), s.fp32_grad_accum ? " (+fp32 grad accum)" : "",
             name_of(kOptimizers, s.optimizer), s.zero_stage, s.dp, s.tp, s.pp);
  if (model) {
    fmt::print(out, ", seq {}, micro-batch {}, recompute {}{}", s.seq, s.micro_batch,
               name_of(kRecomputes, s.recompute), s.sequence_parallel ? ", sequence parallel" : "");
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
    fmt::print(out, "  does NOT fit on one {:g} GB GPU: {:.1f}x too big\n", o.gpu_mem_gb,
               total / cap);
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
             "  Won't fit: beyond 7B no single GPU holds the training state. Won't finish: years "
             "on one GPU, days on a thousand.\n",
             bytes_per_param(o.setup.precision, o.setup.optimizer, o.setup.fp32_grad_accum).total(),
             tokens, o.mfu * 100, o.peak_tflops);
  return kExitOk;
}

int run(const Options& o_in, std::ostream& out) {
  Options o = o_in;
  TrainingSetup& s = o.setup;
  s.precision = kPrecisions.at(o.precision);
  s.optimizer = kOptimizers.at(o.optimizer);
  s.recompute = kRecomputes.at(o.recompute);
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
  } else if (!o.params.empty()) {
    params = static_cast<int64_t>(parse_count(o.params, "--params"));
  } else {
    validate(s, nullptr);
    return compare_family(out, o);
  }
  const ModelConfig* shape = model ? &*model : nullptr;
  if (model) validate(*model);
  validate(s, shape);  // all input checked before any arithmetic
  if (model) params = count_params(*model);
  const Ledger ledger = compute_ledger(params, s, shape);

  nlohmann::json j = ledger_json(ledger, shape, o);
  std::optional<double> time_s;
  const int64_t gpus = o.gpus > 0 ? o.gpus : s.dp * s.tp * s.pp;
  if (!o.tokens.empty()) {
    const double tokens = parse_count(o.tokens, "--tokens");
    time_s =
        train_time_seconds(static_cast<double>(params), tokens, o.peak_tflops * 1e12, o.mfu, gpus);
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
      "With no model: the LLaMA 7B / 70B / 405B comparison.",
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

  app.add_option("--precision", o.precision, "fp32 or mixed")
      ->check(CLI::IsMember({"fp32", "mixed"}))
      ->capture_default_str();
  app.add_flag("--fp32-grad-accum", o.setup.fp32_grad_accum,
               "mixed precision: accumulate gradients in fp32 (+4 bytes/param)");
  app.add_option("--optimizer", o.optimizer, "sgd, momentum, adam (= adamw) or adam8bit")
      ->check(CLI::IsMember({"sgd", "momentum", "adam", "adamw", "adam8bit"}))
      ->capture_default_str();
  app.add_option("--zero", o.setup.zero_stage, "ZeRO stage 0-3")->capture_default_str();
  app.add_option("--dp", o.setup.dp, "data-parallel degree")->capture_default_str();
  app.add_option("--tp", o.setup.tp, "tensor-parallel degree")->capture_default_str();
  app.add_option("--pp", o.setup.pp, "pipeline-parallel degree")->capture_default_str();
  app.add_option("--seq", o.setup.seq, "sequence length s")->capture_default_str();
  app.add_option("--micro-batch", o.setup.micro_batch, "micro-batch size b")->capture_default_str();
  app.add_option("--recompute", o.recompute, "none, selective or full")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  app.add_flag("--sequence-parallel", o.setup.sequence_parallel,
               "Megatron sequence parallelism (with --tp)");
  app.add_option("--tokens", o.tokens, "training tokens, e.g. 1e12: prints the time to train");
  app.add_option("--gpus", o.gpus, "GPUs for the time to train (default dp x tp x pp)");
  app.add_option("--peak-tflops", o.peak_tflops, "peak TFLOP/s per GPU (H100 BF16 dense: 989)")
      ->capture_default_str();
  app.add_option("--mfu", o.mfu, "model FLOPs utilisation, 0-1")->capture_default_str();
  app.add_option("--gpu-mem", o.gpu_mem_gb, "memory per GPU in GB")->capture_default_str();
  app.add_flag("--json", o.json, "print one JSON object instead of the table");

  return run_cli(
      app, argc, argv, [&] { return run(o, out); }, err);
}

}  // namespace dtc::l01

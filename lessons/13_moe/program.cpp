// The lesson13 program: trains the course's GPT with a mixture of experts in every block, the
// experts split over ep ranks (expert parallelism) folded over the data-parallel ranks, and
// reports where the tokens went: each expert's load, the imbalance, the bytes of the all-to-alls.
// Given in full; the parallel parts are yours, in moe.cpp.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <ostream>

#include "dtc/cli.h"
#include "dtc/data.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/format.h"
#include "dtc/program.h"
#include "moe.h"

namespace dtc::l13 {

namespace {

struct Options {
  int ep = 0;  // 0: the world size
  std::string score = "softmax";
  std::string balance = "aux";
};

/// What one forward and backward of the whole run sends to other ranks through the all-to-alls
/// of the tokens, per rank, under uniform routing and no drops: every layer sends each of this
/// rank's N k copies with probability (ep - 1) / ep, and gets as many back, forward and backward.
double uniform_token_bytes(int64_t tokens, int64_t k, int64_t hidden, int64_t layers, int ep) {
  return 4.0 * static_cast<double>(tokens * k * hidden * 4 * layers) * (ep - 1) / ep;
}

int run(const TrainOptions& t, const MoeConfig& moe_in, const Options& o, std::ostream& out,
        std::ostream& err) {
  // 1. Configuration, checked on every rank before the network is touched.
  MoeConfig moe = moe_in;
  moe.score = o.score == "sigmoid" ? ScoreFunc::kSigmoid : ScoreFunc::kSoftmax;
  moe.balance = o.balance == "bias"   ? Balance::kBias
                : o.balance == "none" ? Balance::kNone
                                      : Balance::kAux;
  const RunConfig run = t.run_config();
  Job job = Job::prepare(t.train.backend, std::chrono::seconds(t.timeout_s));
  const int world = job.env.world_size;
  const int ep = o.ep == 0 ? world : o.ep;
  check_moe(moe, world, ep);
  check_batch_split(run.batch, world);

  // 2. Build: the process group, then this rank's data, ep and expert-data groups.
  job.trace_dir = t.trace;  // --trace DIR: a timeline of every rank
  job.connect();
  MoeGroups groups = make_moe_groups(job.store, job.rank(), world, ep, job.backend, job.timeout,
                                     job.env.master_addr);
  MoeTrainer trainer(run, moe, groups, job.device);
  const bool talk = job.rank0() && !t.train.json;
  // total, and active: all but the E - k routed experts of each layer a token skips
  int64_t total_params = 0, expert_params = 0;
  for (const auto& p : make_moe_gpt(run.model, moe, run.seed)->named_parameters()) {
    total_params += p.value().numel();
    if (is_expert(p.key())) expert_params += p.value().numel();
  }
  const int64_t active = total_params - expert_params / moe.experts * (moe.experts - moe.top_k);
  if (talk) {
    print_banner(
        out, "Lesson 13: mixture of experts", job, run.model, total_params,
        {{"moe", fmt::format("{} experts, top-{}, {} shared; {} scores{}, {}; {} active "
                             "parameters per token",
                             moe.experts, moe.top_k, moe.shared, score_func_name(moe.score),
                             moe.route_norm ? " renormalised" : "",
                             moe.capacity_factor > 0
                                 ? fmt::format("capacity factor {:g}", moe.capacity_factor)
                                 : std::string("dropless"),
                             with_commas(active))},
         {"balance",
          moe.balance == Balance::kAux ? fmt::format("aux loss, coefficient {:g}", moe.aux_coef)
          : moe.balance == Balance::kBias
              ? fmt::format("expert bias (auxiliary-loss-free), rate {:g}", moe.bias_rate)
              : std::string("none")},
         {"grid", fmt::format("{} ranks = ep {} x edp {}: each rank {} of the {} experts of "
                              "every layer, the rest replicated; every rank its own rows",
                              world, ep, world / ep, moe.experts / ep, moe.experts)},
         {"train", fmt::format("AdamW lr {:g}, {} steps, global batch {} ({} per rank), seed {}",
                               run.lr, t.train.steps, run.batch, run.batch / world, run.seed)}});
  }

  // 3. The loop, one progress line per tenth of the run.
  StepLog log(err, talk, 0, t.train.steps, run.batch * run.model.ctx);
  std::vector<MoeStep> steps;
  std::vector<int64_t> bytes;  // rank 0's all-to-all bytes to other ranks, per step
  int64_t before = 0;
  log.begin_step();
  for (int64_t s = 0; s < t.train.steps; ++s) {
    steps.push_back(trainer.step(s));
    const int64_t now = groups.ep->alltoall_bytes_to_others();
    bytes.push_back(now - before);
    before = now;
    log.end_step(s, steps.back().loss);
    log.begin_step();
  }
  const nlohmann::json digest = trainer.digest();

  // The contrast: layer 0's MoE, fresh, one forward and backward on this rank's tokens of step 0
  // (their embeddings), its experts split over the ep group the two ways. Bytes each rank sent to
  // the others (recorded), the experts' weights it holds, and the time.
  nlohmann::json contrast = nullptr;
  if (ep > 1) {
    const int64_t rows = run.batch / world;
    const Batch b =
        ByteDataset::builtin().batch(run.seed, 0, rows, run.model.ctx, job.rank() * rows);
    contrast = nlohmann::json::object();
    for (const char* how : {"ep", "tp"}) {
      Gpt fresh = make_moe_gpt(run.model, moe, run.seed);
      fresh->to(job.device);
      MoeLayerImpl& layer = moe_layer(fresh, 0);
      auto rec = c10::make_intrusive<RecordingComm>(groups.ep->inner());
      if (std::string(how) == "ep") {
        layer.shard_experts(rec.get());
      } else {
        layer.split_experts(rec.get());
      }
      const torch::Tensor x =
          embed_tokens(fresh->wte, fresh->wpe, b.inputs.to(job.device)).detach();
      const auto t0 = std::chrono::steady_clock::now();
      layer.forward(x).pow(2).mean().backward();
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      int64_t weights = 0;
      for (const auto& p : layer.experts->parameters()) weights += p.numel() * p.element_size();
      contrast[how] = {{"sent_bytes", rec->alltoall_bytes_to_others()},
                       {"expert_param_bytes", weights},
                       {"ms", ms}};
    }
  }

  // 4. Report, 5. finish.
  job.finish();
  if (!job.rank0()) return kExitOk;
  const int64_t tokens = run.batch / world * run.model.ctx;
  const double predicted =
      uniform_token_bytes(tokens, moe.top_k, run.model.hidden, run.model.layers, ep);
  if (t.train.json) {
    nlohmann::json j = run_json(log, t.train.steps, job.device);
    add_job_json(j, job, run, Recompute::kNone, digest);
    j["experts"] = moe.experts;
    j["top_k"] = moe.top_k;
    j["shared_experts"] = moe.shared;
    j["score_func"] = score_func_name(moe.score);
    j["route_norm"] = moe.route_norm;
    j["capacity_factor"] = moe.capacity_factor;
    j["balance"] = balance_name(moe.balance);
    j["aux_loss_coef"] = moe.aux_coef;
    j["z_loss_coef"] = moe.z_coef;
    j["ep"] = ep;
    j["edp"] = world / ep;
    j["params"] = total_params;
    j["active_params"] = active;
    nlohmann::json counts = nlohmann::json::array(), kept = nlohmann::json::array(),
                   imbalance = nlohmann::json::array(), expert_imbalance = nlohmann::json::array();
    for (const MoeStep& s : steps) {
      counts.push_back(s.counts);
      kept.push_back(s.kept);
      imbalance.push_back(s.imbalance);
      expert_imbalance.push_back(s.expert_imbalance);
    }
    j["router_counts"] = counts;
    j["router_kept"] = kept;
    j["imbalance"] = imbalance;
    j["expert_imbalance"] = expert_imbalance;
    j["alltoall_bytes"] = {{"measured", bytes}, {"uniform_prediction", predicted}};
    j["expert_tp_contrast"] = contrast;
    print_json_line(out, j);
    return kExitOk;
  }
  const auto& losses = log.losses();
  fmt::print(out, "\n  trained {} steps: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, {:.1f} s\n",
             losses.size(), losses.front(), losses.back(), log.tokens_per_s(), log.elapsed_s());
  const MoeStep& last = steps.back();
  int64_t dropped = 0, chosen = 0;
  for (size_t i = 0; i < last.counts.size(); ++i) {
    for (size_t e = 0; e < last.counts[i].size(); ++e) {
      chosen += last.counts[i][e];
      dropped += last.counts[i][e] - last.kept[i][e];
    }
  }
  fmt::print(out, "\nWhere the last step's tokens went (choices per expert, all ranks):\n");
  for (size_t i = 0; i < last.counts.size(); ++i) {
    fmt::print(out, "  layer {}  {}\n", i, fmt::join(last.counts[i], " "));
  }
  fmt::print(out,
             "  busiest expert / mean: {:.2f}; busiest ep rank / mean: {:.2f} (its kept copies, "
             "summed over the edp groups); dropped {} of {} choices\n",
             last.expert_imbalance, last.imbalance, dropped, chosen);
  fmt::print(out,
             "\nAll-to-all bytes rank 0 sent to other ranks in the last step: {} (uniform routing "
             "predicts {}: N k h 4 bytes (ep-1)/ep, dispatch and combine, forward and backward, "
             "{} layers; plus the counts)\n",
             with_commas(bytes.back()), with_commas(static_cast<int64_t>(predicted)),
             run.model.layers);
  if (!contrast.is_null()) {
    fmt::print(out,
               "\nLayer 0's experts split two ways over the ep group of {} (one forward and "
               "backward of rank 0's {} tokens; rank 0's numbers):\n",
               ep, tokens);
    for (const auto& [how, label] : std::vector<std::pair<std::string, std::string>>{
             {"ep", "expert parallel: E/ep whole experts"},
             {"tp", "tensor parallel: 1/ep of every expert"}}) {
      const nlohmann::json& c = contrast.at(how);
      fmt::print(out, "  {:<38} weights {:>11} bytes, sent {:>11} bytes, {:7.1f} ms\n", label,
                 with_commas(c.at("expert_param_bytes").get<int64_t>()),
                 with_commas(c.at("sent_bytes").get<int64_t>()), c.at("ms").get<double>());
    }
  }
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  TrainCli cli(
      "lesson13",
      "Lesson 13: mixture of experts. Trains the course's GPT with an MoE layer in every block,\n"
      "its experts split over --ep ranks; run it under torchrun, e.g.\n"
      "  torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson13 --ep 2");
  cli.add_timeout_flag();
  MoeConfig moe;
  Options o;
  CLI::App& app = cli.app();
  app.add_option("--experts", moe.experts, "routed experts per layer (E)")
      ->check(positive_count("--experts 4"))
      ->capture_default_str();
  app.add_option("--top-k", moe.top_k, "experts each token goes to (k, at most E)")
      ->check(positive_count("--top-k 2"))
      ->capture_default_str();
  app.add_option("--shared-experts", moe.shared,
                 "shared experts every token goes through (DeepSeek's), as one dense FFN")
      ->capture_default_str();
  app.add_option("--ep", o.ep,
                 "expert-parallel ranks: each holds E/ep experts; folded over the data-parallel "
                 "ranks, so it divides the world size (default: the world size)")
      ->check(positive_count("--ep 2"));
  app.add_option("--score-func", o.score, "the router's scores: softmax or sigmoid")
      ->check(one_of({"softmax", "sigmoid"}, "a score function"))
      ->capture_default_str();
  app.add_flag("--route-norm", moe.route_norm, "divide each token's k router weights by their sum");
  app.add_option("--capacity-factor", moe.capacity_factor,
                 "each expert takes at most ceil(c N k / E) of a rank's N tokens' copies, the "
                 "rest dropped; 0: dropless")
      ->capture_default_str();
  app.add_option("--balance", o.balance,
                 "load balancing: aux (Switch's loss), bias (DeepSeek-V3's expert bias) or none")
      ->check(one_of({"aux", "bias", "none"}, "a balancing method"))
      ->capture_default_str();
  app.add_option("--aux-loss-coef", moe.aux_coef, "the load-balancing loss's coefficient")
      ->capture_default_str();
  app.add_option("--z-loss-coef", moe.z_coef, "the router z-loss's coefficient (0: off)")
      ->capture_default_str();
  app.add_option("--bias-rate", moe.bias_rate, "--balance bias: the bias step per update")
      ->capture_default_str();
  return cli.run(argc, argv, err, [&] { return run(cli.options(), moe, o, out, err); });
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l13

// Lesson 11 (given): the mesh of a mix, this rank's groups and model (lesson 08's tensor-parallel
// blocks, lesson 10's context-parallel attention, in lesson 09's stages), and the step that runs
// them with your reduction, tied embedding and clipping. Your part is in nd.cpp; both implement
// nd.h.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "context_parallel_given.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "nd.h"
#include "sequence_parallel_given.h"
#include "tensor_parallel.h"

namespace dtc::l11 {

bool tp_sharded(const std::string& name) {
  auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  return has(".attn.c_attn.") || has(".mlp.c_fc.") ||
         (has(".c_proj.") && has(".weight") && (has(".attn.") || has(".mlp.")));
}

Mesh make_mesh(const MixSpec& mix, int world) {
  return Mesh::build(world, {{"pp", static_cast<int>(mix.pp), "--mix"},
                             {"dp_replicate", static_cast<int>(mix.dp), "--mix"},
                             {"cp", static_cast<int>(mix.cp), "--mix"},
                             {"tp", static_cast<int>(mix.tp), "--mix"}});
}

NdGroups make_groups(const c10::intrusive_ptr<c10d::Store>& store, const Mesh& mesh, int rank,
                     BackendKind backend, std::chrono::milliseconds timeout,
                     const std::string& master_addr) {
  const Reduction reduction = gradient_reduction(mesh);
  const std::vector<std::string> norm = norm_dims(mesh);
  // One communicator per distinct set (the learner's two may be the same set, or pp's or tp's).
  std::vector<std::vector<std::string>> sets{{"pp"}, {"tp"}, {"dp_replicate"}, {"cp"}};
  for (const auto& set : {reduction.dims, norm}) {
    const std::string key = Mesh::key(set);
    bool seen = false;
    for (const auto& s : sets) seen = seen || Mesh::key(s) == key;
    if (!seen) sets.push_back(set);
  }
  const MeshGroups groups(store, mesh, rank, sets, backend, timeout, master_addr);
  NdGroups g;
  g.mesh = mesh;
  g.rank = rank;
  // Each communicator through a recorder of its own (two of them may wrap one communicator).
  const auto record = [&g](const char* traffic, c10::intrusive_ptr<Comm> comm) {
    auto recorder = c10::make_intrusive<RecordingComm>(std::move(comm));
    g.recorders.emplace_back(traffic, recorder);
    return c10::intrusive_ptr<Comm>(recorder);
  };
  g.pp = record("pp", groups.get({"pp"}));
  g.tp = record("tp", groups.get({"tp"}));
  g.dp = record("dp", groups.get({"dp_replicate"}));
  g.cp = record("cp", groups.get({"cp"}));
  g.reduce = record("dp", groups.get(reduction.dims));
  g.norm = record("norm", groups.get(norm));
  // The embedding groups: for every (dp, cp, tp) coordinate, its pipeline's first and last
  // stage, created by every rank in the same order (a rank outside one gets null).
  const int pp = mesh.size("pp");
  if (pp > 1) {
    for (int first = 0; first < mesh.world(); ++first) {
      if (mesh.coord(first, "pp") != 0) continue;
      const int last = first + (pp - 1) * (mesh.world() / pp);  // pp is the slowest dimension
      auto comm = new_subgroup(store, fmt::format("embedding/{}-{}", first, last), {first, last},
                               rank, backend, timeout, master_addr);
      if (comm) g.embedding = record("embedding", comm);
    }
  }
  return g;
}

void check_nd(const NdOptions& o, int world) {
  const MixSpec& mix = o.mix;
  check_mix(mix, MixShape{o.model.layers, o.model.heads, o.model.ctx, world, o.batch}, "--mix");
  const std::string text = mix.text();
  if (mix.zero_stage > 0 || mix.shard > 0) {
    throw UsageError("--mix",
                     fmt::format("'{}' asks ZeRO or HSDP: this lesson composes dp, tp "
                                 "and pp with whole replicas",
                                 text),
                     "use ZERO 0 (lesson 07 runs ZeRO 1-3 alone)");
  }
  if (mix.recompute == "selective") {
    throw UsageError("--mix", fmt::format("'{}' asks selective recomputation", text),
                     "use none or full: the pipeline recomputes whole stages (lesson 09)");
  }
  l08::validate_tp(o.model, static_cast<int>(mix.tp));
  if (mix.cp > 1) {  // lesson 10's rules, on the heads one tp rank holds
    l10::validate_cp(o.model.ctx, o.model.heads / mix.tp, static_cast<int>(mix.cp), o.attention,
                     o.zigzag);
  }
  const int pp = static_cast<int>(mix.pp);
  const int v = static_cast<int>(mix.virtual_stages);
  const int64_t m = micro_batches(o);
  if (v > 1 && o.schedule != l09::ScheduleKind::kInterleaved &&
      o.schedule != l09::ScheduleKind::k1f1b) {
    throw UsageError(
        "--schedule",
        fmt::format("{} virtual stages with the {} schedule", v, l09::schedule_name(o.schedule)),
        "leave --schedule out (v > 1 runs interleaved 1F1B), or use VIRTUAL 1");
  }
  if (v == 1 && o.schedule == l09::ScheduleKind::kInterleaved) {
    throw UsageError("--schedule", "the interleaved schedule with one chunk per stage",
                     "pass --virtual-stages 2 (or VIRTUAL 2 in the mix)");
  }
  if (v > 1) l09::check_interleaved(o.model, pp, v, m);
  l09::check_pipeline(o.model, pp * v, o.batch / mix.dp, m);
  if (o.schedule == l09::ScheduleKind::kZbH1 && mix.recompute != "none") {
    throw UsageError("--schedule", "zb-h1 with recomputation",
                     "use RECOMPUTE none: W needs the graph that I kept");
  }
  if (!(o.clip >= 0) || std::isinf(o.clip)) {
    throw UsageError("--clip", fmt::format("max norm {}", o.clip),
                     "pass a positive norm (1.0 is Megatron's and torchtitan's default), or 0 "
                     "for no clipping");
  }
  if (o.norm_type != 2 && !(std::isinf(o.norm_type) && o.norm_type > 0)) {
    throw UsageError("--norm-type", fmt::format("{}", o.norm_type), "pass 2 or inf");
  }
}

int64_t micro_batches(const NdOptions& o) { return o.batch / (o.mix.dp * o.mix.micro_batch); }

RankModel build_rank_model(const NdOptions& o, const NdGroups& groups) {
  GptConfig untied = o.model;
  untied.tied = false;
  Gpt full = make_gpt(untied, o.seed, o.device);  // every rank builds it all, then keeps its part
  if (o.model.tied) {
    torch::NoGradGuard no_grad;
    full->lm_head->weight.copy_(full->wte->weight);  // the head's copy of the tied embedding
  }
  RankModel model;
  model.tied = o.model.tied;
  model.tp = groups.tp->getSize();
  model.tp_rank = groups.tp->getRank();
  if (model.tp > 1) {
    for (size_t i = 0; i < full->h->size(); ++i) {
      auto& block = *full->h->ptr<BlockImpl>(i);
      block.swap_attention(l08::TpAttention(block.attn, o.model.heads, *groups.tp));
      block.swap_mlp(l08::TpMlp(block.mlp, *groups.tp));
    }
  }
  Comm& cp = *groups.cp;
  if (cp.getSize() > 1 && model.tp == 1) {
    // Lesson 10's attention core over the cp group (CpGpt's): q, k, v of this rank's tokens.
    full->set_attention_core(
        [kind = o.attention, comm = &cp, zigzag = o.zigzag](
            const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
          const int64_t B = q.size(0), H = q.size(1), tl = q.size(2), D = q.size(3);
          return l10::context_attention(kind, q, k, v, *comm, zigzag)
              .transpose(1, 2)
              .contiguous()
              .view({B, tl, H * D});
        });
  } else if (cp.getSize() > 1) {
    // Lesson 10's TpCpGpt parts: the same TP modules, the core over the tp rank's heads.
    const l10::TpCpParts parts{groups.tp.get(), &cp, o.attention, o.zigzag,
                               /*sequence_parallel=*/false};
    for (size_t i = 0; i < full->h->size(); ++i) {
      auto& block = *full->h->ptr<BlockImpl>(i);
      block.swap_attention(l10::TpCpAttention(block.part<l08::TpAttentionImpl>("attn"), parts));
      block.swap_mlp(l10::TpCpMlp(block.part<l08::TpMlpImpl>("mlp"), parts));
    }
  }
  model.chunks = l09::make_chunks(full, groups.pp->getSize(),
                                  static_cast<int>(o.mix.virtual_stages), groups.pp->getRank());
  for (auto& chunk : model.chunks) {
    if (chunk.layers.embed && cp.getSize() > 1) {
      chunk.positions =
          l10::local_positions(o.model.ctx, cp.getRank(), cp.getSize(), o.zigzag).to(o.device);
    }
  }
  return model;
}

StepOut nd_step(RankModel& model, const NdGroups& groups, const NdOptions& o, int64_t step) {
  const Mesh& mesh = groups.mesh;
  const int dp = mesh.size("dp_replicate");
  const int64_t rows = o.batch / dp;
  const int64_t first_row = mesh.coord(groups.rank, "dp_replicate") * rows;
  const int64_t m = micro_batches(o);
  Batch batch = ByteDataset::builtin().batch(o.seed, step, o.batch, o.model.ctx).to(o.device);
  batch.inputs = batch.inputs.narrow(0, first_row, rows);
  batch.targets = batch.targets.narrow(0, first_row, rows);
  const int cp = groups.cp->getSize();
  if (cp > 1) {  // this cp rank's tokens of each row (lesson 10)
    batch.inputs = l10::shard_sequence(batch.inputs, groups.cp->getRank(), cp, o.zigzag);
    batch.targets = l10::shard_sequence(batch.targets, groups.cp->getRank(), cp, o.zigzag);
  }
  for (auto p : l09::parameters_of(model.chunks)) p.mutable_grad().reset();

  const Reduction reduction = gradient_reduction(mesh);
  const auto ops = l09::make_schedule(o.schedule, groups.pp->getSize(), m, groups.pp->getRank(),
                                      static_cast<int>(o.mix.virtual_stages));
  // Each chunk's reduction starts when its last backward pass is done (lesson 09), with the
  // divisor gradient_reduction() chose.
  l09::ReplicaAverage reduce(model.chunks, groups.reduce.get(), m,
                             static_cast<double>(reduction.divisor));
  const l09::StepStats stats =
      l09::run_schedule(model.chunks, *groups.pp, ops, batch, m,
                        /*deallocate_outputs=*/false, o.mix.recompute == "full");
  reduce.finish();
  sync_tied_embedding(model, groups.embedding.get());
  StepOut out;
  if (o.clip > 0) out.grad_norm = clip_grad_norm(model, *groups.norm, o.clip, o.norm_type);

  // The loss: the head's pipeline mean over its tokens (every tp rank of it holds the same),
  // summed over the stages (only the last one writes), then the mean over the replicas and the
  // cp ranks (each saw as many tokens).
  auto loss = torch::full({1}, model.chunks.back().layers.head ? stats.loss : 0.0f,
                          torch::dtype(torch::kFloat).device(o.device));
  std::vector<at::Tensor> v{loss};
  groups.pp->allreduce(v)->wait();
  groups.dp->allreduce(v)->wait();
  groups.cp->allreduce(v)->wait();
  out.loss = loss.cpu().item<float>() / static_cast<float>(dp * cp);
  return out;
}

std::map<std::string, WireBytes> predict_wire_bytes(const NdOptions& o, const RankModel& model) {
  const auto ring = [](int64_t n) {  // an allreduce's factor: 2(n-1)/n
    return n > 1 ? 2.0 * static_cast<double>(n - 1) / static_cast<double>(n) : 0.0;
  };
  // The degrees of the mix, not of the groups the learner's dims chose: a reduction over the
  // wrong ranks then differs from its closed form.
  const int64_t tp = o.mix.tp, cp = o.mix.cp, pp = o.mix.pp, dp = o.mix.dp;
  const double m = static_cast<double>(micro_batches(o));
  const double b = static_cast<double>(o.mix.micro_batch);
  const double tokens = static_cast<double>(o.model.ctx / cp);
  const double h = static_cast<double>(o.model.hidden);
  const auto params = l09::parameters_of(model.chunks);
  const double e = params.empty() ? 4.0 : static_cast<double>(params.front().element_size());
  // blocks: those this rank holds; rewalked: those whose backward runs twice, as ZB-H1 splits
  // the backward of a stage past the first into I and W and W walks the graph again (lesson 09),
  // the tp and cp backward collectives included
  double blocks = 0, rewalked = 0, sends = 0, held = 0;
  for (const auto& chunk : model.chunks) {
    blocks += static_cast<double>(chunk.layers.count());
    if (o.schedule == l09::ScheduleKind::kZbH1 && !chunk.layers.embed) {
      rewalked += static_cast<double>(chunk.layers.count());
    }
    sends += (chunk.layers.head ? 0 : 1) + (chunk.layers.embed ? 0 : 1);
  }
  for (const auto& p : params) held += static_cast<double>(p.numel());
  const bool full = o.mix.recompute == "full";
  const double loss = 4;  // the step's loss, one fp32 number
  std::map<std::string, WireBytes> w;
  w["tp"].predicted = m * (blocks * (full ? 6 : 4) + rewalked * 2) * ring(tp) * b * tokens * h * e;
  w["tp"].formula = fmt::format("m (L_r {}{}) x 2(tp-1)/tp b (s/cp) h e", full ? 6 : 4,
                                rewalked > 0 ? " + 2 x the blocks W walks again" : "");
  w["pp"].predicted = pp > 1 ? m * sends * b * tokens * h * 4 + ring(pp) * loss : 0.0;
  w["pp"].formula = "m (sends out of the rank's chunks) b (s/cp) h 4 + the loss";
  double cp_bytes = 0;
  if (cp > 1) {
    const l10::AttentionVolume v = l10::attention_volume(
        o.attention, o.mix.micro_batch, o.model.ctx, o.model.hidden / tp, static_cast<int>(cp));
    const double backward = v.backward * e + v.backward_fp32 * 4;
    cp_bytes = m * (blocks * ((full ? 2 : 1) * v.forward * e + backward) + rewalked * backward) +
               ring(cp) * loss;
    w["cp"].formula = fmt::format("m L_r ({}forward {} + backward {}){} + the loss, h = h/tp",
                                  full ? "2 x " : "", v.forward_formula, v.backward_formula,
                                  rewalked > 0 ? " + the backward W walks again" : "");
  }
  w["cp"].predicted = cp_bytes;
  w["dp"].predicted = ring(dp * cp) * held * e + ring(dp) * loss;
  w["dp"].formula = "2(n-1)/n (the rank's parameters) e, n = dp x cp, + the loss";
  const bool ends = std::any_of(model.chunks.begin(), model.chunks.end(), [](const auto& c) {
    return c.layers.embed || c.layers.head;  // the first or the last stage of the pipeline
  });
  w["embedding"].predicted =
      model.tied && pp > 1 && ends ? ring(2) * static_cast<double>(o.model.vocab) * h * e : 0.0;
  w["embedding"].formula = "2(2-1)/2 V h e on the first and the last stage";
  w["norm"].predicted = o.clip > 0 ? ring(pp * tp) * 8 : 0.0;
  w["norm"].formula = "2(n-1)/n x 8: one allreduce of the norm (a double) over the pp x tp ranks";
  return w;
}

NdResult train_nd(const NdOptions& o, const NdGroups& groups, StepLog* log) {
  RankModel model = build_rank_model(o, groups);
  const auto params = l09::parameters_of(model.chunks);
  // AdamW per rank over its own parameters (shards, stages, the tied copy): elementwise, so the
  // ranks' optimizers together are the single device's one.
  TracedAdamW optimizer(params, adamw_options(o));
  // On NCCL a group of sends and receives runs on the communicator of the whole group, which
  // its first collective creates (lesson 09).
  std::vector<at::Tensor> one{torch::ones({1}, torch::dtype(torch::kFloat).device(o.device))};
  groups.pp->allreduce(one)->wait();
  NdResult result;
  result.wire_bytes = predict_wire_bytes(o, model);
  for (auto& [traffic, recorder] : groups.recorders) recorder->clear();
  for (int64_t step = 0; step < o.steps; ++step) {
    if (log) log->begin_step();
    const StepOut out = nd_step(model, groups, o, step);
    optimizer.step();
    for (auto& [traffic, recorder] : groups.recorders) {  // the step's, then forget them
      result.wire_bytes[traffic].measured += recorder->wire_bytes() / static_cast<double>(o.steps);
      recorder->clear();
    }
    result.losses.push_back(out.loss);
    if (o.clip > 0) result.grad_norms.push_back(out.grad_norm);
    if (log) log->end_step(step, out.loss);
  }
  // This rank's parameters under the full model's names, the tied head's copy left out.
  // The digest: dp replica 0 and cp rank 0 only (the others hold the same parameters).
  const bool first_replica = groups.mesh.coord(groups.rank, "dp_replicate") == 0 &&
                             groups.mesh.coord(groups.rank, "cp") == 0;
  std::vector<NamedPiece> pieces;
  for (const auto& chunk : model.chunks) {
    for (const auto& [name, value] : l09::stage_pieces(chunk)) {
      if (model.tied && name == "lm_head.weight") continue;
      result.weights.emplace_back(name, value.detach().clone());
      // The digest: a tp slice from every tp rank, a whole parameter from tp rank 0.
      const bool slice = model.tp > 1 && tp_sharded(name);
      if (first_replica && (slice || model.tp_rank == 0)) pieces.emplace_back(name, value);
    }
  }
  if (o.digest) {
    std::vector<std::string> names;
    for (const auto& item : Gpt(o.model)->named_parameters()) names.push_back(item.key());
    result.digest = param_digest(
        names, pieces,
        std::vector<Comm*>{groups.tp.get(), groups.cp.get(), groups.dp.get(), groups.pp.get()});
  }
  return result;
}

}  // namespace dtc::l11

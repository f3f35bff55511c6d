// Lesson 11 (given): the mesh of a mix, this rank's groups and model (lesson 08's tensor-parallel
// blocks, lesson 10's context-parallel attention, in lesson 09's stages), and the step that runs
// them with your reduction, tied embedding and clipping. Your part is in nd.cpp; both implement
// nd.h.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "context_parallel_given.h"
#include "dtc/compat.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/storage.h"
#include "nd.h"
#include "sequence_parallel_given.h"
#include "tensor_parallel.h"

namespace dtc::l11 {

bool tp_sharded(const std::string& name) {
  auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  return has(".attn.c_attn.") || has(".mlp.c_fc.") ||
         (has(".c_proj.") && has(".weight") && (has(".attn.") || has(".mlp.")));
}

namespace {
// The data-parallel dimensions: dp_replicate, or dp_shard under ZeRO (the other of size 1).
const std::vector<std::string> kDp{"dp_replicate", "dp_shard"};

// The forwards a rank's schedule @p ops runs before its first backward, per chunk (of @p chunks).
std::vector<int64_t> warm_up_forwards(const std::vector<l09::Op>& ops, size_t chunks) {
  std::vector<int64_t> forwards(chunks, 0);
  for (const l09::Op& op : ops) {
    if (op.kind != l09::Op::kForward) break;
    ++forwards[static_cast<size_t>(op.chunk)];
  }
  return forwards;
}
}  // namespace

Mesh make_mesh(const MixSpec& mix, int world) {
  // Under ZeRO the dp ranks each keep a shard (torchtitan's dp_shard); under HSDP N, groups of N
  // shard and dp / N of them replicate.
  int replicate = static_cast<int>(mix.dp), shard = 1;
  if (mix.shard > 0) {
    shard = static_cast<int>(mix.shard);
    replicate = static_cast<int>(mix.dp / mix.shard);
  } else if (mix.zero_stage > 0) {
    std::swap(replicate, shard);
  }
  return Mesh::build(world, {{"pp", static_cast<int>(mix.pp), "--mix"},
                             {"dp_replicate", replicate, "--mix"},
                             {"dp_shard", shard, "--mix"},
                             {"cp", static_cast<int>(mix.cp), "--mix"},
                             {"tp", static_cast<int>(mix.tp), "--mix"}});
}

NdGroups make_groups(const c10::intrusive_ptr<c10d::Store>& store, const Mesh& mesh, int rank,
                     int zero_stage, BackendKind backend, std::chrono::milliseconds timeout,
                     const std::string& master_addr, const std::shared_ptr<Tracer>& tracer) {
  const Reduction reduction = gradient_reduction(mesh);
  const std::vector<std::string> norm = norm_dims(mesh, zero_stage);
  // Under ZeRO the reduction's dims split into those that shard (a reduce-scatter over them) and
  // dp_replicate (HSDP's allreduce of the shards); without, one allreduce over them all.
  std::vector<std::string> scatter, replicate;
  for (const auto& dim : reduction.dims) {
    (zero_stage > 0 && dim == "dp_replicate" ? replicate : scatter).push_back(dim);
  }
  // One communicator per distinct set (the learner's two may be the same set, or pp's or tp's).
  std::vector<std::vector<std::string>> sets{{"pp"}, {"tp"}, kDp, {"cp"}};
  for (const auto& set : {scatter, replicate, norm}) {
    const std::string key = Mesh::key(set);
    bool seen = false;
    for (const auto& s : sets) seen = seen || Mesh::key(s) == key;
    if (!seen) sets.push_back(set);
  }
  const MeshGroups groups(store, mesh, rank, sets, backend, timeout, master_addr);
  NdGroups g;
  g.mesh = mesh;
  g.rank = rank;
  g.zero_stage = zero_stage;
  // Each communicator through a recorder of its own (two of them may wrap one communicator).
  // With a tracer, each also through a TracingComm that knows the group's global ranks.
  const auto record = [&g, &tracer](const char* traffic, c10::intrusive_ptr<Comm> comm,
                                    std::vector<int> ranks) {
    if (tracer) {
      comm = c10::make_intrusive<TracingComm>(std::move(comm), tracer, traffic, std::move(ranks));
    }
    auto recorder = c10::make_intrusive<RecordingComm>(std::move(comm));
    g.recorders.emplace_back(traffic, recorder);
    return c10::intrusive_ptr<Comm>(recorder);
  };
  g.pp = record("pp", groups.get({"pp"}), mesh.group(rank, {"pp"}));
  g.tp = record("tp", groups.get({"tp"}), mesh.group(rank, {"tp"}));
  g.dp = record("dp", groups.get(kDp), mesh.group(rank, kDp));
  g.cp = record("cp", groups.get({"cp"}), mesh.group(rank, {"cp"}));
  g.reduce = record("dp", groups.get(scatter), mesh.group(rank, scatter));
  g.replicate = record("dp", groups.get(replicate), mesh.group(rank, replicate));
  g.norm = record("norm", groups.get(norm), mesh.group(rank, norm));
  // The embedding groups: for every (dp, cp, tp) coordinate, its pipeline's first and last
  // stage, created by every rank in the same order (a rank outside one gets null).
  const int pp = mesh.size("pp");
  if (pp > 1) {
    for (int first = 0; first < mesh.world(); ++first) {
      if (mesh.coord(first, "pp") != 0) continue;
      const int last = first + (pp - 1) * (mesh.world() / pp);  // pp is the slowest dimension
      auto comm = new_subgroup(store, fmt::format("embedding/{}-{}", first, last), {first, last},
                               rank, backend, timeout, master_addr);
      if (comm) g.embedding = record("embedding", comm, {first, last});
    }
  }
  return g;
}

void check_nd(const NdOptions& o, int world) {
  const MixSpec& mix = o.mix;
  check_precision(o.precision, /*bf16_collectives=*/true);  // tp's, dp's and cp's in bf16
  check_mix(mix, MixShape{o.model.layers, o.model.heads, o.model.ctx, world, o.batch}, "--mix");
  const std::string text = mix.text();
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
  if (o.sequence_parallel) {
    if (mix.tp == 1) {
      throw UsageError("--sequence-parallel", fmt::format("'{}' has tp 1", text),
                       "sequence parallelism splits the sequence over the tp ranks: use TP 2 or "
                       "more, or leave --sequence-parallel out");
    }
    if (o.schedule == l09::ScheduleKind::kZbH1) {
      throw UsageError("--sequence-parallel", "sequence parallelism with zb-h1",
                       "use --schedule 1f1b (or interleaved): this lesson does not compose "
                       "ZB-H1's split backward with sequence parallelism");
    }
    l10::validate_sequence_parallel(o.model.ctx, static_cast<int>(mix.cp),
                                    static_cast<int>(mix.tp));
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

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The (B, T, ...) tensor gathered along the sequence from every tp rank's (B, T/tp, ...) rows,
// in rank order.
torch::Tensor all_gather_rows(const torch::Tensor& rows, Comm& tp) {
  const int n = tp.getSize();
  std::vector<std::vector<torch::Tensor>> outputs(1);
  for (int j = 0; j < n; ++j) outputs[0].push_back(torch::empty_like(rows));
  std::vector<torch::Tensor> inputs{rows.contiguous()};
  tp.allgather(outputs, inputs)->wait();
  return torch::cat(outputs[0], 1);
}

// This tp rank's rows of a (B, T, ...) tensor that every tp rank holds whole.
torch::Tensor own_rows(const torch::Tensor& x, Comm& tp) {
  const int64_t k = x.size(1) / tp.getSize();
  return x.narrow(1, tp.getRank() * k, k).contiguous();
}

// Into a chunk's blocks: this rank's rows; backward, the rows' gradients of every rank gathered,
// so that what came before (the embeddings, the previous stage) gets the whole gradient
// (Megatron's scatter_to_sequence_parallel_region).
struct SplitSequence : public torch::autograd::Function<SplitSequence> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return own_rows(x, comm_from(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_rows(grads[0], comm_of(ctx)), torch::Tensor()};
  }
};

// Out of them: every rank's rows gathered; backward, this rank's rows of the gradient, which
// every tp rank computes whole and the same after it (Megatron's
// gather_from_sequence_parallel_region with tensor_parallel_output_grad=False).
struct GatherSequence : public torch::autograd::Function<GatherSequence> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return all_gather_rows(x, comm_from(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {own_rows(grads[0], comm_of(ctx)), torch::Tensor()};
  }
};

}  // namespace

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
  } else if (cp.getSize() > 1 || o.sequence_parallel) {
    // Lesson 10's TpCpGpt parts: the same TP modules, the core over the tp rank's heads, and
    // with sequence parallelism its operators at the edges of each TP region.
    const l10::TpCpParts parts{groups.tp.get(), &cp, o.attention, o.zigzag, o.sequence_parallel};
    for (size_t i = 0; i < full->h->size(); ++i) {
      auto& block = *full->h->ptr<BlockImpl>(i);
      block.swap_attention(l10::TpCpAttention(block.part<l08::TpAttentionImpl>("attn"), parts));
      block.swap_mlp(l10::TpCpMlp(block.part<l08::TpMlpImpl>("mlp"), parts));
    }
  }
  model.chunks = l09::make_chunks(full, groups.pp->getSize(),
                                  static_cast<int>(o.mix.virtual_stages), groups.pp->getRank());
  model.sequence_parallel = o.sequence_parallel && model.tp > 1;
  if (model.sequence_parallel) {  // each chunk's blocks on this tp rank's rows of the sequence
    const int64_t comm = comm_handle(*groups.tp);
    for (auto& chunk : model.chunks) {
      chunk.enter_blocks = [comm](const torch::Tensor& x) { return SplitSequence::apply(x, comm); };
      chunk.leave_blocks = [comm](const torch::Tensor& x) {
        return GatherSequence::apply(x, comm);
      };
    }
  }
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
  const int dp = mesh.size(kDp);
  const int64_t rows = o.batch / dp;
  const int64_t first_row = mesh.coord(groups.rank, kDp) * rows;
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
  // divisor gradient_reduction() chose: an allreduce, or ZeRO-1's reduce-scatter.
  const auto divisor = static_cast<double>(reduction.divisor);
  std::optional<l09::ReplicaAverage> average;
  std::optional<ShardedReduce> scatter;
  if (groups.zero_stage > 0) {
    scatter.emplace(model.chunks, groups.reduce.get(), groups.replicate.get(), m, divisor);
  } else {
    average.emplace(model.chunks, groups.reduce.get(), m, divisor);
  }
  // What the forwards in flight hold (predict_activation_bytes): the storage this thread
  // allocated from here on and still holds (a mark: buffers of earlier collectives that a gloo
  // thread frees meanwhile do not count), read at the end of the last forward before the rank's
  // first backward (the given Stage::forward calls after_forward).
  int64_t held = -1;
  const std::vector<int64_t> per_chunk = warm_up_forwards(ops, model.chunks.size());
  const int64_t warm_up = std::accumulate(per_chunk.begin(), per_chunk.end(), int64_t{0});
  if (counting_allocator_installed() && o.mix.recompute != "full" && warm_up > 0) {
    mark_thread_cpu_memory();
    auto forwards = std::make_shared<int64_t>(0);
    for (auto& chunk : model.chunks) {
      chunk.after_forward = [&held, forwards, warm_up] {
        if (++*forwards == warm_up) held = thread_cpu_memory_since_mark();
      };
    }
  }
  const l09::StepStats stats =
      l09::run_schedule(model.chunks, *groups.pp, ops, batch, m,
                        /*deallocate_outputs=*/false, o.mix.recompute == "full");
  for (auto& chunk : model.chunks) chunk.after_forward = nullptr;
  if (scatter) scatter->finish();
  if (average) average->finish();
  if (model.sequence_parallel) sync_sequence_parallel(model, *groups.tp);
  sync_tied_embedding(model, groups.embedding.get());
  StepOut out;
  out.activation_bytes = held;
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

int64_t predict_activation_bytes(const NdOptions& o, int pp_rank) {
  if (o.precision != Precision::kFp32 || o.mix.recompute == "full" || o.sequence_parallel) {
    return -1;
  }
  const int p = static_cast<int>(o.mix.pp);
  const int v = static_cast<int>(o.mix.virtual_stages);
  const int64_t m = micro_batches(o);
  const int64_t b = o.mix.micro_batch, s = o.model.ctx, h = o.model.hidden;
  const int64_t n = b * s / o.mix.cp;  // this rank's tokens in a micro-batch
  const int cp = static_cast<int>(o.mix.cp), tp = static_cast<int>(o.mix.tp);
  // Without cp the attention is lesson 08's, whose saved tensors are Ulysses' on one cp rank.
  const l10::Attention kind = cp > 1 ? o.attention : l10::Attention::kUlysses;
  const int64_t layer =
      l10::predict_layer_activation_bytes(kind, b, s, h, o.model.heads, cp, 4, tp, false);
  const std::vector<int64_t> in_flight =
      warm_up_forwards(l09::make_schedule(o.schedule, p, m, pp_rank, v), static_cast<size_t>(v));
  int64_t bytes = 0;
  for (int c = 0; c < v; ++c) {
    const int stage = c * p + pp_rank;  // the chunk's virtual stage
    const l09::StageLayers layers = l09::stage_layers(o.model.layers, p * v, stage);
    int64_t one = layers.count() * layer;
    one += layers.head ? 2 * 4 * n * h + 2 * 4 * n + 4 * n * o.model.vocab : 4 * n * h;
    // The first chunk's positions 0 .. T-1 (int64), which wpe's backward keeps; with cp the
    // stage holds them once (Stage::positions).
    if (layers.embed && cp == 1) one += 8 * s;
    bytes += in_flight[static_cast<size_t>(c)] * one;
  }
  return bytes;
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
  if (model.sequence_parallel) {
    // Sequence parallelism: a block's forward all-gathers its rows twice (into attention and the
    // MLP) and reduce-scatters twice (out of them); its backward reduce-scatters the two inputs'
    // gradients, all-gathers the two outputs' and all-gathers the inputs again (gather_linear
    // keeps only the rows): 10 of (tp-1)/tp, 4 more with full recomputation's second forward.
    // Each chunk gathers its output (again when recomputed) and, backward, its input's gradient.
    // Then the blocks' LayerNorms and row-parallel biases' gradients, summed over tp.
    const double chunks = static_cast<double>(model.chunks.size());
    double rows_params = 0;
    for (const auto& chunk : model.chunks) {
      for (const auto& [name, p] : l09::stage_pieces(chunk)) {
        if (name.rfind("h.", 0) == 0 && !tp_sharded(name)) {
          rows_params += static_cast<double>(p.numel());
        }
      }
    }
    w["tp"].predicted = m * (blocks * (full ? 14 : 10) + chunks * (full ? 3 : 2)) * ring(tp) / 2 *
                            b * tokens * h * e +
                        ring(tp) * rows_params * e;
    w["tp"].formula = fmt::format(
        "m (L_r {} + chunks {}) x (tp-1)/tp b (s/cp) h e: sequence parallelism's all-gathers "
        "and reduce-scatters, + 2(tp-1)/tp (the blocks' LayerNorms and row-parallel biases) e",
        full ? 14 : 10, full ? 3 : 2);
  } else {
    w["tp"].predicted =
        m * (blocks * (full ? 6 : 4) + rewalked * 2) * ring(tp) * b * tokens * h * e;
    w["tp"].formula = fmt::format("m (L_r {}{}) x 2(tp-1)/tp b (s/cp) h e", full ? 6 : 4,
                                  rewalked > 0 ? " + 2 x the blocks W walks again" : "");
  }
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
  if (o.mix.zero_stage > 0) {
    // ZeRO: a reduce-scatter of the gradients (fp32) and an all-gather of the shards (e), each
    // (n-1)/n of the parameters padded to multiples of n; HSDP: an allreduce of the fp32 shards
    // over the dp / N replicas
    const int64_t shard = o.mix.shard > 0 ? o.mix.shard : dp;
    const int64_t n = shard * cp, replicas = dp / shard;
    double padded = 0;
    for (const auto& p : params)
      padded += static_cast<double>(shard_range(p.numel(), static_cast<int>(n), 0).chunk * n);
    w["dp"].predicted = ring(n) / 2 * padded * (4 + e) +
                        ring(replicas) * padded / static_cast<double>(n) * 4 + ring(dp) * loss;
    w["dp"].formula = o.mix.shard > 0
                          ? "(n-1)/n (the rank's parameters, padded to multiples of n) (4 + e), n "
                            "= N x cp, + 2(r-1)/r of its fp32 shards, r = dp / N, + the loss"
                          : "(n-1)/n (the rank's parameters, padded to multiples of n) (4 + e), n "
                            "= dp x cp, + the loss";
  } else {
    // lesson 09's ReplicaAverage: one flat fp32 buffer per chunk, whatever the model's dtype
    w["dp"].predicted = ring(dp * cp) * held * 4 + ring(dp) * loss;
    w["dp"].formula = "2(n-1)/n (the rank's parameters) 4 (fp32), n = dp x cp, + the loss";
  }
  const bool ends = std::any_of(model.chunks.begin(), model.chunks.end(), [](const auto& c) {
    return c.layers.embed || c.layers.head;  // the first or the last stage of the pipeline
  });
  w["embedding"].predicted =
      model.tied && pp > 1 && ends ? ring(2) * static_cast<double>(o.model.vocab) * h * e : 0.0;
  w["embedding"].formula = "2(2-1)/2 V h e on the first and the last stage";
  const int64_t replicas = o.mix.shard > 0 ? dp / o.mix.shard : 1;
  const int64_t norm_ranks = o.mix.zero_stage > 0 ? o.mix.world() / replicas : pp * tp;
  w["norm"].predicted = o.clip > 0 ? ring(norm_ranks) * 8 : 0.0;
  w["norm"].formula =
      fmt::format("2(n-1)/n x 8: one allreduce of the norm (a double) over {}",
                  o.mix.shard > 0 ? "one HSDP group's pp x N x tp ranks (each holds other shards)"
                  : o.mix.zero_stage > 0 ? "every rank (ZeRO: each holds other shards)"
                                         : "the pp x tp ranks");
  return w;
}

ShardRange shard_range(int64_t numel, int n, int r) {
  ShardRange s;
  s.chunk = (numel + n - 1) / n;
  s.begin = std::min<int64_t>(static_cast<int64_t>(r) * s.chunk, numel);
  s.size = std::min(s.chunk, numel - s.begin);
  return s;
}

ShardedReduce::ShardedReduce(std::vector<l09::Stage>& chunks, Comm* group, Comm* replicate,
                             int64_t micro_batches, double divisor)
    : chunks_(chunks),
      group_(group),
      replicate_(replicate != nullptr && replicate->getSize() > 1 ? replicate : nullptr),
      divisor_(divisor),
      received_(chunks.size()),
      works_(chunks.size()) {
  for (size_t c = 0; c < chunks.size(); ++c) {
    std::function<void()> start;
    if (group_ != nullptr && group_->getSize() > 1) start = [this, c] { this->start(c); };
    chunks[c].begin_step(micro_batches, std::move(start));
  }
}

ShardedReduce::~ShardedReduce() {
  for (auto& c : chunks_) {
    std::lock_guard<std::mutex> lock(c.watch->mu);
    c.watch->on_weights_done = nullptr;
  }
}

void ShardedReduce::start(size_t c) {
  const int n = group_->getSize();
  const auto params = chunks_[c].parameters();
  int64_t total = 0;
  for (const auto& p : params) total += shard_range(p.numel(), n, 0).chunk;
  // Row j: chunk j of every parameter, what rank j of the group owns (fp32 on the wire).
  const auto device = params.empty() ? torch::Device(torch::kCPU) : params.front().device();
  auto send = torch::zeros({n, total}, torch::dtype(torch::kFloat).device(device));
  int64_t offset = 0;
  for (const auto& p : params) {
    const int64_t k = shard_range(p.numel(), n, 0).chunk;
    if (p.grad().defined()) {
      auto padded = torch::zeros({n * k}, send.options());
      padded.narrow(0, 0, p.numel()).copy_(p.grad().reshape(-1));
      send.narrow(1, offset, k).copy_(padded.view({n, k}));
    }
    offset += k;
  }
  // Lesson 07's reduce-scatter: row j to rank j, then this rank adds up the n rows it received.
  received_[c] = torch::empty_like(send);
  at::Tensor out = received_[c].view({-1});
  at::Tensor in = send.view({-1});
  std::vector<int64_t> equal;  // empty: n equal splits
  works_[c] = group_->alltoall_base(out, in, equal, equal);
}

void ShardedReduce::finish() {
  torch::NoGradGuard no_grad;
  // HSDP: the replicas' groups hold the same shards of other tokens' gradients: their sum.
  const auto across_replicas = [this](torch::Tensor t) {
    if (replicate_ == nullptr) return;
    std::vector<at::Tensor> v{t};
    replicate_->allreduce(v)->wait();
  };
  if (group_ == nullptr || group_->getSize() == 1) {  // a group of one: every shard is whole
    for (auto& chunk : chunks_) {
      for (auto& p : chunk.parameters()) {
        if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
        if (replicate_ != nullptr) {  // in fp32 on the wire, as the reduce-scatter's
          auto sum = p.grad().to(torch::kFloat);
          across_replicas(sum);
          p.mutable_grad().copy_(sum);
        }
        p.mutable_grad().div_(divisor_);
      }
    }
    return;
  }
  const int n = group_->getSize();
  const int r = group_->getRank();
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (!works_[c]) {
      throw std::runtime_error(fmt::format(
          "chunk {}: the weight gradients of the step's micro-batches were never all computed, "
          "so its gradients could not be reduce-scattered (does run_schedule run every "
          "backward?)",
          c));
    }
    works_[c]->wait();
    torch::Tensor mine = received_[c].sum(0);  // this rank's shards, summed over the group
    received_[c] = torch::Tensor();
    across_replicas(mine);
    mine.div_(divisor_);
    int64_t offset = 0;
    for (auto& p : chunks_[c].parameters()) {
      const ShardRange s = shard_range(p.numel(), n, r);
      auto grad = torch::zeros_like(p);
      if (s.size > 0) {
        grad.view({-1}).narrow(0, s.begin, s.size).copy_(mine.narrow(0, offset, s.size));
      }
      p.mutable_grad() = grad;
      offset += s.chunk;
    }
  }
}

ShardedAdamW::ShardedAdamW(std::vector<torch::Tensor> params, Comm* group,
                           const torch::optim::AdamWOptions& options, int stage)
    : params_(std::move(params)), group_(group), stage_(stage) {
  const int n = group_ != nullptr ? group_->getSize() : 1;
  const int r = group_ != nullptr ? group_->getRank() : 0;
  std::vector<torch::Tensor> owned;
  for (const auto& p : params_) {
    const ShardRange s = shard_range(p.numel(), n, r);
    torch::Tensor shard;
    if (s.size > 0) {
      shard = p.detach().reshape({-1}).narrow(0, s.begin, s.size).to(torch::kFloat, false, true);
      owned.push_back(shard);
    }
    shards_.push_back(shard);
  }
  if (!owned.empty()) adamw_ = std::make_unique<torch::optim::AdamW>(owned, options);
}

void ShardedAdamW::step() {
  torch::NoGradGuard no_grad;
  const int n = group_ != nullptr ? group_->getSize() : 1;
  const int r = group_ != nullptr ? group_->getRank() : 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardRange s = shard_range(params_[i].numel(), n, r);
    if (!shards_[i].defined()) continue;
    const torch::Tensor& g = params_[i].grad();
    shards_[i].mutable_grad() =  // fp32, also from a bf16 gradient
        g.defined() ? g.reshape({-1}).narrow(0, s.begin, s.size).to(torch::kFloat, false, true)
                    : torch::Tensor();
  }
  if (adamw_) adamw_->step();
  if (stage_ >= 2) {  // the whole gradients: the next backward makes them again
    for (auto& p : params_) p.mutable_grad().reset();
  }
  if (stage_ >= 3) {
    release();  // until gather(), at the start of the next step
  } else {
    all_gather();
  }
}

void ShardedAdamW::gather() {
  if (!released_) return;
  all_gather();
  released_ = false;
}

void ShardedAdamW::release() {
  if (released_ || stage_ < 3) return;
  for (auto& p : params_) free_storage(p);
  released_ = true;
}

void ShardedAdamW::all_gather() {
  // Every rank's updated shards into every rank's parameters, in the parameters' dtype.
  std::vector<torch::Tensor> whole;
  all_gather_into(whole, params_.empty() ? torch::TensorOptions() : params_.front().options());
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (released_) {  // ZeRO-3: the freed storage gets the gathered bytes
      refill_storage(params_[i], whole[i]);
    } else {
      params_[i].copy_(whole[i]);
    }
  }
}

std::vector<torch::Tensor> ShardedAdamW::gather_masters() {
  std::vector<torch::Tensor> whole;
  const auto device = params_.empty() ? torch::Device(torch::kCPU) : params_.front().device();
  all_gather_into(whole, torch::dtype(torch::kFloat).device(device));
  return whole;
}

void ShardedAdamW::all_gather_into(std::vector<torch::Tensor>& into,
                                   const torch::TensorOptions& options) {
  torch::NoGradGuard no_grad;
  const int n = group_ != nullptr ? group_->getSize() : 1;
  const int r = group_ != nullptr ? group_->getRank() : 0;
  int64_t total = 0;
  for (const auto& p : params_) total += shard_range(p.numel(), n, r).chunk;
  // One all-gather of the padded shards.
  auto mine = torch::zeros({total}, options);
  int64_t offset = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardRange s = shard_range(params_[i].numel(), n, r);
    if (s.size > 0) mine.narrow(0, offset, s.size).copy_(shards_[i]);
    offset += s.chunk;
  }
  auto all = mine.view({1, total});
  if (n > 1) {
    all = torch::empty({n, total}, options);
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int j = 0; j < n; ++j) outputs[0].push_back(all[j]);
    std::vector<at::Tensor> inputs{mine};
    group_->allgather(outputs, inputs)->wait();
  }
  offset = 0;
  into.clear();
  for (const auto& p : params_) {
    const int64_t k = shard_range(p.numel(), n, 0).chunk;
    const auto whole = all.narrow(1, offset, k).reshape({-1}).narrow(0, 0, p.numel());
    into.push_back(whole.reshape(p.sizes()).clone(at::MemoryFormat::Contiguous));
    offset += k;
  }
}

int64_t ShardedAdamW::state_elements() {
  int64_t n = 0;
  if (!adamw_) return 0;
  for (const auto& shard : shards_) {
    if (!shard.defined()) continue;
    auto* state = static_cast<torch::optim::AdamWParamState*>(optimizer_state(*adamw_, shard));
    if (state != nullptr) n += state->exp_avg().numel() + state->exp_avg_sq().numel();
  }
  return n;
}

std::pair<int64_t, int64_t> ShardedAdamW::shard_bytes() const {
  std::pair<int64_t, int64_t> bytes{0, 0};
  for (const auto& shard : shards_) {
    if (!shard.defined()) continue;
    bytes.first += static_cast<int64_t>(shard.storage().nbytes());
    if (shard.grad().defined())
      bytes.second += static_cast<int64_t>(shard.grad().storage().nbytes());
  }
  return bytes;
}

void ShardedAdamW::params_from_shards() {
  if (!released_) all_gather();
}

namespace {

// The bytes of @p tensors' storage and of their gradients', each storage once, at what it holds
// now (freed: 0).
std::pair<int64_t, int64_t> held_bytes(const std::vector<torch::Tensor>& tensors) {
  std::set<const void*> seen;
  std::set<const void*> seen_grads;
  std::pair<int64_t, int64_t> bytes{0, 0};
  for (const auto& p : tensors) {
    if (seen.insert(p.storage().unsafeGetStorageImpl()).second) {
      bytes.first += static_cast<int64_t>(p.storage().nbytes());
    }
    const auto& g = p.grad();
    if (g.defined() && seen_grads.insert(g.storage().unsafeGetStorageImpl()).second) {
      bytes.second += static_cast<int64_t>(g.storage().nbytes());
    }
  }
  return bytes;
}

}  // namespace

struct NdTrainer::Impl {
  const NdOptions& o;
  const NdGroups& groups;
  std::optional<TracedAdamW> adamw;
  std::optional<MasterAdamW> master;
  std::optional<ShardedAdamW> sharded;
};

NdTrainer::NdTrainer(const NdOptions& o, const NdGroups& groups)
    : impl_(std::make_unique<Impl>(Impl{o, groups, {}, {}, {}})),
      model_(build_rank_model(o, groups)),
      params_(l09::parameters_of(model_.chunks)) {
  // AdamW per rank over its own parameters (shards, stages, the tied copy): elementwise, so the
  // ranks' optimizers together are the single device's one. ZeRO: over its shards of them, fp32
  // copies. bf16: the parameters cast, AdamW on fp32 master weights (MasterAdamW, or ZeRO's
  // fp32 shards: Megatron's distributed optimizer's main-parameter shards).
  const bool bf16 = o.precision != Precision::kFp32;
  if (groups.zero_stage > 0) {
    impl_->sharded.emplace(params_, groups.reduce.get(), adamw_options(o), groups.zero_stage);
    if (bf16) {
      torch::NoGradGuard no_grad;
      for (auto p : params_) p.set_data(p.detach().to(working_dtype(o.precision)));
    }
    impl_->sharded->release();  // ZeRO-3: each rank holds its shards only, from the start
  } else if (bf16) {
    impl_->master.emplace(params_, o.precision, adamw_options(o));  // casts the parameters
  } else {
    impl_->adamw.emplace(params_, adamw_options(o));
  }
  for (auto& chunk : model_.chunks) chunk.precision = o.precision;
  // On NCCL a group of sends and receives runs on the communicator of the whole group, which
  // its first collective creates (lesson 09).
  std::vector<at::Tensor> one{torch::ones({1}, torch::dtype(torch::kFloat).device(o.device))};
  groups.pp->allreduce(one)->wait();
}

NdTrainer::~NdTrainer() = default;

StepOut NdTrainer::step(int64_t step) {
  Impl& m = *impl_;
  if (m.sharded) m.sharded->gather();  // ZeRO-3: the step's whole parameters
  const StepOut out = nd_step(model_, m.groups, m.o, step);
  if (m.sharded) {
    m.sharded->step();
  } else if (m.master) {
    m.master->step();
  } else {
    m.adamw->step();
  }
  return out;
}

std::vector<OptimizerSlot> NdTrainer::slots() {
  Impl& m = *impl_;
  std::vector<OptimizerSlot> slots;
  const int n = m.groups.reduce ? m.groups.reduce->getSize() : 1;
  const int r = m.groups.reduce ? m.groups.reduce->getRank() : 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    OptimizerSlot slot{params_[i], params_[i], 0};
    if (m.sharded) {
      slot.stepped = m.sharded->shards()[i];
      slot.begin = shard_range(params_[i].numel(), n, r).begin;
    } else if (m.master) {
      slot.stepped = m.master->master()[i];
    }
    slots.push_back(slot);
  }
  return slots;
}

torch::optim::AdamW* NdTrainer::optimizer() {
  Impl& m = *impl_;
  if (m.sharded) return m.sharded->optimizer();
  if (m.master) return &m.master->optimizer();
  return &*m.adamw;
}

void NdTrainer::shards_written() {
  if (impl_->sharded) impl_->sharded->params_from_shards();
}

NdResult NdTrainer::finish() {
  Impl& m = *impl_;
  const NdOptions& o = m.o;
  const NdGroups& groups = m.groups;
  const auto& params = params_;
  const bool bf16 = o.precision != Precision::kFp32;
  NdResult result;
  // This rank's state at rest, after the last step: ZeRO-2 and 3 have released the whole
  // gradients, ZeRO-3 the whole parameters.
  const auto [param_bytes, grad_bytes] = held_bytes(params);
  result.memory.params = param_bytes;
  result.memory.grads = grad_bytes;
  if (m.sharded) {
    result.optimizer_elements = m.sharded->state_elements();
    const auto [copies, copy_grads] = m.sharded->shard_bytes();
    const int stage = groups.zero_stage;
    (stage >= 3 ? result.memory.params : result.memory.zero_copies) += copies;
    (stage >= 2 ? result.memory.grads : result.memory.zero_copies) += copy_grads;
    m.sharded->gather();  // ZeRO-3: the whole parameters, for the weights and the digest below
  } else if (m.master) {
    for (const auto& w : m.master->master()) {
      auto* state =
          static_cast<torch::optim::AdamWParamState*>(optimizer_state(m.master->optimizer(), w));
      if (state != nullptr) {
        result.optimizer_elements += state->exp_avg().numel() + state->exp_avg_sq().numel();
      }
      result.memory.masters += w.numel() * static_cast<int64_t>(w.element_size());
    }
  } else {
    for (const auto& p : params) {
      auto* state = static_cast<torch::optim::AdamWParamState*>(optimizer_state(*m.adamw, p));
      if (state != nullptr) {
        result.optimizer_elements += state->exp_avg().numel() + state->exp_avg_sq().numel();
      }
    }
  }
  result.memory.optimizer = result.optimizer_elements * 4;
  // This rank's parameters under the full model's names, the tied head's copy left out; in
  // bf16 their fp32 master weights (ZeRO's shards gathered, one more all-gather after the run).
  // The digest: dp replica 0 and cp rank 0 only (the others hold the same parameters).
  std::map<const void*, torch::Tensor> fp32_of;
  if (bf16) {
    const std::vector<torch::Tensor> fp32 =
        m.sharded ? m.sharded->gather_masters() : m.master->master();
    for (size_t i = 0; i < params.size(); ++i) fp32_of[params[i].unsafeGetTensorImpl()] = fp32[i];
  }
  const bool first_replica =
      groups.mesh.coord(groups.rank, kDp) == 0 && groups.mesh.coord(groups.rank, "cp") == 0;
  std::vector<NamedPiece> pieces;
  for (const auto& chunk : model_.chunks) {
    for (const auto& [name, param] : l09::stage_pieces(chunk)) {
      if (model_.tied && name == "lm_head.weight") continue;
      const auto found = fp32_of.find(param.unsafeGetTensorImpl());
      const torch::Tensor value = found == fp32_of.end() ? param : found->second;
      result.weights.emplace_back(name, value.detach().clone());
      // The digest: a tp slice from every tp rank, a whole parameter from tp rank 0.
      const bool slice = model_.tp > 1 && tp_sharded(name);
      if (first_replica && (slice || model_.tp_rank == 0)) pieces.emplace_back(name, value);
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

NdResult train_nd(const NdOptions& o, const NdGroups& groups, StepLog* log) {
  NdTrainer trainer(o, groups);
  std::vector<float> losses;
  std::vector<double> grad_norms;
  std::map<std::string, WireBytes> wire_bytes = predict_wire_bytes(o, trainer.model());
  int64_t activation_bytes = -1;
  int64_t peak_bytes = -1;
  for (auto& [traffic, recorder] : groups.recorders) recorder->clear();
  for (int64_t step = 0; step < o.steps; ++step) {
    if (log) log->begin_step();
    if (counting_allocator_installed()) reset_thread_cpu_peak();
    const StepOut out = trainer.step(step);
    for (auto& [traffic, recorder] : groups.recorders) {  // the step's, then forget them
      wire_bytes[traffic].measured += recorder->wire_bytes() / static_cast<double>(o.steps);
      recorder->clear();
    }
    if (counting_allocator_installed()) peak_bytes = thread_cpu_memory().peak;
    losses.push_back(out.loss);
    activation_bytes = out.activation_bytes;
    if (o.clip > 0) grad_norms.push_back(out.grad_norm);
    if (log) log->end_step(step, out.loss);
  }
  NdResult result = trainer.finish();
  result.losses = std::move(losses);
  result.grad_norms = std::move(grad_norms);
  result.wire_bytes = std::move(wire_bytes);
  result.activation_bytes = activation_bytes;
  result.peak_bytes = peak_bytes;
  return result;
}

}  // namespace dtc::l11

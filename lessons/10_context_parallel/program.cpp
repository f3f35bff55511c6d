// The lesson10 program: trains the course's GPT with each sequence split over a CP group of
// ranks (and the batch over dp replicas), attention through ring, Ulysses or all-gather KV, and
// prints what each attention puts on the wire per layer. Given in full; the attention is yours,
// in context_parallel.cpp.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <map>
#include <ostream>
#include <thread>

#include "dtc/cli.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/program.h"

namespace dtc::l10 {

// ---------------------------------------------------------------------------------------------
// The rank grid
// ---------------------------------------------------------------------------------------------

std::vector<int> Grid::cp_group(int rank) const {
  std::vector<int> ranks;
  for (int c = 0; c < cp; ++c) ranks.push_back(dp_rank(rank) * cp + c);
  return ranks;
}

Grid make_grid(int world, int dp, int cp) {
  if (dp < 0) throw UsageError("--dp", fmt::format("is {}, must be at least 1", dp), "e.g. --dp 2");
  if (cp < 0) throw UsageError("--cp", fmt::format("is {}, must be at least 1", cp), "e.g. --cp 2");
  if (dp == 0 && cp == 0) return Grid{world, 1, world};  // neither: all ranks split a sequence
  const char* culprit = cp == 0 ? "--dp" : "--cp";
  if (dp == 0) dp = world % cp == 0 ? world / cp : 0;
  if (cp == 0) cp = world % dp == 0 ? world / dp : 0;
  if (dp < 1 || cp < 1 || dp * cp != world) {
    throw UsageError(culprit, fmt::format("dp {} x cp {} is not the world size {}", dp, cp, world),
                     "choose --dp and --cp whose product is the number of ranks "
                     "(torchrun --nproc_per_node)");
  }
  return Grid{world, dp, cp};
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

namespace {

void check_config(const CpConfig& c, int dp, int cp) {
  validate_cp(c.run.model.ctx, c.run.model.heads, cp, c.attention, c.zigzag);
  check_precision(c.run.precision, /*bf16_collectives=*/true);
  if (c.run.batch % dp != 0) {
    throw UsageError("--global-batch",
                     fmt::format("{} sequences do not split over dp {}", c.run.batch, dp),
                     "pass a global batch that --dp divides, e.g. --global-batch 8 --dp 2");
  }
}

void allreduce_sum(torch::Tensor& t, Comm& comm) {
  std::vector<torch::Tensor> tensors{t};
  comm.allreduce(tensors)->wait();
}

}  // namespace

std::vector<float> train_cp(const CpConfig& c, Comm& cp, Comm& world, int64_t steps,
                            const torch::Device& device,
                            const std::function<void(int64_t, float)>& on_step,
                            nlohmann::json* digest, std::vector<torch::Tensor>* weights) {
  const int dp = world.getSize() / cp.getSize();
  check_config(c, dp, cp.getSize());
  Gpt full = make_gpt(c.run.model, c.run.seed, device);  // the same weights on every rank
  CpGpt model(full, cp, c.attention, c.zigzag);
  MasterAdamW optimizer(*full, c.run.precision, adamw_options(c.run));  // bf16: casts the model
  {  // NCCL creates a group's communicator with its first collective, before any send or
     // receive of the ring (dtc::batch_isend_irecv)
    torch::Tensor one = torch::ones({1}, torch::TensorOptions().device(device));
    allreduce_sum(one, cp);
  }
  const ByteDataset data = ByteDataset::builtin();
  const int64_t rows = c.run.batch / dp;
  const int64_t first_row = world.getRank() / cp.getSize() * rows;
  std::vector<float> losses;
  for (int64_t step = 0; step < steps; ++step) {
    const Batch batch = data.batch(c.run.seed, step, rows, c.run.model.ctx, first_row);
    Batch mine;  // this rank's tokens of each of its replica's rows
    mine.inputs = shard_sequence(batch.inputs, cp.getRank(), cp.getSize(), c.zigzag).to(device);
    mine.targets = shard_sequence(batch.targets, cp.getRank(), cp.getSize(), c.zigzag).to(device);
    optimizer.zero_grad();
    torch::Tensor loss = model->loss(mine);  // this rank's share of its replica's mean
    loss.backward();
    for (auto& p : full->parameters()) {  // the sum over the tokens of every rank, / dp
      torch::Tensor g = p.mutable_grad();
      allreduce_sum(g, world);
      g.div_(dp);
    }
    optimizer.step();
    torch::Tensor global = loss.detach().clone();
    allreduce_sum(global, world);
    const float value = global.item<float>() / static_cast<float>(dp);
    losses.push_back(value);
    if (on_step) on_step(step, value);
  }
  if (weights) {
    weights->clear();
    for (const auto& w : optimizer.master()) weights->push_back(w.detach().clone());
  }
  if (digest) {  // every rank holds every weight: this rank's own digest is the model's
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

int64_t measure_activation_bytes(CpGpt& model, const Batch& batch) {
  // gloo's worker threads drop their references to a collective's buffers a moment after the
  // collective's wait() returns: let them, before each reading, so that a buffer of this
  // thread's is not freed (or still held) by them in between.
  auto settled = [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return thread_cpu_memory().current;
  };
  const int64_t before = settled();
  torch::Tensor loss = model->loss(batch);
  const int64_t held = settled() - before;
  loss.backward();
  for (auto& p : model->parameters()) p.mutable_grad().reset();
  return held;
}

int64_t predict_layer_activation_bytes(Attention kind, int64_t b, int64_t s, int64_t h, int64_t a,
                                       int cp, int64_t e) {
  const int64_t n = b * s / cp;         // this rank's tokens
  const int64_t stats = 2 * 2 * n * e;  // 2 LayerNorms' mean and rstd
  const int64_t scores = e * a * s * s * b / cp;
  switch (kind) {
    case Attention::kUlysses: return e * 16 * n * h + stats + scores + s * s;
    case Attention::kAllGather:
      return e * 14 * n * h + stats + e * 2 * s * b * h + scores + s * s / cp;
    case Attention::kRing: return e * 16 * n * h + stats + 4 * n * h + 4 * n * a;
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

// ---------------------------------------------------------------------------------------------
// The program
// ---------------------------------------------------------------------------------------------

namespace {

// --no-overlap: a communicator that completes every receive before returning it (on NCCL, every
// group of sends and receives), so that the ring's next block has arrived before the current one
// is computed. The same code, the same messages, no overlap: what the overlap is worth.
class WaitingComm : public Comm {
  // What a completed receive returns: waiting on it again is a no-op.
  class DoneWork : public c10d::Work {
   public:
    bool isCompleted() override { return true; }
    bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  };

 public:
  explicit WaitingComm(c10::intrusive_ptr<Comm> inner)
      : Comm(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}
  const std::string getBackendName() const override { return inner_->getBackendName(); }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t,
                                           const c10d::AllreduceOptions& o) override {
    return inner_->allreduce(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out,
                                           std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override {
    return inner_->allgather(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    return inner_->alltoall_base(out, in, out_splits, in_splits, o);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    return inner_->barrier(o);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return inner_->send(t, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    auto work = inner_->recv(t, src, tag);
    if (grouped_) return work;  // in a group (NCCL) the whole group is waited at its end
    work->wait();
    return c10::make_intrusive<DoneWork>();  // a gloo receive must not be waited twice
  }
#if TORCH_VERSION_MAJOR >= 2
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  void startCoalescing() override {
    grouped_ = true;
    inner_->startCoalescing();
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    grouped_ = false;
    auto work = inner_->endCoalescing();
    if (work) work->wait();
    return work;
  }
#endif

 private:
  c10::intrusive_ptr<Comm> inner_;
  bool grouped_ = false;
};

struct Options {
  int dp = 0;
  int cp = 0;
  std::string attention = "ring";
  bool zigzag = false;
  bool no_overlap = false;  // --no-overlap
};

Attention parse_attention(const std::string& name) {
  if (name == "ulysses") return Attention::kUlysses;
  if (name == "allgather") return Attention::kAllGather;
  return Attention::kRing;
}

std::string human_bytes(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{:.0f} B", b);
}

void print_volumes(std::ostream& out, const std::string& what, int64_t b, int64_t s, int64_t h,
                   int cp, double bytes) {
  fmt::print(out, "  {} (b={} s={} h={} cp={}, {:g} B/elem), per layer and rank:\n", what, b, s, h,
             cp, bytes);
  for (Attention kind : {Attention::kRing, Attention::kAllGather, Attention::kUlysses}) {
    const AttentionVolume v = attention_volume(kind, b, s, h, cp);
    fmt::print(out, "    {:<10} forward {:>10} ({:<16}) backward {:>10} ({})\n",
               attention_name(kind), human_bytes(v.forward * bytes), v.forward_formula,
               human_bytes(v.backward * bytes + v.backward_fp32 * 4), v.backward_formula);
  }
}

void print_report(std::ostream& out, const CpConfig& c, const Grid& grid, const StepLog& log) {
  const auto& losses = log.losses();
  fmt::print(out, "\n  trained {} steps: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, {:.1f} s\n",
             losses.size(), losses.front(), losses.back(), log.tokens_per_s(), log.elapsed_s());
  fmt::print(out, "\nWhat attention sends (closed forms; the ring's dK/dV travel in fp32):\n");
  const double e = c.run.precision == Precision::kFp32 ? 4 : 2;
  print_volumes(out, "this run", c.run.batch / grid.dp, c.run.model.ctx, c.run.model.hidden,
                grid.cp, e);
  print_volumes(out, "a 7B-class layer (h 4096), 128k tokens, bf16, cp 8", 1, 131072, 4096, 8, 2);
  fmt::print(out,
             "\n  The ring sends as much as the all-gather forward, in cp - 1 steps, each hidden\n"
             "  behind a block's attention; Ulysses sends cp times less per rank, but needs\n"
             "  heads % cp == 0. With grouped-query attention K and V shrink (Llama 3 405B: 8 KV\n"
             "  heads for 128 query heads, 1/16 of q), which makes gathering them cheap.\n");
}

void print_memory(std::ostream& out, const CpConfig& c, const Grid& grid, int64_t predicted,
                  const std::vector<int64_t>& measured) {
  const GptConfig& m = c.run.model;
  const int64_t e = c.run.precision == Precision::kFp32 ? 4 : 2;
  const int64_t rows = c.run.batch / grid.dp;
  fmt::print(out, "\nActivations one forward keeps for backward, per rank (counting allocator):\n");
  if (measured.empty()) {
    fmt::print(out, "  (not measured on {}: the counting allocator sees the CPU)\n", "this device");
  } else {
    std::string row;
    for (size_t r = 0; r < measured.size(); ++r) {
      row += fmt::format("{}{}", r == 0 ? "" : ", ", with_commas(measured[r]));
    }
    fmt::print(out, "  measured  {} bytes (ranks 0..{})\n", row, measured.size() - 1);
  }
  fmt::print(out, "  predicted {} bytes ({} layers, README section 6)\n", with_commas(predicted),
             m.layers);
  fmt::print(out, "  one rank, whole sequence: ");
  for (Attention kind : {Attention::kRing, Attention::kAllGather, Attention::kUlysses}) {
    fmt::print(out, "{} {}{}", attention_name(kind),
               with_commas(predict_activation_bytes(kind, m.layers, rows, m.ctx, m.hidden, m.heads,
                                                    m.vocab, 1, e)),
               kind == Attention::kUlysses ? "\n" : ", ");
  }
}

int run(const TrainOptions& t, const Options& o, std::ostream& out, std::ostream& err) {
  // 1. Configuration, checked on every rank before the network is touched.
  CpConfig c;
  c.run = t.run_config();
  c.attention = parse_attention(o.attention);
  c.zigzag = o.zigzag;
  Job job = Job::prepare(t.train.backend, std::chrono::seconds(t.timeout_s));
  const Grid grid = make_grid(job.env.world_size, o.dp, o.cp);
  check_config(c, grid.dp, grid.cp);

  // 2. Build: the counting allocator (CPU: each rank's activations), the process group, then
  // this rank's CP group.
  if (job.device.is_cpu()) install_counting_allocator();
  job.connect();
  c10::intrusive_ptr<Comm> cp = new_subgroup(
      job.store, fmt::format("cp{}", grid.dp_rank(job.rank())), grid.cp_group(job.rank()),
      job.rank(), job.backend, job.timeout, job.env.master_addr);
  if (o.no_overlap) cp = c10::make_intrusive<WaitingComm>(cp);
  const bool talk = job.rank0() && !t.train.json;
  if (talk) {
    const int64_t tl = c.run.model.ctx / grid.cp;
    print_banner(
        out, "Lesson 10: context parallelism", job, c.run.model,
        count_parameters(*Gpt(c.run.model)),
        {{"grid", fmt::format("{} ranks = dp {} x cp {} (cp fastest: CP groups are consecutive "
                              "ranks)",
                              grid.world, grid.dp, grid.cp)},
         {"split",
          fmt::format("each rank: {} of {} tokens a sequence{}, {} attention", tl, c.run.model.ctx,
                      c.zigzag ? fmt::format(" (zig-zag: chunks r and {}-r of {})", 2 * grid.cp - 1,
                                             2 * grid.cp)
                               : std::string(" (contiguous)"),
                      attention_name(c.attention))},
         {"train",
          fmt::format("AdamW lr {:g}, {} steps, global batch {} ({} per replica), seed {}",
                      c.run.lr, t.train.steps, c.run.batch, c.run.batch / grid.dp, c.run.seed)},
         {"numerics", c.run.precision == Precision::kFp32
                          ? std::string("precision fp32, recompute none")
                          : fmt::format("precision {} (fp32 master weights), recompute none",
                                        precision_name(c.run.precision))}});
  }

  // 3. The loop (train_cp), one progress line per tenth of the run.
  StepLog log(err, talk, 0, t.train.steps, c.run.batch * c.run.model.ctx);
  nlohmann::json digest;
  train_cp(
      c, *cp, *job.comm, t.train.steps, job.device,
      [&](int64_t step, float loss) {
        log.end_step(step, loss);
        log.begin_step();
      },
      &digest);

  // The activations one forward keeps, on every rank (the counting allocator: CPU only), against
  // the closed form (predict_activation_bytes).
  const int64_t e = c.run.precision == Precision::kFp32 ? 4 : 2;
  const GptConfig& m = c.run.model;
  const int64_t rows = c.run.batch / grid.dp;
  const int64_t predicted = predict_activation_bytes(c.attention, m.layers, rows, m.ctx, m.hidden,
                                                     m.heads, m.vocab, grid.cp, e);
  std::vector<int64_t> measured;
  if (job.device.is_cpu()) {
    Gpt fresh = make_gpt(m, c.run.seed, job.device);
    MasterAdamW cast(*fresh, c.run.precision, adamw_options(c.run));  // bf16: the model in bf16
    CpGpt model(fresh, *cp, c.attention, c.zigzag);
    const Batch batch =
        ByteDataset::builtin().batch(c.run.seed, 0, rows, m.ctx, grid.dp_rank(job.rank()) * rows);
    Batch mine;
    mine.inputs = shard_sequence(batch.inputs, cp->getRank(), grid.cp, c.zigzag);
    mine.targets = shard_sequence(batch.targets, cp->getRank(), grid.cp, c.zigzag);
    torch::Tensor all = torch::zeros({grid.world}, torch::kLong);
    all[job.rank()] = measure_activation_bytes(model, mine);
    std::vector<torch::Tensor> t{all};
    job.comm->allreduce(t)->wait();
    for (int r = 0; r < grid.world; ++r) measured.push_back(all[r].item<int64_t>());
  }

  // 4. Report, 5. finish.
  job.finish();
  if (!job.rank0()) return kExitOk;
  if (t.train.json) {
    const double e = c.run.precision == Precision::kFp32 ? 4 : 2;
    const AttentionVolume v = attention_volume(c.attention, c.run.batch / grid.dp, c.run.model.ctx,
                                               c.run.model.hidden, grid.cp);
    nlohmann::json j = run_json(log, t.train.steps, job.device);
    j["param_digest"] = digest;
    j["world"] = grid.world;
    j["launcher"] = launcher_name(job.env.launcher);
    j["dp"] = grid.dp;
    j["cp"] = grid.cp;
    j["attention"] = attention_name(c.attention);
    j["zigzag"] = c.zigzag;
    j["overlap"] = !o.no_overlap;
    j["config"] = config_json(c.run.model, c.run.batch, c.run.seed, c.run.lr);
    j["precision"] = precision_name(c.run.precision);
    j["recompute"] = recompute_name(Recompute::kNone);
    j["comm_per_layer"] = {{"forward_elements", v.forward},
                           {"backward_elements", v.backward},
                           {"backward_fp32_elements", v.backward_fp32},
                           {"bytes_per_element", e},
                           {"bytes", (v.forward + v.backward) * e + v.backward_fp32 * 4}};
    j["activation_bytes"] = {
        {"predicted", predicted},
        {"measured", measured.empty() ? nlohmann::json(nullptr) : nlohmann::json(measured)}};
    print_json_line(out, j);
    return kExitOk;
  }
  print_report(out, c, grid, log);
  print_memory(out, c, grid, predicted, measured);
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  TrainCli cli(
      "lesson10",
      "Lesson 10: context parallelism. Trains the course's GPT with each sequence split over\n"
      "--cp ranks and the batch over --dp replicas; run it under torchrun, e.g.\n"
      "  torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson10");
  cli.add_timeout_flag();
  cli.add_precision_flag({Precision::kFp32, Precision::kBf16});
  Options o;
  CLI::App& app = cli.app();
  app.add_option("--cp", o.cp,
                 "ranks that split each sequence (default: world size / dp; with neither flag, "
                 "the world size)")
      ->check(positive_count("--cp 2"));
  app.add_option("--dp", o.dp, "data-parallel replicas (default: world size / cp)")
      ->check(positive_count("--dp 2"));
  app.add_option("--attention", o.attention,
                 "ring (K/V rotate, overlapped), ulysses (all-to-all to heads) or allgather "
                 "(every rank gathers K and V)")
      ->check(one_of({"ring", "ulysses", "allgather"}, "a context-parallel attention"))
      ->capture_default_str();
  app.add_flag("--zigzag", o.zigzag,
               "split each sequence into 2 cp chunks, rank r holding chunks r and 2cp-1-r, so "
               "that causal attention gives every rank the same work (ring, allgather)");
  app.add_flag("--no-overlap", o.no_overlap,
               "complete each hop before computing (a communicator that waits in every receive): "
               "the ring without overlap, to measure what the overlap is worth");
  return cli.run(argc, argv, err, [&] { return run(cli.options(), o, out, err); });
}

}  // namespace dtc::l10

// Lesson 07's given code: the pieces of zero.h that are not the exercise. The flat layout, the
// counting collectives' blocking forms, the engine's construction, bookkeeping and AdamW over its
// pieces, the reduction of a unit's gradient, the inspection helpers, and the sharded
// checkpoints (the storage tricks are dtc/storage.h's). Read it as the library your code in
// zero.cpp calls; nothing here needs changing.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <map>
#include <stdexcept>

#include "dtc/errors.h"
#include "zero.h"

namespace dtc::l07 {

FlatLayout make_layout(Gpt& model, int world) {
  FlatLayout layout;
  layout.world = world;
  const int64_t blocks = static_cast<int64_t>(model->h->size());
  layout.units.resize(static_cast<size_t>(1 + blocks));
  layout.units[0].name = "outer";
  for (int64_t i = 0; i < blocks; ++i)
    layout.units[static_cast<size_t>(1 + i)].name = fmt::format("h.{}", i);
  // named_parameters(): wte, wpe, h.<i>.*, ln_f.*, lm_head (untied only). Tied: the head is
  // wte itself, listed once, so it is stored, gathered and updated once.
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    size_t u = 0;
    if (name.rfind("h.", 0) == 0) u = 1 + std::stoul(name.substr(2, name.find('.', 2) - 2));
    Unit& unit = layout.units[u];
    unit.params.push_back(item.value());
    unit.names.push_back(name);
    unit.shapes.push_back(item.value().sizes().vec());
    unit.numel += item.value().numel();
  }
  for (Unit& unit : layout.units) {
    unit.world = world;
    unit.padded = padded_size(unit.numel, world);
    unit.offset = layout.padded;
    unit.shard_offset = layout.shard;
    layout.numel += unit.numel;
    layout.padded += unit.padded;
    layout.shard += unit.chunk();
  }
  return layout;
}

torch::Tensor CountingComm::reduce_scatter(const torch::Tensor& flat) {
  Pending pending = reduce_scatter_start(flat);
  return reduce_scatter_finish(pending);
}

torch::Tensor CountingComm::all_gather_finish(Pending& pending) {
  pending.work->wait();
  auto full = pending.buffer;
  pending = Pending{};
  return full;
}

torch::Tensor CountingComm::all_gather(const torch::Tensor& chunk) {
  Pending pending = all_gather_start(chunk);
  return all_gather_finish(pending);
}

ZeroEngine::ZeroEngine(Gpt model, c10::intrusive_ptr<Comm> comm, const ZeroOptions& options,
                       c10::intrusive_ptr<Comm> replicate)
    : model_(std::move(model)), comm_(std::move(comm)), options_(options) {
  if (options_.stage < 0 || options_.stage > 3) {
    throw UsageError("--stage", fmt::format("{} is not a ZeRO stage", options_.stage),
                     "use 0 (DDP), 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)");
  }
  if (replicate) {
    if (options_.stage < 2) {
      throw UsageError("--hsdp",
                       fmt::format("HSDP shards stage 2 or 3, not stage {}", options_.stage),
                       "pass --stage 2 or --stage 3 with --hsdp");
    }
    replicate_ = std::make_unique<CountingComm>(std::move(replicate));
  }
  const Precision reduce = options_.reduce.value_or(options_.precision);
  check_precision(options_.precision, /*bf16_collectives=*/true);
  if (options_.precision == Precision::kFp32 && reduce != Precision::kFp32) {
    throw UsageError("--reduce-dtype", "an fp32 model reduces its gradients in fp32",
                     "pass --precision bf16 to reduce in bf16");
  }
  check_precision(reduce, /*bf16_collectives=*/true);
  torch::NoGradGuard no_grad;
  const auto device = model_->parameters().front().device();
  float_options_ = torch::TensorOptions().dtype(torch::kFloat).device(device);
  param_options_ = float_options_.dtype(working_dtype(options_.precision));
  reduce_options_ = float_options_.dtype(working_dtype(reduce));
  layout_ = make_layout(model_, comm_.world());
  // The full flat buffer: every unit's parameters one after the other, zeros in the padding.
  auto full = torch::zeros({layout_.padded}, float_options_);
  for (Unit& unit : layout_.units) {
    int64_t off = unit.offset;
    for (auto& p : unit.params) {
      full.narrow(0, off, p.numel()).copy_(p.reshape({-1}));
      off += p.numel();
    }
  }
  if (options_.precision != Precision::kFp32) {
    // The fp32 master weights start as the fp32 initial weights, in the moments' layout; the
    // parameters are their rounding to bf16 from here on.
    master_ = options_.stage == 0 ? full : shard_of_full(full);
    full = full.to(param_options_);
  }
  if (options_.stage <= 2) {
    // Stages 0-2 keep every parameter: make each one a view of the flat buffer (the model's own
    // tensors are freed), so that one collective can move all of them.
    flat_params_ = full;
    for (Unit& unit : layout_.units)
      bind_unit(unit, flat_params_.narrow(0, unit.offset, unit.padded));
  } else {
    // Stage 3 keeps only its chunk of each unit; the parameters are empty until gathered.
    param_shard_ = shard_of_full(full);
    full = torch::Tensor();
    for (Unit& unit : layout_.units) release_unit(unit);
  }
}

torch::Tensor ZeroEngine::chunk_of_full(const torch::Tensor& full, const Unit& unit) const {
  return full.narrow(0, unit.offset + comm_.rank() * unit.chunk(), unit.chunk());
}

torch::Tensor ZeroEngine::chunk_of_shard(const torch::Tensor& shard, const Unit& unit) const {
  if (!shard.defined()) return {};
  return shard.narrow(0, unit.shard_offset, unit.chunk());
}

torch::Tensor ZeroEngine::shard_of_full(const torch::Tensor& full) const {
  std::vector<torch::Tensor> chunks;
  for (const Unit& unit : layout_.units) chunks.push_back(chunk_of_full(full, unit));
  return torch::cat(chunks);
}

torch::Tensor ZeroEngine::pad_full(const torch::Tensor& unpadded) const {
  TORCH_CHECK(unpadded.numel() == layout_.numel, "expected ", layout_.numel, " elements, got ",
              unpadded.numel());
  auto full = torch::zeros({layout_.padded}, float_options_);
  int64_t from = 0;
  for (const Unit& unit : layout_.units) {
    full.narrow(0, unit.offset, unit.numel).copy_(unpadded.narrow(0, from, unit.numel));
    from += unit.numel;
  }
  return full;
}

torch::Tensor ZeroEngine::unpad_full(const torch::Tensor& padded) const {
  std::vector<torch::Tensor> parts;
  for (const Unit& unit : layout_.units) parts.push_back(padded.narrow(0, unit.offset, unit.numel));
  return torch::cat(parts);
}

void ZeroEngine::bind_unit(Unit& unit, const torch::Tensor& full) {
  // Each parameter becomes a view of its range of @p full (the unit's padded buffer).
  int64_t off = 0;
  for (size_t k = 0; k < unit.params.size(); ++k) {
    const int64_t numel = c10::multiply_integers(unit.shapes[k]);
    unit.params[k].set_data(full.narrow(0, off, numel).view(unit.shapes[k]));
    off += numel;
  }
  unit.bound = true;
}

void ZeroEngine::release_unit(Unit& unit) {
  // A gathered unit: bound by bind_unit, every parameter viewing one buffer of the unit's padded
  // size. Its memory is freed here, whoever else still holds the tensor (zero.h); the
  // constructor's first release finds the model's own tensors and leaves them to their owners.
  bool gathered = unit.bound && !unit.params.empty() && unit.params.front().defined();
  const c10::StorageImpl* buffer =
      gathered ? unit.params.front().storage().unsafeGetStorageImpl() : nullptr;
  for (const auto& p : unit.params) {
    gathered = gathered && p.defined() && p.storage().unsafeGetStorageImpl() == buffer;
  }
  if (gathered && buffer->nbytes() == static_cast<size_t>(unit.padded) *
                                          c10::elementSize(param_options_.dtype().toScalarType())) {
    free_storage(unit.params.front());
  }
  // An empty tensor of the same type in each parameter.
  for (auto& p : unit.params) p.set_data(torch::empty({0}, param_options_));
  unit.bound = false;
}

void ZeroEngine::ensure_moments() {
  if (exp_avg_.defined()) return;
  const int64_t n = options_.stage == 0 ? layout_.padded : layout_.shard;
  exp_avg_ = torch::zeros({n}, float_options_);
  exp_avg_sq_ = torch::zeros({n}, float_options_);
}

float ZeroEngine::forward_backward(const Batch& batch) {
  return options_.stage <= 1 ? forward_backward_replicated(batch) : forward_backward_sharded(batch);
}

torch::Tensor ZeroEngine::grad_buffer(const Unit& unit) const {
  return torch::zeros({unit.padded}, param_options_);
}

Pending ZeroEngine::reduce_start(const torch::Tensor& grads) {
  const torch::Tensor input = grads.to(reduce_options_.dtype());  // no copy if the same
  Pending pending = comm_.reduce_scatter_start(input);
  pending.input = input;
  return pending;
}

void ZeroEngine::update(torch::Tensor params, const torch::Tensor& grad, torch::Tensor exp_avg,
                        torch::Tensor exp_avg_sq, const torch::Tensor& master) {
  // In pieces of 2^18 elements: AdamW is elementwise, so this is exact, and the temporaries it
  // makes (an fp32 copy of a bf16 gradient, the denominator) stay at 1 MiB each, as in a fused
  // AdamW, instead of growing with what this rank owns.
  constexpr int64_t kPiece = int64_t{1} << 18;
  const int64_t n = params.numel();
  for (int64_t at = 0; at < n; at += kPiece) {
    const int64_t len = std::min(kPiece, n - at);
    auto piece = [&](const torch::Tensor& t) { return t.narrow(0, at, len); };
    if (!master.defined()) {
      adamw_update(piece(params), piece(grad), piece(exp_avg), piece(exp_avg_sq), step_,
                   options_.adamw);
      continue;
    }
    auto m = piece(master);
    adamw_update(m, piece(grad).to(torch::kFloat), piece(exp_avg), piece(exp_avg_sq), step_,
                 options_.adamw);
    piece(params).copy_(m);  // rounded to the working dtype
  }
}

void ZeroEngine::reduce_unit_gradient(Pending& pending, const Unit& unit) {
  if (!pending.work) return;
  const torch::Tensor input = pending.input, received = pending.buffer;
  auto sum = CountingComm::reduce_scatter_finish(pending);
  auto chunk = chunk_of_shard(grad_shard_, unit);
  chunk.copy_(sum.div_(static_cast<double>(comm_.world())));
  if (replicate_) {
    // HSDP: the mean over the shard group, averaged over the replicas of this shard: the mean
    // over all W ranks (equal groups). Blocking, unit by unit (FSDP2 overlaps it too).
    auto mean = chunk.contiguous();
    replicate_->all_reduce(mean);
    chunk.copy_(mean.div_(static_cast<double>(replicate_->world())));
  }
  // Done with both (the sum is in the shard): freed now, not when gloo's thread lets go.
  sum = torch::Tensor();
  // Only a tensor that owns its whole storage: never a view into a buffer that lives on.
  for (const torch::Tensor& t : {input, received}) {
    if (t.defined() && t.storage_offset() == 0 && t.storage().nbytes() > 0 &&
        t.storage().nbytes() == static_cast<size_t>(t.nbytes())) {
      free_storage(t);
    }
  }
}

torch::Tensor ZeroEngine::gather_shards(const torch::Tensor& shard) {
  auto full = torch::empty({layout_.padded}, shard.options());
  for (const Unit& unit : layout_.units) {
    // Not counted: this is inspection (tests, checkpoints), not training.
    std::vector<std::vector<at::Tensor>> out(1);
    for (int j = 0; j < comm_.world(); ++j)
      out[0].push_back(full.narrow(0, unit.offset + j * unit.chunk(), unit.chunk()));
    std::vector<at::Tensor> in{chunk_of_shard(shard, unit).contiguous()};
    comm_.comm().allgather(out, in)->wait();
  }
  return full;
}

torch::Tensor ZeroEngine::full_parameters() {
  torch::NoGradGuard no_grad;
  if (master_.defined()) {
    return unpad_full(options_.stage == 0 ? master_ : gather_shards(master_)).clone();
  }
  if (options_.stage <= 2) return unpad_full(flat_params_).clone();
  return unpad_full(gather_shards(param_shard_));
}

ZeroEngine::ShardState ZeroEngine::shard_state() {
  ShardState s;
  s.step = step_;
  if (master_.defined()) {  // bf16: the weights are the fp32 master weights, not their rounding
    s.params = options_.stage == 0 ? shard_of_full(master_) : master_.clone();
  } else {
    s.params = options_.stage <= 2 ? shard_of_full(flat_params_) : param_shard_.clone();
  }
  if (!exp_avg_.defined()) {
    s.exp_avg = torch::zeros({layout_.shard}, float_options_);
    s.exp_avg_sq = torch::zeros({layout_.shard}, float_options_);
  } else if (options_.stage == 0) {
    s.exp_avg = shard_of_full(exp_avg_);
    s.exp_avg_sq = shard_of_full(exp_avg_sq_);
  } else {
    s.exp_avg = exp_avg_.clone();
    s.exp_avg_sq = exp_avg_sq_.clone();
  }
  return s;
}

void ZeroEngine::load_owned_state(const torch::Tensor& params, const torch::Tensor& exp_avg,
                                  const torch::Tensor& exp_avg_sq, int64_t step) {
  torch::NoGradGuard no_grad;
  const int64_t whole_params = options_.stage <= 2 ? layout_.numel : layout_.shard;
  const int64_t whole_moments = options_.stage == 0 ? layout_.numel : layout_.shard;
  if (params.numel() != whole_params || exp_avg.numel() != whole_moments ||
      exp_avg_sq.numel() != whole_moments) {
    throw std::invalid_argument(fmt::format(
        "load_owned_state at stage {}: {} parameters and {}/{} moment elements, expected {} "
        "and {}",
        options_.stage, params.numel(), exp_avg.numel(), exp_avg_sq.numel(), whole_params,
        whole_moments));
  }
  // A copy of its own, on the engine's device (one copy, whatever the input's device).
  auto here = [&](const torch::Tensor& t) {
    return t.to(float_options_, /*non_blocking=*/false, /*copy=*/true).contiguous();
  };
  // bf16: @p params are the fp32 master weights, kept in the moments' layout; the parameters
  // become their rounding to bf16.
  if (options_.stage <= 2) {
    const torch::Tensor full = pad_full(here(params));
    flat_params_.copy_(full);  // the parameters stay views of it
    if (master_.defined()) master_ = options_.stage == 0 ? full : shard_of_full(full);
  } else if (master_.defined()) {
    master_ = here(params);
    param_shard_ = master_.to(param_options_);
  } else {
    param_shard_ = here(params);
  }
  exp_avg_ = options_.stage == 0 ? pad_full(here(exp_avg)) : here(exp_avg);
  exp_avg_sq_ = options_.stage == 0 ? pad_full(here(exp_avg_sq)) : here(exp_avg_sq);
  step_ = step;
  if (step == 0) {
    exp_avg_ = torch::Tensor();
    exp_avg_sq_ = torch::Tensor();
  }
}

namespace {

std::string shard_file(const std::string& dir, int rank, int world) {
  return (std::filesystem::path(dir) / fmt::format("shard-{}-of-{}.pt", rank, world)).string();
}

// The marker that a save of @p world ranks completed: written last, by rank 0, after every rank's
// file is in place.
std::string complete_file(const std::string& dir) {
  return (std::filesystem::path(dir) / "COMPLETE").string();
}

// Writes @p archive to @p path atomically: to path.tmp, then rename (atomic on POSIX): a crash
// halfway leaves path.tmp, never half of path. (A machine crash would also need fsync of the
// file and of the directory: lesson 06's pitfalls.)
void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path) {
  const std::string tmp = path + ".tmp";
  archive.save_to(tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error(fmt::format("cannot rename {} to {}", tmp, path));
  }
}

torch::Tensor unit_numels(const FlatLayout& layout) {
  std::vector<int64_t> n;
  for (const Unit& unit : layout.units) n.push_back(unit.numel);
  return torch::tensor(n, torch::kLong);
}

}  // namespace

void save_sharded(ZeroEngine& engine, const std::string& dir) {
  if (engine.replicate_comm() != nullptr) {
    throw UsageError("--save-sharded", "this lesson's checkpoints are for plain ZeRO, not HSDP",
                     "drop --hsdp, or save without it");
  }
  const auto s = engine.shard_state();
  torch::serialize::OutputArchive archive;
  archive.write("params", s.params.cpu());
  archive.write("exp_avg", s.exp_avg.cpu());
  archive.write("exp_avg_sq", s.exp_avg_sq.cpu());
  archive.write("step", torch::tensor({s.step}, torch::kLong));
  archive.write("world",
                torch::tensor({static_cast<int64_t>(engine.layout().world)}, torch::kLong));
  archive.write("unit_numels", unit_numels(engine.layout()));
  const int world = engine.layout().world;
  // Not counted (checkpointing, not training): two barriers. The old COMPLETE goes before any
  // rank replaces its shard, and the new one comes after every rank has.
  auto barrier = [&] {
    std::vector<at::Tensor> done{torch::zeros({1}, s.params.options())};
    engine.comm().comm().allreduce(done)->wait();
  };
  if (engine.comm().rank() == 0) std::filesystem::remove(complete_file(dir));  // a new save
  barrier();
  save_atomically(archive, shard_file(dir, engine.comm().rank(), world));
  barrier();
  if (engine.comm().rank() == 0) {
    torch::serialize::OutputArchive marker;
    marker.write("world", torch::tensor({static_cast<int64_t>(world)}, torch::kLong));
    marker.write("step", torch::tensor({s.step}, torch::kLong));
    save_atomically(marker, complete_file(dir));
  }
}

void load_sharded(ZeroEngine& engine, const std::string& dir) {
  if (engine.replicate_comm() != nullptr) {
    throw UsageError("--load-sharded", "this lesson's checkpoints are for plain ZeRO, not HSDP",
                     "drop --hsdp, or load without it");
  }
  // How many ranks saved it: the N in the COMPLETE marker, written last by a finished save.
  if (!std::filesystem::is_directory(dir)) {
    throw UsageError("--load-sharded", fmt::format("'{}' is not a directory", dir),
                     "pass a directory written by --save-sharded");
  }
  if (!std::filesystem::exists(complete_file(dir))) {
    throw UsageError("--load-sharded",
                     fmt::format("'{}' has no COMPLETE marker: its save did not finish (a rank "
                                 "died, or it is not a --save-sharded directory)",
                                 dir),
                     "load an earlier checkpoint, or save again");
  }
  int saved_world = 0;
  int64_t saved_step = 0;
  {
    torch::serialize::InputArchive marker;
    marker.load_from(complete_file(dir));
    torch::Tensor w, st;
    marker.read("world", w);
    marker.read("step", st);
    saved_world = static_cast<int>(w.item<int64_t>());
    saved_step = st.item<int64_t>();
  }
  // Every file is there: checked on every rank before any is read, so that all ranks agree.
  for (int r = 0; r < saved_world; ++r) {
    const std::string file = shard_file(dir, r, saved_world);
    if (!std::filesystem::exists(file)) {
      throw UsageError(
          "--load-sharded", fmt::format("'{}' is missing", file),
          fmt::format("a checkpoint of {} ranks has {} files", saved_world, saved_world));
    }
  }
  // The files, each read when first needed and checked: the same model, the marker's step.
  struct Saved {
    torch::Tensor params, exp_avg, exp_avg_sq;
  };
  std::map<int, Saved> files;
  auto file_of = [&](int r) -> const Saved& {
    if (auto it = files.find(r); it != files.end()) return it->second;
    const std::string file = shard_file(dir, r, saved_world);
    torch::serialize::InputArchive archive;
    archive.load_from(file);
    torch::Tensor numels, st;
    Saved saved;
    archive.read("unit_numels", numels);
    if (!torch::equal(numels, unit_numels(engine.layout()))) {
      throw UsageError("--load-sharded", fmt::format("'{}' is a checkpoint of another model", file),
                       "use the same model flags (--layers, --hidden, --seq, --untied, ...)");
    }
    archive.read("params", saved.params);
    archive.read("exp_avg", saved.exp_avg);
    archive.read("exp_avg_sq", saved.exp_avg_sq);
    archive.read("step", st);
    if (st.item<int64_t>() != saved_step) {
      throw UsageError("--load-sharded",
                       fmt::format("'{}' is from step {}, but the checkpoint's COMPLETE marker "
                                   "says step {}: shards of two saves are mixed",
                                   file, st.item<int64_t>(), saved_step),
                       "load a directory that one finished save wrote");
    }
    return files.emplace(r, std::move(saved)).first->second;
  };
  // What this rank keeps of each unit, in the current layout: the whole unit, unpadded, where
  // the stage replicates it; else its chunk, zero-padded to unit.chunk() (the shard layout).
  const FlatLayout& layout = engine.layout();
  const int64_t rank = engine.comm().rank();
  auto owned = [&](bool whole, torch::Tensor Saved::*which) {
    std::vector<torch::Tensor> parts;
    for (size_t u = 0; u < layout.units.size(); ++u) {
      const Unit& unit = layout.units[u];
      const int64_t begin = whole ? 0 : std::min(unit.numel, rank * unit.chunk());
      const int64_t end = whole ? unit.numel : std::min(unit.numel, (rank + 1) * unit.chunk());
      auto part = read_unit_range(layout, u, begin, end, saved_world,
                                  [&](int r) { return file_of(r).*which; });
      parts.push_back(part.to(torch::kFloat));
      if (!whole && part.numel() < unit.chunk()) {
        parts.push_back(torch::zeros({unit.chunk() - part.numel()}, torch::kFloat));
      }
    }
    return torch::cat(parts);
  };
  torch::Tensor params, exp_avg, exp_avg_sq;
  std::exception_ptr failed;
  try {
    params = owned(engine.stage() <= 2, &Saved::params);
    exp_avg = owned(engine.stage() == 0, &Saved::exp_avg);
    exp_avg_sq = owned(engine.stage() == 0, &Saved::exp_avg_sq);
  } catch (...) {
    failed = std::current_exception();
  }
  // A rank reads only some files, so only it may find one bad: agree on the outcome (one
  // allreduce, MAX, not counted), so that every rank stops, instead of the others waiting in
  // the first collective until the timeout.
  const auto device = engine.model()->parameters().front().device();
  std::vector<at::Tensor> bad{
      torch::full({1}, failed ? 1.0f : 0.0f, torch::TensorOptions().device(device))};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  engine.comm().comm().allreduce(bad, max)->wait();
  if (failed) std::rethrow_exception(failed);
  if (bad[0].cpu().item<float>() > 0) {
    throw UsageError("--load-sharded", "another rank could not load the checkpoint",
                     "that rank's error says which file and why");
  }
  engine.load_owned_state(params, exp_avg, exp_avg_sq, saved_step);
}

void consolidate(ZeroEngine& engine, const std::string& file) {
  auto full = engine.full_parameters().cpu();  // collective: every rank gathers
  if (engine.comm().rank() != 0) return;
  torch::serialize::OutputArchive archive;
  int64_t off = 0;
  for (const Unit& unit : engine.layout().units) {
    for (size_t k = 0; k < unit.names.size(); ++k) {
      const int64_t numel = c10::multiply_integers(unit.shapes[k]);
      archive.write(unit.names[k], full.narrow(0, off, numel).view(unit.shapes[k]).clone());
      off += numel;
    }
  }
  archive.save_to(file);
}

}  // namespace dtc::l07

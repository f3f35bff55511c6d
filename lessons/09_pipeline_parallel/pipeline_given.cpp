// Lesson 09 (given): a stage's parameters and forward, the checks, the schedules' names and
// printing, and the two autograd helpers the executor uses (deallocate_output,
// backward_from_graph), the replicas' gradient average and the stages' parameter names. Your
// part is in pipeline.cpp; both implement pipeline.h.
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include <torch/csrc/autograd/engine.h>

#include "dtc/errors.h"
#include "dtc/trace.h"
#include "pipeline.h"

namespace dtc::l09 {

std::vector<torch::Tensor> Stage::parameters() const {
  std::vector<torch::Tensor> params;
  auto add = [&](const torch::nn::Module& m) {
    for (const auto& p : m.parameters()) params.push_back(p);
  };
  if (wte) add(*wte);
  if (wpe) add(*wpe);
  for (const auto& b : blocks) add(*b);
  if (ln_f) add(*ln_f);
  if (lm_head) add(*lm_head);
  return params;
}

void Stage::begin_step(int64_t micro_batches, std::function<void()> on_weights_done) {
  traced_forwards = 0;
  traced_recomputes = 0;
  traced_without_graph = false;
  std::lock_guard<std::mutex> lock(watch->mu);
  watch->micro_batches = micro_batches;
  watch->weights_done = 0;
  watch->on_weights_done = std::move(on_weights_done);
  watch->input_only.clear();
}

namespace {

// A gradient's identity and version: backward accumulating into it changes one or the other
// (the first accumulation makes it, the next ones add in place or replace it).
std::pair<const void*, uint32_t> grad_state(const torch::Tensor& param) {
  const torch::Tensor& g = param.grad();
  if (!g.defined()) return {nullptr, 0};
  return {g.unsafeGetTensorImpl(), g._version()};
}

// Watches every backward pass through micro-batch @p micro's graph from @p output: the pass
// starts when the output's gradient reaches it (a hook) and ends with the autograd engine's
// end-of-pass callback; it computed weight gradients if @p probe's gradient changed, and went
// on to the stage's input if @p input's did (a leaf that needs a gradient, else undefined).
// Traces the pass as "{label}B{micro}" (a whole backward), "I" (the input's gradient alone) or
// "W" (weight gradients after an I, the input left alone: a pass after an I that reaches the
// input again is a whole backward, "B"), and counts the micro-batches whose weights are in.
void watch_backward(torch::Tensor output, const torch::Tensor& probe, const torch::Tensor& input,
                    int64_t micro, const std::string& label,
                    const std::shared_ptr<BackwardWatch>& watch) {
  struct Pass {
    std::mutex mu;
    std::pair<const void*, uint32_t> before{};
    std::pair<const void*, uint32_t> input_before{};
    TraceTime begin{};
  };
  auto pass = std::make_shared<Pass>();
  Tracer* tracer = active_tracer();
  output.register_hook([=](const torch::Tensor&) {
    {
      std::lock_guard<std::mutex> lock(pass->mu);
      pass->before = grad_state(probe);
      if (input.defined()) pass->input_before = grad_state(input);
      if (tracer) pass->begin = tracer->now();
    }
    torch::autograd::Engine::get_default_engine().queue_callback([=] {
      std::function<void()> done;
      const char* kind = "I";
      {
        std::lock_guard<std::mutex> lock(watch->mu);
        if (grad_state(probe) != pass->before) {
          const bool reached_input = input.defined() && grad_state(input) != pass->input_before;
          kind = watch->input_only.count(micro) && !reached_input ? "W" : "B";
          if (++watch->weights_done == watch->micro_batches) done = watch->on_weights_done;
        } else {
          watch->input_only.insert(micro);
        }
      }
      if (tracer) {
        const TraceTime end = tracer->now();
        std::lock_guard<std::mutex> lock(pass->mu);
        tracer->span(fmt::format("{}{}{}", label, kind, micro), "compute", TraceTrack::kCompute,
                     pass->begin, end);
        tracer->memory(end);
      }
      if (done) done();
    });
  });
}

}  // namespace

torch::Tensor Stage::forward(const torch::Tensor& input) {
  // On a trace (--trace): the k-th call of a step is micro-batch k's span "F<k>" (every
  // schedule runs a chunk's forwards, and its backwards, in micro-batch order 0 .. m-1), and
  // each backward pass through its graph is watched (watch_backward): "B<k>", or "I<k>" and
  // "W<k>" when the backward is split. Once a call of the step ran without a graph (recompute),
  // the calls with one are the recomputations in backward: "R<k>", and their backward "B<k>".
  // With several chunks, the labels start with the chunk: "1F3".
  const bool graph = torch::GradMode::is_enabled();
  if (!graph) traced_without_graph = true;
  const bool recomputing = graph && traced_without_graph;
  const int64_t micro = recomputing ? traced_recomputes++ : traced_forwards++;
  const std::string label = chunks > 1 ? std::to_string(chunk) : std::string();
  const std::string name = fmt::format("{}{}{}", label, recomputing ? "R" : "F", micro);
  TraceSpan span(name.c_str());
  // The model's own pieces (dtc/model.h), as GptImpl::forward runs them: the embedding on
  // stage 0 (tokens (b, T) -> (b, T, h)), this stage's blocks, the head on the last stage.
  torch::Tensor x = layers.embed ? embed_tokens(wte, wpe, input, positions)
                                 : input.to(working_dtype(precision));  // no-op in fp32
  if (enter_blocks) x = enter_blocks(x);
  for (auto& b : blocks) x = b->forward(x);  // (b, T, h)
  if (leave_blocks) x = leave_blocks(x);
  if (layers.head) x = head_logits(ln_f, lm_head, torch::Tensor(), x);  // (b, T, V), fp32
  x = x.to(torch::kFloat);  // the next stage's message in fp32 (no-op in fp32 or on the head)
  if (graph && x.requires_grad()) {
    const auto params = parameters();
    // The stage's input, when backward accumulates a gradient into it (a received message).
    const torch::Tensor leaf = input.requires_grad() && input.is_leaf() ? input : torch::Tensor();
    if (!params.empty()) watch_backward(x, params.front(), leaf, micro, label, watch);
  }
  if (graph && after_forward) after_forward();
  return x;
}

std::vector<Stage> make_chunks(const Gpt& full, int stages, int chunks, int rank) {
  std::vector<Stage> parts;
  for (int c = 0; c < chunks; ++c) {
    parts.push_back(make_stage(full, stages * chunks, c * stages + rank));
    parts.back().chunk = c;
    parts.back().chunks = chunks;
  }
  return parts;
}

std::vector<torch::Tensor> parameters_of(const std::vector<Stage>& chunks) {
  std::vector<torch::Tensor> params;
  for (const auto& c : chunks) {
    const auto mine = c.parameters();
    params.insert(params.end(), mine.begin(), mine.end());
  }
  return params;
}

// ---------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------

void check_pipeline(const GptConfig& config, int stages, int64_t batch, int64_t micro_batches) {
  if (stages < 1) {
    throw UsageError("--stages", fmt::format("{} stages", stages), "pass at least 1");
  }
  if (stages > config.layers) {
    throw UsageError("--stages",
                     fmt::format("more stages than layers: {} stages for {} layers (every stage "
                                 "needs at least one transformer block)",
                                 stages, config.layers),
                     fmt::format("pass --stages {} or fewer, or more --layers", config.layers));
  }
  if (micro_batches < 1) {
    throw UsageError("--micro-batches", fmt::format("{} micro-batches", micro_batches),
                     "pass at least 1");
  }
  if (batch % micro_batches != 0) {
    throw UsageError("--micro-batches",
                     fmt::format("{} micro-batches does not divide the batch of {} sequences",
                                 micro_batches, batch),
                     "pass a divisor of --global-batch (e.g. 1, 2, 4 for a batch of 8)");
  }
}

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGpipe;
  if (name == "1f1b") return ScheduleKind::k1f1b;
  if (name == "interleaved") return ScheduleKind::kInterleaved;
  if (name == "zb-h1") return ScheduleKind::kZbH1;
  throw UsageError("--schedule", fmt::format("'{}' is not a schedule", name),
                   "use gpipe, 1f1b, interleaved (with --virtual-stages) or zb-h1");
}

const char* schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe: return "gpipe";
    case ScheduleKind::k1f1b: return "1f1b";
    case ScheduleKind::kInterleaved: return "interleaved";
    case ScheduleKind::kZbH1: return "zb-h1";
  }
  return "?";
}

std::vector<Op> make_schedule(ScheduleKind kind, int stages, int64_t micro_batches, int stage,
                              int chunks) {
  switch (kind) {
    case ScheduleKind::kGpipe: return gpipe_schedule(stages, micro_batches, stage);
    case ScheduleKind::k1f1b: return one_f_one_b_schedule(stages, micro_batches, stage);
    case ScheduleKind::kInterleaved:
      return interleaved_schedule(stages, micro_batches, stage, chunks);
    case ScheduleKind::kZbH1: return zb_h1_schedule(stages, micro_batches, stage);
  }
  return {};
}

void check_interleaved(const GptConfig& config, int stages, int chunks, int64_t micro_batches) {
  if (chunks < 2) {
    throw UsageError("--virtual-stages",
                     fmt::format("{} model chunk(s) per rank for the interleaved schedule", chunks),
                     "pass --virtual-stages 2 or more (with one chunk per rank, use --schedule "
                     "1f1b)");
  }
  if (config.layers % (static_cast<int64_t>(stages) * chunks) != 0) {
    throw UsageError(
        "--virtual-stages",
        fmt::format("{} layers do not split into {} stages x {} chunks of equal size",
                    config.layers, stages, chunks),
        fmt::format("pass --layers a multiple of {} (stages x virtual stages), or fewer "
                    "--virtual-stages",
                    static_cast<int64_t>(stages) * chunks));
  }
  if (micro_batches % stages != 0) {
    throw UsageError(
        "--micro-batches",
        fmt::format("{} micro-batches are not a multiple of the {} stages (the interleaved "
                    "schedule sends micro-batches through each chunk in groups of p)",
                    micro_batches, stages),
        fmt::format("pass --micro-batches {} or another multiple of {}", stages, stages));
  }
}

std::string to_string(const std::vector<Op>& ops) {
  const bool chunked =
      std::any_of(ops.begin(), ops.end(), [](const Op& op) { return op.chunk != 0; });
  static constexpr char kLetter[] = {'F', 'B', 'I', 'W'};
  std::string text;
  for (const auto& op : ops) {
    if (!text.empty()) text += ' ';
    if (chunked) text += std::to_string(op.chunk);
    text += fmt::format("{}{}", kLetter[op.kind], op.micro);
  }
  return text;
}

int64_t max_in_flight(const std::vector<Op>& ops) {
  int64_t now = 0, most = 0;
  for (const auto& op : ops) {
    if (op.kind == Op::kForward) ++now;
    if (op.kind == Op::kBackward || op.kind == Op::kWeight) --now;  // I keeps the graph
    most = std::max(most, now);
  }
  return most;
}

StepStats run_schedule(Stage& stage, Comm& comm, const std::vector<Op>& ops, const Batch& batch,
                       int64_t micro_batches, bool deallocate_outputs, bool recompute) {
  std::vector<Stage> chunks;
  chunks.push_back(std::move(stage));
  struct GiveBack {  // the stage comes back to the caller whatever happens
    Stage& stage;
    std::vector<Stage>& chunks;
    ~GiveBack() { stage = std::move(chunks.front()); }
  } give_back{stage, chunks};
  return run_schedule(chunks, comm, ops, batch, micro_batches, deallocate_outputs, recompute);
}

void deallocate_output(torch::Tensor& output) {
  if (output.is_view() || !output.grad_fn()) {
    throw std::invalid_argument(
        "deallocate_output: the output must be a tensor of its own with a grad_fn (not a view, "
        "not a leaf)");
  }
  output.set_data(torch::empty({1}, output.options()));  // the graph stays, the values go
}

void backward_from_graph(const torch::Tensor& output, const torch::Tensor& grad) {
  if (!output.grad_fn()) {
    throw std::invalid_argument("backward_from_graph: the output has no grad_fn");
  }
  torch::autograd::Engine::get_default_engine().execute(
      {torch::autograd::impl::gradient_edge(output)}, {grad}, /*keep_graph=*/false,
      /*create_graph=*/false, /*accumulate_grad=*/true);
}

ReplicaAverage::ReplicaAverage(std::vector<Stage>& chunks, Comm* replicas, int64_t micro_batches,
                               double divisor)
    : chunks_(chunks),
      replicas_(replicas),
      divisor_(divisor > 0 ? divisor : (replicas != nullptr ? replicas->getSize() : 1)),
      flats_(chunks.size()),
      works_(chunks.size()) {
  for (size_t c = 0; c < chunks.size(); ++c) {
    std::function<void()> start;
    if (replicas_ != nullptr && replicas_->getSize() > 1) start = [this, c] { this->start(c); };
    chunks[c].begin_step(micro_batches, std::move(start));
  }
}

ReplicaAverage::~ReplicaAverage() {
  for (auto& c : chunks_) {
    std::lock_guard<std::mutex> lock(c.watch->mu);
    c.watch->on_weights_done = nullptr;
  }
}

void ReplicaAverage::finish() {
  if (replicas_ == nullptr || replicas_->getSize() == 1) {
    if (divisor_ == 1) return;
    torch::NoGradGuard no_grad;  // a group of one: the sum is the gradient itself
    for (auto& chunk : chunks_) {
      for (auto& p : chunk.parameters()) {
        if (p.grad().defined()) p.mutable_grad().div_(divisor_);
      }
    }
    return;
  }
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (!works_[c]) {
      throw std::runtime_error(fmt::format(
          "chunk {}: the weight gradients of the step's micro-batches were never all computed, "
          "so its replicas could not average them (does run_schedule run every backward?)",
          c));
    }
    works_[c]->wait();
    flats_[c].div_(divisor_);
    int64_t offset = 0;
    for (auto& p : chunks_[c].parameters()) {
      torch::NoGradGuard no_grad;
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      p.mutable_grad().copy_(flats_[c].narrow(0, offset, p.numel()).view_as(p));
      offset += p.numel();
    }
  }
}

void ReplicaAverage::start(size_t c) {
  std::vector<torch::Tensor> pieces;
  for (const auto& p : chunks_[c].parameters()) {
    pieces.push_back(p.grad().defined() ? p.grad().reshape(-1) : torch::zeros_like(p).reshape(-1));
  }
  flats_[c] = torch::cat(pieces).to(torch::kFloat);  // fp32 on the wire, whatever the model's
  std::vector<at::Tensor> v{flats_[c]};
  works_[c] = replicas_->allreduce(v);
}

std::vector<std::pair<std::string, torch::Tensor>> stage_pieces(const Stage& stage) {
  std::vector<std::pair<std::string, torch::Tensor>> pieces;
  auto add = [&](const std::string& prefix, const torch::nn::Module& m) {
    for (const auto& item : m.named_parameters())
      pieces.emplace_back(prefix + item.key(), item.value());
  };
  if (stage.wte) add("wte.", *stage.wte);
  if (stage.wpe) add("wpe.", *stage.wpe);
  for (size_t k = 0; k < stage.blocks.size(); ++k) {
    add(fmt::format("h.{}.", stage.layers.first + static_cast<int64_t>(k)), *stage.blocks[k]);
  }
  if (stage.ln_f) add("ln_f.", *stage.ln_f);
  if (stage.lm_head) add("lm_head.", *stage.lm_head);
  return pieces;
}

}  // namespace dtc::l09

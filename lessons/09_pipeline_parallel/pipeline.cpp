// Lesson 09: pipeline parallelism. Implements lessons/09_pipeline_parallel/pipeline.h.
//
// Fill in every TODO(L09) below, top to bottom: the split, the two schedules, send/recv, and
// the executor. `make test-lesson09` checks the schedules against the textbook order and the
// pipelined training against a single-process baseline on the same weights and batches; then
//   make run-lesson09 NPROC=4 ARGS="--micro-batches 4 --schedule 1f1b"
// runs the program on 4 ranks (one stage each).
#include "pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include <torch/csrc/autograd/engine.h>

#include "dtc/errors.h"
#include "dtc/todo.h"
#include "dtc/trace.h"

namespace dtc::l09 {

// ---------------------------------------------------------------------------------------------
// The split
// ---------------------------------------------------------------------------------------------

StageLayers stage_layers(int64_t layers, int stages, int stage) {
  StageLayers s;
  // TODO(L09)
  DTC_TODO("L09",
           "stage's blocks [first, last) by the header's rule (as even as possible, the "
           "remainder to the first stages), in closed form, and its embed and head flags "
           "(L09Split.*; README section 6 hints)");
  return s;
}

Stage make_stage(const Gpt& full, int stages, int stage) {
  const GptConfig& config = full->config();
  if (config.tied) {
    throw UsageError("--untied",
                     "the pipeline needs an untied output head (the embedding lives on stage 0, "
                     "the head on the last stage)",
                     "build the model with GptConfig::tied = false");
  }
  check_pipeline(config, stages, 1, 1);
  if (stage < 0 || stage >= stages) {
    throw UsageError("stage", fmt::format("stage {} is not in 0..{}", stage, stages - 1),
                     "the stage is the rank in the pipeline");
  }
  Stage s;
  s.config = config;
  s.stage = stage;
  s.stages = stages;
  // TODO(L09)
  DTC_TODO("L09",
           "s.layers, and the very modules of full that this stage owns (shared, never "
           "copied): its blocks, the embeddings on stage 0, ln_f and lm_head on the last stage "
           "(L09Split.*; README section 6 hints)");
  return s;
}

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

void Stage::begin_step() {
  traced_forwards = 0;
  traced_recomputes = 0;
  traced_without_graph = false;
}

torch::Tensor Stage::forward(const torch::Tensor& input) {
  // On a trace (--trace): the k-th call of a step is micro-batch k's span "F<k>" (forward and
  // backward both run micro-batches in order 0 .. m-1 in GPipe and 1F1B), and its backward
  // "B<k>" is timed by gradient hooks. Once a call of the step ran without a graph (recompute),
  // the calls with one are the recomputations in backward: "R<k>", and their backward "B<k>".
  const bool graph = torch::GradMode::is_enabled();
  if (!graph) traced_without_graph = true;
  const bool recomputing = graph && traced_without_graph;
  const int64_t micro = recomputing ? traced_recomputes++ : traced_forwards++;
  TraceSpan span(recomputing ? "R" : "F", micro);
  torch::Tensor x = input;
  if (!layers.embed) x = x.to(working_dtype(precision));  // no-op in fp32
  if (layers.embed) {
    // tokens (b, T) -> (b, T, h), exactly as GptImpl::forward
    auto pos = torch::arange(input.size(1), torch::dtype(torch::kLong).device(input.device()));
    x = wte->forward(input) + wpe->forward(pos);
  }
  const torch::Tensor first = x;             // the first tensor of the stage with a gradient
  for (auto& b : blocks) x = b->forward(x);  // (b, T, h)
  if (layers.head) x = lm_head->forward(ln_f->forward(x));  // (b, T, V)
  x = x.to(torch::kFloat);  // the loss, or the next stage's message, in fp32 (no-op in fp32)
  trace_backward(first, x, "B", micro);
  return x;
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

// ---------------------------------------------------------------------------------------------
// Schedules
// ---------------------------------------------------------------------------------------------

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGpipe;
  if (name == "1f1b") return ScheduleKind::k1f1b;
  throw UsageError("--schedule", fmt::format("'{}' is not a schedule", name), "use gpipe or 1f1b");
}

const char* schedule_name(ScheduleKind kind) {
  return kind == ScheduleKind::kGpipe ? "gpipe" : "1f1b";
}

std::vector<Op> gpipe_schedule(int stages, int64_t micro_batches, int stage) {
  (void)stages;
  (void)stage;
  std::vector<Op> ops;
  // TODO(L09)
  DTC_TODO("L09",
           "every forward F0 .. F(m-1), then every backward B0 .. B(m-1), on every "
           "stage (L09Schedule.*)");
  return ops;
}

std::vector<Op> one_f_one_b_schedule(int stages, int64_t micro_batches, int stage) {
  std::vector<Op> ops;
  // TODO(L09)
  DTC_TODO("L09",
           "warm-up forwards, then forward-backward pairs, then the backwards left, "
           "with the shortest warm-up that never waits on a gradient (Figure 4; README section 6 "
           "has "
           "hints; L09Schedule.* checks the papers' orders)");
  return ops;
}

std::vector<Op> make_schedule(ScheduleKind kind, int stages, int64_t micro_batches, int stage) {
  return kind == ScheduleKind::kGpipe ? gpipe_schedule(stages, micro_batches, stage)
                                      : one_f_one_b_schedule(stages, micro_batches, stage);
}

std::string to_string(const std::vector<Op>& ops) {
  std::string text;
  for (const auto& op : ops) {
    if (!text.empty()) text += ' ';
    text += fmt::format("{}{}", op.kind == Op::kForward ? 'F' : 'B', op.micro);
  }
  return text;
}

int64_t max_in_flight(const std::vector<Op>& ops) {
  int64_t now = 0, most = 0;
  for (const auto& op : ops) {
    now += op.kind == Op::kForward ? 1 : -1;
    most = std::max(most, now);
  }
  return most;
}

// ---------------------------------------------------------------------------------------------
// Point-to-point
// ---------------------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> send_tensor(Comm& comm, const torch::Tensor& tensor, int dst,
                                           int tag) {
  // TODO(L09)
  DTC_TODO("L09",
           "start sending the tensor's values to dst with tag, as a group of one, and "
           "return the Work without waiting for it (L09P2p.*, L09NcclSafe.*; README section 6 "
           "lists "
           "the calls)");
}

torch::Tensor recv_tensor(Comm& comm, at::IntArrayRef shape, int src, int tag,
                          const torch::Device& device) {
  // TODO(L09)
  DTC_TODO("L09",
           "a fresh float tensor of the shape, on the device, holding the message from "
           "src with tag, received as a group of one and returned only once it has arrived "
           "(L09P2p.*, "
           "L09NcclSafe.*; README section 6 lists the calls)");
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

// ---------------------------------------------------------------------------------------------
// The executor
// ---------------------------------------------------------------------------------------------

StepStats run_schedule(Stage& stage, Comm& comm, const std::vector<Op>& ops, const Batch& batch,
                       int64_t micro_batches, bool deallocate_outputs, bool recompute) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  StepStats stats;
  const auto start = Clock::now();
  // TODO(L09)
  DTC_TODO("L09",
           "run ops in order so that the stage's parameters get the whole batch's mean "
           "gradient, each micro-batch's tensors freed after its backward, every send waited for "
           "before "
           "returning, a send started together with the next op's receive whenever both go to "
           "the same "
           "neighbour (dtc::batch_isend_irecv: the NCCL-safe pairing), a sent output's values "
           "freed "
           "when deallocate_outputs asks, with recompute only each micro-batch's input kept from "
           "its "
           "forward to its backward, and stats filled (L09Pipeline.*, L09Memory.*, "
           "L09NcclSafe.*, "
           "L09Recompute.*; README section 6 hints)");
  stats.total_s = seconds(Clock::now() - start);
  return stats;
}

}  // namespace dtc::l09
// generated from solutions/09_pipeline_parallel/pipeline.cpp; checksum 10be6a12ef681c5d

// Lesson 09 (given): a stage's parameters and forward, the checks, the schedules' names and
// printing, and the two autograd helpers the executor uses (deallocate_output,
// backward_from_graph). Your part is in pipeline.cpp; both implement pipeline.h.
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
  // The model's own pieces (dtc/model.h), as GptImpl::forward runs them: the embedding on
  // stage 0 (tokens (b, T) -> (b, T, h)), this stage's blocks, the head on the last stage.
  torch::Tensor x = layers.embed ? embed_tokens(wte, wpe, input)
                                 : input.to(working_dtype(precision));  // no-op in fp32
  const torch::Tensor first = x;             // the first tensor of the stage with a gradient
  for (auto& b : blocks) x = b->forward(x);  // (b, T, h)
  if (layers.head) x = head_logits(ln_f, lm_head, torch::Tensor(), x);  // (b, T, V), fp32
  x = x.to(torch::kFloat);  // the next stage's message in fp32 (no-op in fp32 or on the head)
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

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGpipe;
  if (name == "1f1b") return ScheduleKind::k1f1b;
  throw UsageError("--schedule", fmt::format("'{}' is not a schedule", name), "use gpipe or 1f1b");
}

const char* schedule_name(ScheduleKind kind) {
  return kind == ScheduleKind::kGpipe ? "gpipe" : "1f1b";
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

}  // namespace dtc::l09

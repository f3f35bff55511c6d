// Lesson 09: pipeline parallelism. Implements lessons/09_pipeline_parallel/pipeline.h.
//
// Fill in every TODO(L09) below, top to bottom: the split, the four schedules, send/recv, and
// the executor. `make test-lesson09` checks the schedules against the textbook order and the
// pipelined training against a single-process baseline on the same weights and batches; then
//   make run-lesson09 NPROC=4 ARGS="--micro-batches 4 --schedule 1f1b"
// runs the program on 4 ranks (one stage each). A stage's parameters and forward, the checks and
// the autograd helpers are given, in pipeline_given.cpp.
#include "pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "dtc/errors.h"
#include "dtc/todo.h"

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

// ---------------------------------------------------------------------------------------------
// Schedules
// ---------------------------------------------------------------------------------------------

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

std::vector<Op> interleaved_schedule(int stages, int64_t micro_batches, int stage, int chunks) {
  std::vector<Op> ops;
  // TODO(L09)
  DTC_TODO("L09",
           "every (chunk, micro-batch) forward and backward once, in the header's order "
           "(micro-batches in groups of p through each chunk), with the warm-up the header "
           "derives "
           "(L09Interleaved.*; README section 7 has hints)");
  return ops;
}

std::vector<Op> zb_h1_schedule(int stages, int64_t micro_batches, int stage) {
  std::vector<Op> ops;
  // TODO(L09)
  DTC_TODO("L09",
           "1F1B's forwards with an I where 1F1B has a B, and each W as late as the "
           "header says (L09ZeroBubble.*; README section 8 has hints)");
  return ops;
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

// ---------------------------------------------------------------------------------------------
// The executor
// ---------------------------------------------------------------------------------------------

StepStats run_schedule(std::vector<Stage>& chunks, Comm& comm, const std::vector<Op>& ops,
                       const Batch& batch, int64_t micro_batches, bool deallocate_outputs,
                       bool recompute) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  StepStats stats;
  const auto start = Clock::now();
  // TODO(L09)
  DTC_TODO("L09",
           "run ops in order so that every chunk's parameters get the whole batch's mean "
           "gradient, each micro-batch's tensors freed after its backward (split: after its W), "
           "every "
           "send waited for before returning, a send started together with the next op's receive "
           "whenever both go to the same neighbour (dtc::batch_isend_irecv: the NCCL-safe "
           "pairing; "
           "with chunks, Megatron's exchanges as the header says), a "
           "sent output's values freed when deallocate_outputs asks, with recompute only each "
           "micro-batch's input kept from its forward to its backward, and stats filled "
           "(L09Pipeline.*, L09Memory.*, L09NcclSafe.*, L09Recompute.*, L09Chunks.*, "
           "L09SplitBackward.*; "
           "README sections 6-8 hints)");
  stats.total_s = seconds(Clock::now() - start);
  return stats;
}

}  // namespace dtc::l09
// generated from solutions/09_pipeline_parallel/pipeline.cpp; checksum 72251eeb3aa8c62b

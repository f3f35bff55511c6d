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
  // BEGIN SOLUTION: stage's blocks [first, last) by the header's rule (as even as possible, the
  //   remainder to the first stages), in closed form, and its embed and head flags
  //   (L09Split.*; README section 6 hints)
  const int64_t base = layers / stages;
  const int64_t extra = layers % stages;
  s.first = stage * base + std::min<int64_t>(stage, extra);
  s.last = s.first + base + (stage < extra ? 1 : 0);
  s.embed = stage == 0;
  s.head = stage == stages - 1;
  // END SOLUTION
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
  // BEGIN SOLUTION: s.layers, and the very modules of full that this stage owns (shared, never
  //   copied): its blocks, the embeddings on stage 0, ln_f and lm_head on the last stage
  //   (L09Split.*; README section 6 hints)
  s.layers = stage_layers(config.layers, stages, stage);
  for (int64_t i = s.layers.first; i < s.layers.last; ++i) {
    s.blocks.push_back(Block(full->h->ptr<BlockImpl>(static_cast<size_t>(i))));
  }
  if (s.layers.embed) {
    s.wte = full->wte;
    s.wpe = full->wpe;
  }
  if (s.layers.head) {
    s.ln_f = full->ln_f;
    s.lm_head = full->lm_head;
  }
  // END SOLUTION
  return s;
}

// ---------------------------------------------------------------------------------------------
// Schedules
// ---------------------------------------------------------------------------------------------

std::vector<Op> gpipe_schedule(int stages, int64_t micro_batches, int stage) {
  (void)stages;
  (void)stage;
  std::vector<Op> ops;
  // BEGIN SOLUTION: every forward F0 .. F(m-1), then every backward B0 .. B(m-1), on every
  //   stage (L09Schedule.*)
  for (int64_t i = 0; i < micro_batches; ++i) ops.push_back({Op::kForward, i});
  for (int64_t i = 0; i < micro_batches; ++i) ops.push_back({Op::kBackward, i});
  // END SOLUTION
  return ops;
}

std::vector<Op> one_f_one_b_schedule(int stages, int64_t micro_batches, int stage) {
  std::vector<Op> ops;
  // BEGIN SOLUTION: warm-up forwards, then forward-backward pairs, then the backwards left,
  //   with the shortest warm-up that never waits on a gradient (Figure 4; README section 6 has
  //   hints; L09Schedule.* checks the papers' orders)
  const int64_t warmup = std::min<int64_t>(stages - stage - 1, micro_batches);
  for (int64_t i = 0; i < warmup; ++i) ops.push_back({Op::kForward, i});
  for (int64_t i = 0; i < micro_batches - warmup; ++i) {
    ops.push_back({Op::kForward, warmup + i});
    ops.push_back({Op::kBackward, i});
  }
  for (int64_t i = micro_batches - warmup; i < micro_batches; ++i) {
    ops.push_back({Op::kBackward, i});
  }
  // END SOLUTION
  return ops;
}

std::vector<Op> interleaved_schedule(int stages, int64_t micro_batches, int stage, int chunks) {
  std::vector<Op> ops;
  // BEGIN SOLUTION: every (chunk, micro-batch) forward and backward once, in the header's order
  //   (micro-batches in groups of p through each chunk), with the warm-up the header derives
  //   (L09Interleaved.*; README section 7 has hints)
  const int64_t p = stages, v = chunks;
  const int64_t total = v * micro_batches;
  auto micro = [&](int64_t k) { return (k / (p * v)) * p + k % p; };
  auto chunk = [&](int64_t k, bool forward) {
    const auto c = static_cast<int>((k % (p * v)) / p);
    return forward ? c : chunks - 1 - c;
  };
  auto forward = [&](int64_t k) { ops.push_back({Op::kForward, micro(k), chunk(k, true)}); };
  auto backward = [&](int64_t k) { ops.push_back({Op::kBackward, micro(k), chunk(k, false)}); };
  const int64_t warmup = std::min(2 * (p - stage - 1) + (v - 1) * p, total);
  for (int64_t k = 0; k < warmup; ++k) forward(k);
  for (int64_t k = 0; k < total - warmup; ++k) {
    forward(warmup + k);
    backward(k);
  }
  for (int64_t k = total - warmup; k < total; ++k) backward(k);
  // END SOLUTION
  return ops;
}

std::vector<Op> zb_h1_schedule(int stages, int64_t micro_batches, int stage) {
  std::vector<Op> ops;
  // BEGIN SOLUTION: 1F1B's forwards with an I where 1F1B has a B, and each W as late as the
  //   header says (L09ZeroBubble.*; README section 8 has hints)
  const int64_t warmup = std::min<int64_t>(micro_batches, stages - 1 - stage);  // 1F1B's
  int64_t forwards = 0, weights = 0;
  for (; forwards < warmup; ++forwards) ops.push_back({Op::kForward, forwards});
  for (int64_t i = 0; i < micro_batches; ++i) {
    if (forwards < micro_batches) ops.push_back({Op::kForward, forwards++});
    ops.push_back({Op::kInput, i});
    if (i >= stage) ops.push_back({Op::kWeight, weights++});
  }
  for (; weights < micro_batches; ++weights) ops.push_back({Op::kWeight, weights});
  // END SOLUTION
  return ops;
}

// ---------------------------------------------------------------------------------------------
// Point-to-point
// ---------------------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> send_tensor(Comm& comm, const torch::Tensor& tensor, int dst,
                                           int tag) {
  // BEGIN SOLUTION: start sending the tensor's values to dst with tag, as a group of one, and
  //   return the Work without waiting for it (L09P2p.*, L09NcclSafe.*; README section 6 lists
  //   the calls)
  auto works = batch_isend_irecv(comm, {{P2POp::kSend, tensor.contiguous(), dst, tag}});
  return works.empty() ? c10::intrusive_ptr<c10d::Work>() : works.front();
  // END SOLUTION
}

torch::Tensor recv_tensor(Comm& comm, at::IntArrayRef shape, int src, int tag,
                          const torch::Device& device) {
  // BEGIN SOLUTION: a fresh float tensor of the shape, on the device, holding the message from
  //   src with tag, received as a group of one and returned only once it has arrived (L09P2p.*,
  //   L09NcclSafe.*; README section 6 lists the calls)
  torch::Tensor buffer = torch::empty(shape, torch::dtype(torch::kFloat).device(device));
  for (auto& work : batch_isend_irecv(comm, {{P2POp::kRecv, buffer, src, tag}})) work->wait();
  return buffer;
  // END SOLUTION
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
  // BEGIN SOLUTION: run ops in order so that every chunk's parameters get the whole batch's mean
  //   gradient, each micro-batch's tensors freed after its backward (split: after its W), every
  //   send waited for before returning, a send started together with the next op's receive
  //   whenever both go to the same neighbour (dtc::batch_isend_irecv: the NCCL-safe pairing;
  //   with chunks, Megatron's exchanges as the header says), a
  //   sent output's values freed when deallocate_outputs asks, with recompute only each
  //   micro-batch's input kept from its forward to its backward, and stats filled
  //   (L09Pipeline.*, L09Memory.*, L09NcclSafe.*, L09Recompute.*, L09Chunks.*, L09SplitBackward.*;
  //   README sections 6-8 hints)
  const int s = comm.getRank();
  const int p = comm.getSize();
  const int prev = (s + p - 1) % p;  // the rank of the virtual stage before (chunks wrap around)
  const int next_rank = (s + 1) % p;
  const int64_t rows = batch.inputs.size(0) / micro_batches;  // b / m
  const int64_t T = batch.inputs.size(1);
  const std::vector<int64_t> act_shape{rows, T, chunks.front().config.hidden};  // (b/m, T, h)
  const torch::Device device = batch.inputs.device();  // where this stage computes
  // Whom an op receives from (-1: nobody): a forward its activation from the virtual stage
  // before, a backward (or I) its gradient from the one after; a W nothing.
  auto source = [&](const Op& op) {
    const StageLayers& l = chunks[static_cast<size_t>(op.chunk)].layers;
    if (op.kind == Op::kWeight) return -1;
    return op.kind == Op::kForward ? (l.embed ? -1 : prev) : (l.head ? -1 : next_rank);
  };
  // The tag of the message an op receives (its micro-batch, its chunk), and of the one it sends
  // (the receiver's chunk: the next chunk's when the ring wraps around).
  auto tag = [](const Op& op) {
    return op.kind == Op::kForward ? activation_tag(op.micro, op.chunk)
                                   : gradient_tag(op.micro, op.chunk);
  };
  auto sent_tag = [&](const Op& op) {
    return op.kind == Op::kForward ? activation_tag(op.micro, op.chunk + (s == p - 1 ? 1 : 0))
                                   : gradient_tag(op.micro, op.chunk - (s == 0 ? 1 : 0));
  };
  // The last stage's loss of micro-batch i from its logits: its mean cross-entropy / m.
  auto micro_loss = [&](const torch::Tensor& logits, int64_t micro) {
    auto targets = batch.targets.narrow(0, micro * rows, rows);  // (b/m, T)
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                targets.reshape({-1})) /
           static_cast<double>(micro_batches);
  };
  using PerMicro = std::vector<torch::Tensor>;
  const PerMicro none(static_cast<size_t>(micro_batches));
  std::vector<PerMicro> inputs_of(chunks.size(), none);
  std::vector<PerMicro> outputs_of(chunks.size(), none);  // or scaled losses
  std::vector<PerMicro> grads_of(chunks.size(), none);    // an output's gradient, from I to W
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;      // waited for at the end
  torch::Tensor ahead;  // the next op's message, received together with this op's send
  std::vector<c10::intrusive_ptr<c10d::Work>> ahead_works;
  int64_t in_flight = 0;
  double loss_sum = 0;
  // Interleaved (chunks wrap around the ranks): Megatron's exchanges instead of the pairing.
  const bool interleaved = chunks.size() > 1;
  std::vector<P2POp> held;                            // sends held back for the next exchange
  std::vector<torch::Tensor> prefetched(ops.size());  // messages received ahead, by op
  // The steady state's pairs (F, B) are ops w, w + 1; w + 2, w + 3; ... after the rank's
  // warm-up of w forwards (Megatron's count; all v m forwards when it has no steady state).
  const auto total = static_cast<int64_t>(ops.size() / 2);
  const int64_t v = static_cast<int64_t>(chunks.size());
  const int64_t warm = std::min<int64_t>(2 * (p - s - 1) + (v - 1) * p, total);
  auto pair_forward = [&](size_t k) {
    const auto j = static_cast<int64_t>(k);
    return interleaved && j >= warm && j < 2 * total - warm && (j - warm) % 2 == 0;
  };
  for (size_t k = 0; k < ops.size(); ++k) {
    if (pair_forward(k) && (ops[k].kind != Op::kForward || ops[k + 1].kind != Op::kBackward)) {
      throw std::invalid_argument(fmt::format(
          "run_schedule: ops {} and {} of rank {} are not a forward and a backward, but the "
          "interleaved schedule's warm-up of {} forwards makes them a steady-state pair: give "
          "it interleaved_schedule()'s order",
          k, k + 1, s, warm));
    }
  }
  // One exchange, as one group: the sends held back, the receive of op k and, when op k is a
  // steady pair's forward, its backward's too.
  auto exchange = [&](size_t k) {
    std::vector<P2POp> group = std::move(held);
    held.clear();
    auto receive = [&](size_t j) {
      if (j >= ops.size() || source(ops[j]) < 0 || prefetched[j].defined()) return;
      prefetched[j] = torch::empty(act_shape, torch::dtype(torch::kFloat).device(device));
      group.push_back({P2POp::kRecv, prefetched[j], source(ops[j]), tag(ops[j])});
    };
    receive(k);
    if (pair_forward(k)) receive(k + 1);
    if (!group.empty()) {
      for (auto& work : batch_isend_irecv(comm, group)) work->wait();
    }
  };
  for (size_t k = 0; k < ops.size(); ++k) {
    const Op& op = ops[k];
    const auto i = static_cast<size_t>(op.micro);
    Stage& stage = chunks[static_cast<size_t>(op.chunk)];
    PerMicro& inputs = inputs_of[static_cast<size_t>(op.chunk)];
    PerMicro& outputs = outputs_of[static_cast<size_t>(op.chunk)];
    PerMicro& grads = grads_of[static_cast<size_t>(op.chunk)];
    const bool first = stage.layers.embed;
    const bool last = stage.layers.head;
    const bool split = op.kind == Op::kInput || op.kind == Op::kWeight;
    if (split && (recompute || deallocate_outputs)) {
      throw std::invalid_argument(
          "run_schedule: a split backward (I, W) needs each micro-batch's graph whole: not with "
          "recompute or deallocate_outputs");
    }
    // 1. The message this op needs: already on its way if it was paired with the last send.
    torch::Tensor message;
    if (interleaved && source(op) >= 0) {
      if (!prefetched[k].defined()) exchange(k);
      message = prefetched[k];
      prefetched[k] = torch::Tensor();
    } else if (source(op) >= 0) {
      if (ahead.defined()) {
        for (auto& work : ahead_works) work->wait();
        ahead_works.clear();
        message = ahead;
        ahead = torch::Tensor();
      } else {
        message = recv_tensor(comm, act_shape, source(op), tag(op), device);
      }
    }
    // 2. The op itself, and what it sends on (to whom; the receiver's tag, sent_tag(op)).
    torch::Tensor outgoing;
    int dest = -1;
    const auto t0 = Clock::now();
    if (op.kind == Op::kForward) {
      torch::Tensor input = first ? batch.inputs.narrow(0, op.micro * rows, rows)  // (b/m, T)
                                  : message.requires_grad_(true);  // backward gives its gradient
      torch::Tensor out;
      {
        // With recompute nothing of the stage's insides is saved: backward runs it again.
        c10::AutoGradMode grad_mode(!recompute);
        out = stage.forward(input);
        if (last) out = micro_loss(out, op.micro);
      }
      if (last) {
        loss_sum += out.item<double>();
      } else {
        outgoing = out.detach();
        dest = next_rank;
      }
      inputs[i] = input;
      if (!recompute) outputs[i] = out;
      stats.max_in_flight = std::max(stats.max_in_flight, ++in_flight);
    } else if (op.kind == Op::kInput) {
      // I: the input's gradient only (the first chunk's input is the tokens: nothing to do), the
      // graph kept for W, and the output's gradient with it.
      if (!first) {
        outgoing = torch::autograd::grad(
            {outputs[i]}, {inputs[i]},
            last ? torch::autograd::variable_list{} : torch::autograd::variable_list{message},
            /*retain_graph=*/true)[0];
        dest = prev;
      }
      grads[i] = message;  // (undefined on the last chunk: its output is the loss)
    } else if (op.kind == Op::kWeight) {
      // W: the weight gradients from the same graph, which is freed then.
      torch::autograd::backward(
          {outputs[i]},
          last ? torch::autograd::variable_list{} : torch::autograd::variable_list{grads[i]},
          /*retain_graph=*/false, /*create_graph=*/false, stage.parameters());
      inputs[i] = torch::Tensor();
      outputs[i] = torch::Tensor();
      grads[i] = torch::Tensor();
      --in_flight;
    } else {
      if (recompute) {
        // The stage's forward again, from the input it kept, now recording the graph.
        torch::Tensor in = first ? inputs[i] : inputs[i].detach().requires_grad_(true);
        torch::Tensor y = stage.forward(in);
        if (last) {
          micro_loss(y, op.micro).backward();
        } else {
          torch::autograd::backward({y}, {message});
        }
        inputs[i] = in;  // its gradient is what goes back
      } else if (last) {
        outputs[i].backward();
      } else if (deallocate_outputs) {
        backward_from_graph(outputs[i], message);  // its values were freed after the send
      } else {
        torch::autograd::backward({outputs[i]}, {message});
      }
      if (!first) {
        outgoing = inputs[i].grad();
        dest = prev;
      }
      inputs[i] = torch::Tensor();  // the micro-batch's activations are freed here
      outputs[i] = torch::Tensor();
      --in_flight;
    }
    stats.compute_s += seconds(Clock::now() - t0);
    // 3. The send, paired with the next op's receive when that comes from the same neighbour
    //    (1F1B's steady state: Megatron's send_forward_recv_backward / send_backward_recv_forward).
    //    With chunks, Megatron's exchanges: a steady pair's forward holds its send for its
    //    backward's exchange; after any other op, one exchange with the next op's receives,
    //    even when the op sends nothing (the first chunk's backward, the last chunk's forward):
    //    skipping it would keep the held send, and the next pair's gradient, a pair longer.
    if (interleaved) {
      if (dest >= 0) held.push_back({P2POp::kSend, outgoing.contiguous(), dest, sent_tag(op)});
      if (!pair_forward(k)) exchange(k + 1);
    } else if (dest >= 0) {
      // The next op that receives (a W neither receives nor sends: ZB-H1's I pairs with the
      // forward after the W that follows it, else each I's send would wait alone until the end).
      size_t after = k + 1;
      while (after < ops.size() && ops[after].kind == Op::kWeight) ++after;
      const Op* next = after < ops.size() ? &ops[after] : nullptr;
      if (next != nullptr && source(*next) == dest) {
        ahead = torch::empty(act_shape, torch::dtype(torch::kFloat).device(device));
        ahead_works =
            batch_isend_irecv(comm, {{P2POp::kSend, outgoing.contiguous(), dest, sent_tag(op)},
                                     {P2POp::kRecv, ahead, dest, tag(*next)}});
      } else {
        sends.push_back(send_tensor(comm, outgoing, dest, sent_tag(op)));
      }
    }
    if (dest < 0) continue;
    // The send holds the values it sends (outgoing shares their storage) until it is done; the
    // output keeps only its graph.
    if (deallocate_outputs && !recompute && op.kind == Op::kForward) {
      deallocate_output(outputs[i]);  // (recomputing, nothing of the output is kept anyway)
    }
  }
  if (!held.empty()) exchange(ops.size());
  for (auto& work : sends) work->wait();
  stats.loss = static_cast<float>(loss_sum);
  // END SOLUTION
  stats.total_s = seconds(Clock::now() - start);
  return stats;
}

}  // namespace dtc::l09

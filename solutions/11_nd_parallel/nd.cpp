// Lesson 11: what only the composition needs. Fill in the TODO(L11) regions; nd.h says what each
// function must do, README.md teaches it, and `make test-lesson11` checks it against one device.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtc/todo.h"
#include "nd.h"

namespace dtc::l11 {

Reduction gradient_reduction(const Mesh& mesh) {
  // BEGIN SOLUTION: return the group (mesh dims) and divisor after which every rank holds the
  //   single device's gradient of the global batch's mean loss, or its tp slice; write norm_dims
  //   too, which make_groups needs (L11Groups.*, L11OneStep.*; README section 3)
  // dp_replicate, or dp_shard under ZeRO: the other has size 1 and adds no rank
  const std::vector<std::string> dims{"dp_replicate", "dp_shard", "cp"};
  return Reduction{dims, mesh.size(dims)};
  // END SOLUTION
}

void sync_tied_embedding(RankModel& model, Comm* embedding) {
  if (!model.tied) return;
  // BEGIN SOLUTION: make both copies' gradients (wte.weight on the first stage, lm_head.weight on
  //   the last) the sum of the two, with `embedding` or, pp 1, on this rank
  //   (L11OneStep.*_tied; README section 4)
  torch::Tensor wte_grad, head_grad;
  for (auto& chunk : model.chunks) {
    if (chunk.layers.embed) wte_grad = chunk.wte->weight.mutable_grad();
    if (chunk.layers.head) head_grad = chunk.lm_head->weight.mutable_grad();
  }
  torch::NoGradGuard no_grad;
  if (wte_grad.defined() && head_grad.defined() && embedding == nullptr) {
    wte_grad.add_(head_grad);
    head_grad.copy_(wte_grad);
    return;
  }
  torch::Tensor mine = wte_grad.defined() ? wte_grad : head_grad;
  if (!mine.defined()) return;  // neither the first nor the last stage
  if (embedding == nullptr) {
    throw std::invalid_argument(
        "sync_tied_embedding: a stage holds one copy of the tied "
        "embedding but has no embedding group");
  }
  std::vector<at::Tensor> v{mine};
  embedding->allreduce(v)->wait();
  // END SOLUTION
}

std::vector<std::string> norm_dims(const Mesh& mesh, int zero_stage) {
  (void)mesh;
  (void)zero_stage;
  // BEGIN SOLUTION: return the dims of a group whose ranks together hold every parameter (or its
  //   slices), and no two of them the same reduced gradient unless they must
  //   (L11Groups.*, L11Clip.*; README section 5)
  // ZeRO's reduce-scatter leaves every rank of dp_shard x cp its own shard: the whole world (as
  // Megatron's distributed optimizer reduces its norm), but one HSDP replica group, whose shards
  // the others hold too
  if (zero_stage > 0) return {"pp", "dp_shard", "cp", "tp"};
  return {"pp", "tp"};
  // END SOLUTION
}

double global_grad_norm(const RankModel& model, Comm& norm, double norm_type) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  if (!inf && norm_type != 2) {
    throw std::invalid_argument(
        fmt::format("global_grad_norm: norm type {} (2 or inf)", norm_type));
  }
  // BEGIN SOLUTION: return the whole model's gradient norm (2 or inf) as clip_grad_norm_ on one
  //   device computes it, each parameter counted once, the same on every rank of `norm`
  //   (L11Clip.*, L11ClipInf.*; README section 5)
  double local = 0;
  for (const auto& chunk : model.chunks) {
    for (const auto& [name, param] : l09::stage_pieces(chunk)) {
      if (model.tied && name == "lm_head.weight") continue;   // wte.weight's copy
      if (!tp_sharded(name) && model.tp_rank != 0) continue;  // tp rank 0 counts it
      const torch::Tensor g = param.grad();
      if (!g.defined()) continue;
      const torch::Tensor d = g.detach().to(torch::kDouble);
      if (inf) {
        local = std::max(local, d.abs().max().item<double>());
      } else {
        local += d.square().sum().item<double>();
      }
    }
  }
  const torch::Device device = model.chunks.front().parameters().front().device();
  auto t = torch::full({1}, local, torch::dtype(torch::kDouble).device(device));
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  norm.allreduce(v, opts)->wait();
  const double total = t.cpu().item<double>();
  return inf ? total : std::sqrt(total);
  // END SOLUTION
}

double clip_grad_norm(RankModel& model, Comm& norm, double max_norm, double norm_type) {
  const double total = global_grad_norm(model, norm, norm_type);
  // BEGIN SOLUTION: when max_norm / (total + 1e-6) is below 1, every gradient this rank holds
  //   multiplied by it, as clip_grad_norm_ does on one device (L11Clip.*, L11ClipAbove.*;
  //   README section 5)
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (auto& chunk : model.chunks) {
      for (auto p : chunk.parameters()) {
        if (p.grad().defined()) p.mutable_grad().mul_(coef);
      }
    }
  }
  // END SOLUTION
  return total;
}

void sync_sequence_parallel(RankModel& model, Comm& tp) {
  if (!model.sequence_parallel || tp.getSize() == 1) return;
  // BEGIN SOLUTION: sum over tp the gradients of the parameters each tp rank computed from its
  //   own rows of the sequence, and only those (L11OneStep.*_sp_*; README section 5b)
  torch::NoGradGuard no_grad;
  for (auto& chunk : model.chunks) {
    for (const auto& [name, param] : l09::stage_pieces(chunk)) {
      // a block's tp-whole parameters: its LayerNorms and row-parallel biases
      if (name.rfind("h.", 0) != 0 || tp_sharded(name) || !param.grad().defined()) continue;
      std::vector<at::Tensor> g{param.mutable_grad()};
      tp.allreduce(g)->wait();
    }
  }
  // END SOLUTION
}

}  // namespace dtc::l11

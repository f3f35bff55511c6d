// Lesson 12 (given): a rank's training state as checkpoint pieces, on any of lesson 11's meshes.
#include <fmt/format.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtc/compat.h"
#include "dtc/errors.h"
#include "state.h"

namespace dtc::l12 {

namespace {

bool has(const std::string& name, const char* part) { return name.find(part) != std::string::npos; }

// The dimension of logical_shape() that lesson 08 splits over tp, or -1 (held whole).
int split_dim(const std::string& name) {
  if (!l11::tp_sharded(name)) return -1;
  if (has(name, ".c_attn.")) return 1;  // (3, h, h) and (3, h): each of q, k, v by rows
  if (has(name, ".c_fc.")) return 0;    // column-parallel: rows
  return 1;                             // c_proj's weight, row-parallel: columns
}

torch::optim::AdamWParamState& adamw_state(torch::optim::AdamW& adamw, const torch::Tensor& t) {
  auto* state = static_cast<torch::optim::AdamWParamState*>(optimizer_state(adamw, t));
  if (state == nullptr) {  // as AdamW's first step makes it
    auto made = std::make_unique<torch::optim::AdamWParamState>();
    made->step(0);
    made->exp_avg(torch::zeros_like(t, torch::MemoryFormat::Preserve));
    made->exp_avg_sq(torch::zeros_like(t, torch::MemoryFormat::Preserve));
    state =
        static_cast<torch::optim::AdamWParamState*>(set_optimizer_state(adamw, t, std::move(made)));
  }
  return *state;
}

}  // namespace

std::string state_key(const std::string& kind, const std::string& name) {
  return kind + "/" + name;
}

std::vector<int64_t> logical_shape(const std::string& name,
                                   const std::vector<int64_t>& full_shape) {
  if (has(name, ".attn.c_attn.")) {
    std::vector<int64_t> shape{3, full_shape.at(0) / 3};
    shape.insert(shape.end(), full_shape.begin() + 1, full_shape.end());
    return shape;
  }
  return full_shape;
}

std::vector<StatePiece> rank_state(l11::NdTrainer& trainer, const l11::NdGroups& groups,
                                   const l11::NdOptions& o) {
  if (o.precision != Precision::kFp32) {
    throw UsageError(
        "--precision",
        fmt::format("{}: lesson 12's checkpoint saves fp32 tensors", precision_name(o.precision)),
        "train in fp32 (--precision fp32, the default)");
  }
  // The whole model's shapes, by name.
  std::map<std::string, std::vector<int64_t>> full;
  for (const auto& item : Gpt(o.model)->named_parameters()) {
    full[item.key()] = item.value().sizes().vec();
  }
  const l11::RankModel& model = trainer.model();
  std::map<const void*, l11::OptimizerSlot> slot_of;
  for (const l11::OptimizerSlot& slot : trainer.slots()) {
    slot_of[slot.param.unsafeGetTensorImpl()] = slot;
  }
  torch::optim::AdamW* adamw = trainer.optimizer();
  const Mesh& mesh = groups.mesh;
  const bool zero = groups.zero_stage > 0;
  const bool first_replica =
      zero ? mesh.coord(groups.rank, "dp_replicate") == 0
           : mesh.coord(groups.rank, std::vector<std::string>{"dp_replicate", "dp_shard"}) == 0 &&
                 mesh.coord(groups.rank, "cp") == 0;

  std::vector<StatePiece> pieces;
  for (const auto& chunk : model.chunks) {
    for (const auto& [held_name, param] : l09::stage_pieces(chunk)) {
      const bool tied_head = model.tied && held_name == "lm_head.weight";
      const std::string name = tied_head ? "wte.weight" : held_name;
      const std::vector<int64_t> global = logical_shape(name, full.at(name));
      // This rank's tp box of the whole tensor.
      Box tp_box{std::vector<int64_t>(global.size(), 0), global};
      const int dim = model.tp > 1 ? split_dim(name) : -1;
      if (dim >= 0) {
        tp_box.sizes[dim] = global[dim] / model.tp;
        tp_box.offsets[dim] = tp_box.sizes[dim] * model.tp_rank;
      }
      const bool writer = !tied_head && first_replica && (dim >= 0 || model.tp_rank == 0);
      const l11::OptimizerSlot& slot = slot_of.at(param.unsafeGetTensorImpl());
      if (!slot.stepped.defined()) continue;  // ZeRO: this rank owns none of it
      torch::optim::AdamWParamState& state = adamw_state(*adamw, slot.stepped);
      const std::vector<std::pair<std::string, torch::Tensor>> tensors{
          {"model", slot.stepped.detach()},
          {"exp_avg", state.exp_avg()},
          {"exp_avg_sq", state.exp_avg_sq()}};
      for (const auto& [kind, tensor] : tensors) {
        if (!zero) {
          pieces.push_back(
              {state_key(kind, name), global, tp_box, tensor.view(tp_box.sizes), writer});
          continue;
        }
        // ZeRO: the shard, flattened elements [begin, begin + numel) of the tp-local tensor.
        int64_t at = 0;
        for (Box box : flat_range_boxes(tp_box.sizes, slot.begin, slot.begin + tensor.numel())) {
          const int64_t n = box.numel();
          auto view = tensor.narrow(0, at, n).view(box.sizes);
          for (size_t d = 0; d < box.offsets.size(); ++d) box.offsets[d] += tp_box.offsets[d];
          pieces.push_back({state_key(kind, name), global, box, view, writer});
          at += n;
        }
      }
    }
  }
  return pieces;
}

void state_loaded(l11::NdTrainer& trainer, int64_t step) {
  torch::optim::AdamW* adamw = trainer.optimizer();
  if (adamw != nullptr) {
    for (const l11::OptimizerSlot& slot : trainer.slots()) {
      if (slot.stepped.defined()) adamw_state(*adamw, slot.stepped).step(step);
    }
  }
  trainer.shards_written();
}

}  // namespace dtc::l12

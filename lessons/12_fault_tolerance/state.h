// Lesson 12: a rank's training state as checkpoint pieces (given, in state_given.cpp). Lesson
// 11's NdTrainer on any of its meshes (dp, ZeRO 1-3 and HSDP, tp, pp with its chunks, cp), in
// fp32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "nd.h"

namespace dtc::l12 {

/// The key of a whole tensor of the model: "model/NAME" for a parameter, "exp_avg/NAME" and
/// "exp_avg_sq/NAME" for AdamW's moments of it (NAME as the single-device Gpt calls it).
std::string state_key(const std::string& kind, const std::string& name);

/// The shape every mesh sees parameter @p name of @p full_shape as: c_attn's (3 h, h) weight as
/// (3, h, h) and its bias as (3, h), so that each tp rank's q, k and v rows are one box (lesson 08
/// gives a tp rank rows [r h / tp, (r + 1) h / tp) of each of q, k and v); every other parameter
/// as it is.
std::vector<int64_t> logical_shape(const std::string& name, const std::vector<int64_t>& full_shape);

/// This rank's state, as the pieces a checkpoint saves and loads: every parameter it holds and
/// AdamW's two moments of it, each a box of the whole tensor under state_key(), its tensor a view
/// of the rank's own (so that loading into it restores them):
///   - without ZeRO, the whole parameter or its tp slice (one box along the split dimension);
///     written by the first replica: dp and cp coordinates 0, and tp rank 0 for what every tp
///     rank holds whole;
///   - with ZeRO (1-3, HSDP), the rank's fp32 shard of each (a flat range of the tp-local tensor:
///     flat_range_boxes()), the parameter's and its moments' alike; written by the ranks of
///     dp_replicate coordinate 0 (HSDP's first group), and tp rank 0 for what every tp rank holds
///     whole;
///   - the tied head (lm_head.weight when options.model.tied) is loaded from wte.weight's keys and
///     never written.
/// Makes AdamW's state (zeros, step 0) for a tensor that has none yet, as its first step would.
/// @throws UsageError("--precision") for bf16 (the checkpoint saves fp32 tensors)
std::vector<StatePiece> rank_state(l11::NdTrainer& trainer, const l11::NdGroups& groups,
                                   const l11::NdOptions& options);

/// After loading: AdamW's step count of every tensor it steps set to @p step (its bias
/// correction reads it), and (ZeRO) every rank's shards gathered into the parameters.
void state_loaded(l11::NdTrainer& trainer, int64_t step);

}  // namespace dtc::l12

// A parallel layout as one string, the planner's grammar (lesson 01's --compare and plan.mix,
// lesson 11's --mix):
//
//   DPxTPxPPxCP[:ZERO[:RECOMPUTE[:MICRO[:VIRTUAL]]]]      e.g. 2x2x2x1:1:none:1:2
//
// DP data-parallel replicas, TP tensor-parallel degree, PP pipeline stages, CP context-parallel
// degree (their product is the world size); ZERO the ZeRO stage 0-3, or hsdpN for ZeRO-3
// sharded over groups of N data-parallel ranks and replicated across them (FSDP's
// HYBRID_SHARD); RECOMPUTE none, selective or full; MICRO sequences per micro-batch; VIRTUAL
// model chunks per pipeline stage (interleaved 1F1B when above 1). Plain C++ (the core layer).
#pragma once

#include <cstdint>
#include <string>

namespace dtc {

/// A parsed mix. Fields left out of the text keep these defaults.
struct MixSpec {
  int64_t dp = 1;
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t cp = 1;
  int zero_stage = 0;
  int64_t shard = 0;               ///< hsdpN: N (zero_stage is then 3); 0: no HSDP
  std::string recompute = "none";  ///< none, selective or full
  int64_t micro_batch = 1;         ///< sequences per micro-batch
  int64_t virtual_stages = 1;      ///< model chunks per pipeline stage

  /// dp x tp x pp x cp: the ranks the mix needs (at most 2^31 for a mix parse_mix() gave).
  int64_t world() const { return dp * tp * pp * cp; }
  /// The mix in the grammar, every field written ("2x2x2x1:hsdp2:full:1:2"): parse_mix() of it
  /// gives this mix back.
  std::string text() const;
};

/// Parses @p text (the grammar above).
/// @throws UsageError(@p flag) when it does not follow the grammar, has a degree, a
///   micro-batch, a virtual-stage count below 1 or an HSDP group below 2 (the message names the
///   field), or asks more than 2^31 ranks; the hint gives the grammar and an example.
MixSpec parse_mix(const std::string& text, const std::string& flag);

/// What a mix must fit: the model's shape, the batch and the ranks launched.
struct MixShape {
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t seq = 0;    ///< tokens per sequence
  int64_t world = 0;  ///< ranks launched
  int64_t batch = 0;  ///< sequences per optimizer step; 0: not checked
};

/// Checks that @p mix can run on @p shape, before any networking: what the mix alone decides.
/// (The attention's own rules under cp, zig-zag's 2 cp dividing the sequence and Ulysses' heads,
/// are lesson 10's validate_cp.)
/// @throws UsageError(@p flag) naming the first misfit and its fix: the product of the degrees is
///   not the world size; tp does not divide the heads; pp is above the layers; virtual stages
///   need pp >= 2 and the layers in pp x virtual equal chunks (lesson 09's rule, stricter than
///   lesson 01's planner, which allows uneven stages); cp does not divide the sequence; HSDP's
///   group does not divide dp, or is used with cp above 1; the batch does not split into dp x
///   micro-batch rows, or (interleaved) into a multiple of pp micro-batches per replica.
void check_mix(const MixSpec& mix, const MixShape& shape, const std::string& flag);

}  // namespace dtc

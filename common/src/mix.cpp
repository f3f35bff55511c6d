#include "dtc/mix.h"

#include <fmt/format.h>

#include <regex>
#include <utility>

#include "dtc/errors.h"

namespace dtc {

namespace {

const char* const kGrammar =
    "give DPxTPxPPxCP[:ZERO[:RECOMPUTE[:MICRO[:VIRTUAL]]]]: ZERO 0-3 or hsdpN, RECOMPUTE none, "
    "selective or full, e.g. 2x2x2x1:1:none:1:2 (dp 2, tp 2, pp 2, ZeRO-1, 2 virtual stages)";

}  // namespace

std::string MixSpec::text() const {
  const std::string zero = shard > 0 ? fmt::format("hsdp{}", shard) : std::to_string(zero_stage);
  return fmt::format("{}x{}x{}x{}:{}:{}:{}:{}", dp, tp, pp, cp, zero, recompute, micro_batch,
                     virtual_stages);
}

MixSpec parse_mix(const std::string& text, const std::string& flag) {
  static const std::regex mix_re(
      R"((\d{1,9})x(\d{1,9})x(\d{1,9})x(\d{1,9}))"
      R"((?::([0-3]|hsdp\d{1,9})(?::(none|selective|full)(?::(\d{1,9})(?::(\d{1,9}))?)?)?)?)");
  std::smatch m;
  if (!std::regex_match(text, m, mix_re)) {
    throw UsageError(flag, fmt::format("'{}' is not a mix", text), kGrammar);
  }
  MixSpec mix;
  mix.dp = std::stoll(m[1]);
  mix.tp = std::stoll(m[2]);
  mix.pp = std::stoll(m[3]);
  mix.cp = std::stoll(m[4]);
  if (m[5].matched) {
    const std::string zero = m[5];
    if (zero.rfind("hsdp", 0) == 0) {
      mix.zero_stage = 3;
      mix.shard = std::stoll(zero.substr(4));
      if (mix.shard < 2) {
        throw UsageError(flag, fmt::format("'{}' asks HSDP over groups of {}", text, mix.shard),
                         "HSDP shards over groups of 2 or more data-parallel ranks (hsdp2, "
                         "hsdp4, ...); for no sharding use ZeRO 0");
      }
    } else {
      mix.zero_stage = std::stoi(zero);
    }
  }
  if (m[6].matched) mix.recompute = m[6];
  if (m[7].matched) mix.micro_batch = std::stoll(m[7]);
  if (m[8].matched) mix.virtual_stages = std::stoll(m[8]);
  const std::pair<const char*, int64_t> fields[] = {{"DP", mix.dp},
                                                    {"TP", mix.tp},
                                                    {"PP", mix.pp},
                                                    {"CP", mix.cp},
                                                    {"MICRO", mix.micro_batch},
                                                    {"VIRTUAL", mix.virtual_stages}};
  for (const auto& [field, value] : fields) {
    if (value < 1) {
      throw UsageError(flag, fmt::format("'{}' has {} {}, below 1", text, field, value), kGrammar);
    }
  }
  // Each degree has at most 9 digits; their product can still overflow: bound it as it grows.
  int64_t world = 1;
  for (const int64_t degree : {mix.dp, mix.tp, mix.pp, mix.cp}) {
    if (degree > (int64_t{1} << 31) / world) {
      throw UsageError(flag, fmt::format("'{}' asks more than 2^31 ranks", text), kGrammar);
    }
    world *= degree;
  }
  return mix;
}

void check_mix(const MixSpec& mix, const MixShape& shape, const std::string& flag) {
  const std::string text = mix.text();
  if (mix.world() != shape.world) {
    throw UsageError(flag,
                     fmt::format("{} needs dp x tp x pp x cp = {} ranks, but {} were launched",
                                 text, mix.world(), shape.world),
                     fmt::format("launch {} ranks (torchrun --nproc_per_node={}), or give a mix "
                                 "whose degrees multiply to {}",
                                 mix.world(), mix.world(), shape.world));
  }
  if (shape.heads % mix.tp != 0) {
    throw UsageError(
        flag,
        fmt::format("{}: tp {} does not divide the model's {} heads", text, mix.tp, shape.heads),
        "tensor parallelism gives each rank whole heads: use a tp that divides "
        "--heads");
  }
  if (mix.pp > shape.layers) {
    throw UsageError(flag,
                     fmt::format("{}: pp {} is more stages than the model's {} layers", text,
                                 mix.pp, shape.layers),
                     "a stage holds at least one layer: use pp <= --layers");
  }
  if (mix.virtual_stages > 1 && mix.pp < 2) {
    throw UsageError(
        flag,
        fmt::format("{}: {} virtual stages need a pipeline, but pp is 1", text, mix.virtual_stages),
        "use pp >= 2 with virtual stages, or VIRTUAL 1");
  }
  if (mix.virtual_stages > 1 && shape.layers % (mix.pp * mix.virtual_stages) != 0) {
    throw UsageError(
        flag,
        fmt::format("{}: {} virtual stages need the {} layers in pp x {} = {} equal chunks", text,
                    mix.virtual_stages, shape.layers, mix.virtual_stages,
                    mix.pp * mix.virtual_stages),
        "use a virtual-stage count that divides the layers per stage, or 1 (plain 1F1B)");
  }
  if (shape.seq % mix.cp != 0) {
    throw UsageError(
        flag,
        fmt::format("{}: cp {} does not divide the sequence of {} tokens", text, mix.cp, shape.seq),
        "context parallelism gives each rank an equal part of every sequence: use a "
        "cp that divides --seq");
  }
  if (mix.shard > 0 && (mix.cp != 1 || mix.dp % mix.shard != 0)) {
    throw UsageError(flag,
                     fmt::format("{}: HSDP over groups of {} needs cp 1 and a group that divides "
                                 "dp {}",
                                 text, mix.shard, mix.dp),
                     "use an hsdpN whose N divides dp, with cp 1");
  }
  if (shape.batch > 0) {
    const int64_t rows = mix.dp * mix.micro_batch;
    if (shape.batch % rows != 0) {
      throw UsageError(flag,
                       fmt::format("{}: the batch of {} sequences does not split into dp {} x "
                                   "micro-batch {} = {} rows",
                                   text, shape.batch, mix.dp, mix.micro_batch, rows),
                       fmt::format("use a batch that is a multiple of {} (--global-batch), or "
                                   "another DP or MICRO",
                                   rows));
    }
    const int64_t micro_batches = shape.batch / rows;  // per replica, per step
    if (mix.virtual_stages > 1 && micro_batches % mix.pp != 0) {
      throw UsageError(
          flag,
          fmt::format("{}: interleaving runs micro-batches in groups of pp {}, but "
                      "each replica gets {} per step",
                      text, mix.pp, micro_batches),
          fmt::format("use a batch of a multiple of {} sequences, or VIRTUAL 1", rows * mix.pp));
    }
  }
}

}  // namespace dtc

// Lesson 12: the distributed checkpoint. Fill in the TODO(L12) regions; checkpoint.h says what
// each function must do, README.md teaches it, and `make test-lesson12` checks it.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "dtc/todo.h"

namespace dtc::l12 {

std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.offsets.size() != b.offsets.size()) {
    throw std::invalid_argument(fmt::format("intersect: a box of {} dimensions and one of {}",
                                            a.offsets.size(), b.offsets.size()));
  }
  // TODO(L12)
  DTC_TODO("L12",
           "return the box of the elements both boxes hold, in every dimension the "
           "later start to the earlier end; nothing when a dimension has none (L12Boxes.*; "
           "README "
           "section 3)");
}

namespace {

std::string bytes_of(const torch::Tensor& t) {
  return std::string(static_cast<const char*>(t.data_ptr()),
                     static_cast<size_t>(t.numel()) * t.element_size());
}

}  // namespace

ShardFile write_shard(Fs& fs, const std::string& dir, int rank,
                      const std::vector<StatePiece>& pieces) {
  for (const StatePiece& p : pieces) {
    if (!p.write) continue;
    if (p.tensor.scalar_type() != torch::kFloat || !p.tensor.is_contiguous() ||
        p.tensor.sizes().vec() != p.box.sizes) {
      throw std::invalid_argument(
          fmt::format("write_shard: {}'s tensor must be contiguous float32 of shape [{}], not {}",
                      p.key, fmt::join(p.box.sizes, ", "), p.tensor.toString()));
    }
  }
  ShardFile file;
  file.file = shard_name(rank);
  // TODO(L12)
  DTC_TODO("L12",
           "write the pieces this rank writes, one after the other, into the file, each "
           "recorded with its offset, bytes and CRC-32; then make the file's bytes durable "
           "(L12Save.*, L12Crash.*; README section 2)");
  return file;
}

void commit(Fs& fs, const std::string& dir, const Metadata& metadata) {
  const std::string text = to_json(metadata).dump(1);
  // TODO(L12)
  DTC_TODO("L12",
           "make dir/metadata.json appear whole or not at all, and durable: write it "
           "under the temporary name, make its bytes durable, rename it, make the rename durable "
           "(L12Crash.*; README section 2)");
}

void save_checkpoint(Fs& fs, const std::string& root, int64_t step,
                     const std::vector<StatePiece>& pieces, Comm& comm,
                     const nlohmann::json& train) {
  const std::string dir = step_dir(root, step);
  fs.mkdirs(dir);
  // A step saved a second time (a run started afresh, --no-resume, over an older one): its commit
  // is withdrawn first, durably, and nobody writes before that, so that a crash while its shards
  // are rewritten cannot leave a committed step whose files are half new.
  if (comm.getRank() == 0 && fs.size(dir + "/" + kMetadata) >= 0) {
    fs.rename(dir + "/" + kMetadata, dir + "/metadata.json.withdrawn");
    fs.fsync_dir(dir);
  }
  comm.barrier()->wait();
  // TODO(L12)
  DTC_TODO("L12",
           "write this rank's shard; commit on rank 0 only once every rank's shard is "
           "durable, with every rank's records; return on no rank before the commit is durable "
           "(L12Save.*, L12Crash.*; README section 2)");
}

std::optional<int64_t> latest_checkpoint(Fs& fs, const std::string& root) {
  // TODO(L12)
  DTC_TODO("L12",
           "return the largest step of a step_NNNNNNNN directory under root that holds a "
           "metadata.json; ignore the others (L12Crash.*, L12Latest.*; README section 2)");
}

Metadata load_checkpoint(Fs& fs, const std::string& dir, std::vector<StatePiece>& pieces) {
  const std::string meta_path = dir + "/" + kMetadata;
  if (fs.size(meta_path) < 0) {
    throw CheckpointError(meta_path, "no metadata: the save of this step never committed");
  }
  const Metadata metadata =
      metadata_from_json(fs.read(meta_path, 0, fs.size(meta_path)), meta_path);
  // TODO(L12)
  DTC_TODO("L12",
           "check that the metadata is this directory's step and that every shard file "
           "has its recorded size; fill every piece from the saved pieces that overlap it, "
           "reading each "
           "of those once and checking its CRC-32; throw naming the file for anything wrong, and "
           "for a "
           "piece some of whose elements no saved piece holds (L12Load.*, L12Corrupt.*; README "
           "section 3)");
  return metadata;
}

}  // namespace dtc::l12
// generated from solutions/12_fault_tolerance/checkpoint.cpp; checksum b05c9e4efe99989a

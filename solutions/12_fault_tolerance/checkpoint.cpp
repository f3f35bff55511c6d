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
  // BEGIN SOLUTION: return the box of the elements both boxes hold, in every dimension the
  //   later start to the earlier end; nothing when a dimension has none (L12Boxes.*; README
  //   section 3)
  Box out;
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    const int64_t begin = std::max(a.offsets[d], b.offsets[d]);
    const int64_t end = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (end <= begin) return std::nullopt;
    out.offsets.push_back(begin);
    out.sizes.push_back(end - begin);
  }
  return out;
  // END SOLUTION
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
  // BEGIN SOLUTION: write the pieces this rank writes, one after the other, into the file, each
  //   recorded with its offset, bytes and CRC-32; then make the file's bytes durable
  //   (L12Save.*, L12Crash.*; README section 2)
  std::string content;
  for (const StatePiece& p : pieces) {
    if (!p.write) continue;
    const std::string bytes = bytes_of(p.tensor.cpu());
    SavedPiece saved{p.key,
                     p.global_shape,
                     p.box,
                     "float32",
                     file.file,
                     static_cast<int64_t>(content.size()),
                     static_cast<int64_t>(bytes.size()),
                     crc32_of(bytes)};
    content += bytes;
    file.pieces.push_back(std::move(saved));
  }
  const std::string path = dir + "/" + file.file;
  fs.write(path, content);
  fs.fsync(path);
  file.bytes = static_cast<int64_t>(content.size());
  // END SOLUTION
  return file;
}

void commit(Fs& fs, const std::string& dir, const Metadata& metadata) {
  const std::string text = to_json(metadata).dump(1);
  // BEGIN SOLUTION: make dir/metadata.json appear whole or not at all, and durable: write it
  //   under the temporary name, make its bytes durable, rename it, make the rename durable
  //   (L12Crash.*; README section 2)
  const std::string tmp = dir + "/" + kMetadataTmp;
  fs.write(tmp, text);
  fs.fsync(tmp);
  fs.rename(tmp, dir + "/" + kMetadata);
  fs.fsync_dir(dir);
  fs.fsync_dir(dir.substr(0, dir.find_last_of('/')));  // dir's own name, in the root
  // END SOLUTION
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
  // BEGIN SOLUTION: write this rank's shard; commit on rank 0 only once every rank's shard is
  //   durable, with every rank's records; return on no rank before the commit is durable
  //   (L12Save.*, L12Crash.*; README section 2)
  const ShardFile mine = write_shard(fs, dir, comm.getRank(), pieces);
  // Every rank's records: an all-gather, which no rank leaves before every rank has entered it,
  // so after it every shard is durable.
  Metadata metadata;
  metadata.step = step;
  metadata.files = all_gather_files(mine, comm);
  metadata.train = train;
  if (comm.getRank() == 0) commit(fs, dir, metadata);
  comm.barrier()->wait();  // nobody goes on (or is killed) before the commit is durable
  // END SOLUTION
}

std::optional<int64_t> latest_checkpoint(Fs& fs, const std::string& root) {
  // BEGIN SOLUTION: return the largest step of a step_NNNNNNNN directory under root that holds a
  //   metadata.json; ignore the others (L12Crash.*, L12Latest.*; README section 2)
  std::optional<int64_t> latest;
  for (const std::string& name : fs.list(root)) {
    if (name.size() != 13 || name.rfind("step_", 0) != 0 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos) {
      continue;
    }
    const int64_t step = std::stoll(name.substr(5));
    if (fs.size(root + "/" + name + "/" + kMetadata) < 0) continue;  // never committed
    if (!latest || step > *latest) latest = step;
  }
  return latest;
  // END SOLUTION
}

Metadata load_checkpoint(Fs& fs, const std::string& dir, std::vector<StatePiece>& pieces) {
  const std::string meta_path = dir + "/" + kMetadata;
  if (fs.size(meta_path) < 0) {
    throw CheckpointError(meta_path, "no metadata: the save of this step never committed");
  }
  const Metadata metadata =
      metadata_from_json(fs.read(meta_path, 0, fs.size(meta_path)), meta_path);
  // BEGIN SOLUTION: check that the metadata is this directory's step and that every shard file
  //   has its recorded size; fill every piece from the saved pieces that overlap it, reading each
  //   of those once and checking its CRC-32; throw naming the file for anything wrong, and for a
  //   piece some of whose elements no saved piece holds (L12Load.*, L12Corrupt.*; README
  //   section 3)
  if (step_dir(dir.substr(0, dir.find_last_of('/')), metadata.step) != dir) {
    throw CheckpointError(
        meta_path, fmt::format("metadata of step {}, in the directory of another", metadata.step));
  }
  for (const ShardFile& f : metadata.files) {
    const std::string path = dir + "/" + f.file;
    const int64_t size = fs.size(path);
    if (size < 0) throw CheckpointError(path, "missing");
    if (size != f.bytes) {
      throw CheckpointError(path, fmt::format("{} bytes, the metadata says {}", size, f.bytes));
    }
  }
  // The saved pieces by key, and which of them were read (each is read once).
  std::map<std::string, std::vector<const SavedPiece*>> by_key;
  for (const ShardFile& f : metadata.files) {
    for (const SavedPiece& p : f.pieces) by_key[p.key].push_back(&p);
  }
  std::map<const SavedPiece*, torch::Tensor> read;
  for (StatePiece& piece : pieces) {
    const auto found = by_key.find(piece.key);
    int64_t filled = 0;
    if (found != by_key.end()) {
      for (const SavedPiece* saved : found->second) {
        if (saved->global_shape != piece.global_shape) {
          throw CheckpointError(dir + "/" + saved->file,
                                fmt::format("{} has shape [{}] here, [{}] in the run", piece.key,
                                            fmt::join(saved->global_shape, ", "),
                                            fmt::join(piece.global_shape, ", ")));
        }
        const std::optional<Box> overlap = intersect(piece.box, saved->box);
        if (!overlap) continue;
        auto it = read.find(saved);
        if (it == read.end()) {
          const std::string path = dir + "/" + saved->file;
          const std::string bytes = fs.read(path, saved->offset, saved->bytes);
          if (crc32_of(bytes) != saved->crc32) {
            throw CheckpointError(
                path, fmt::format("{}'s bytes at {} fail their CRC-32", saved->key, saved->offset));
          }
          auto t = torch::empty(saved->box.sizes, torch::kFloat);
          std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
          it = read.emplace(saved, t).first;
        }
        torch::Tensor src = it->second;
        torch::Tensor dst = piece.tensor;
        for (size_t d = 0; d < overlap->offsets.size(); ++d) {
          src = src.narrow(static_cast<int64_t>(d), overlap->offsets[d] - saved->box.offsets[d],
                           overlap->sizes[d]);
          dst = dst.narrow(static_cast<int64_t>(d), overlap->offsets[d] - piece.box.offsets[d],
                           overlap->sizes[d]);
        }
        torch::NoGradGuard no_grad;
        dst.copy_(src);
        filled += overlap->numel();
      }
    }
    // Saved pieces do not overlap (one replica writes each box), so the overlaps add up.
    if (filled != piece.box.numel()) {
      throw CheckpointError(meta_path, fmt::format("holds {} of the {} elements of {} this rank "
                                                   "needs",
                                                   filled, piece.box.numel(), piece.key));
    }
  }
  // END SOLUTION
  return metadata;
}

}  // namespace dtc::l12

// Lesson 12 contract: a distributed checkpoint that survives a crash at any point, loads on
// another mesh, and resumes a run exactly.
//
// A checkpoint is a directory per step, ROOT/step_00000008/ (the state after 8 steps):
//
//   shard_00000.bin ... shard_0000N.bin   each rank's pieces, their raw bytes one after another
//   metadata.json                         every piece: its key, the whole tensor's shape, which
//                                         box of it the piece is, the file, offset, bytes and
//                                         CRC-32 of its bytes; every file's bytes; the run's
//                                         training state (step, seed, losses, the mesh)
//
// metadata.json is the commit marker, as .metadata is in PyTorch's Distributed Checkpoint (DCP):
// written last, only when every rank's shard is durable, to a temporary name, fsync'd, renamed;
// here the rename itself is made durable too (fsync of the directory, which DCP does not do). A
// step directory without it is a save that did not finish, and loading never looks at it: a crash
// at any point leaves the previous checkpoint as it was.
//
// The pieces: every tensor of a rank's state (parameters and AdamW's two moments) is a box of a
// tensor of the whole model, under one key on every mesh: "model/h.0.attn.c_attn.weight",
// "exp_avg/h.0.attn.c_attn.weight", ... (the given rank_state() builds them from lesson 11's
// NdTrainer). A tp slice is a box along its split dimension; a ZeRO shard, flattened elements
// [begin, end) of a (tp-sliced) tensor, is at most 2 d - 1 boxes (flat_range_boxes()); a replicated
// tensor is written by one of its replicas only. Loading on another mesh reads, for each of its
// own pieces, only the saved pieces that overlap it, and copies the overlap: resharding.
//
// What you implement (checkpoint.cpp):
//
//   1. intersect(): the overlap of two boxes, resharding's one computation;
//   2. write_shard(): a rank's pieces into its file, each piece's CRC-32, the file made durable;
//   3. commit(): the metadata, atomically (temporary name, fsync, rename, fsync of the directory);
//   4. save_checkpoint(): the protocol across ranks, so that commit() runs only after every
//      rank's shard is durable;
//   5. latest_checkpoint(): the newest committed step under ROOT;
//   6. load_checkpoint(): each piece of this rank filled from the overlapping saved pieces, each
//      saved piece read once, checked against its CRC-32 and the file's size.
//
// Every file operation goes through dtc::l12::Fs: PosixFs on disk, and in the tests a file system
// that forgets on a crash what was not made durable, and counts the bytes each rank reads.
// README.md beside it teaches it; tests/lesson12/ checks it.
//
//   make test-lesson12
//   make run-lesson12 NPROC=4 ARGS="--mix 2x1x2x1 --checkpoint-dir /tmp/ckpt --checkpoint-every 2"
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtc/compat.h"

namespace dtc::l12 {

// ---------------------------------------------------------------------------------------------
// The file system (given, in checkpoint_given.cpp)
// ---------------------------------------------------------------------------------------------

/// The file operations a checkpoint needs. Paths are plain strings; directories are made with
/// mkdirs(). What a crash keeps: a file's bytes once fsync()'d; a name in a directory (a file
/// made, a rename, a directory made) once fsync_dir() of that directory returned.
class Fs {
 public:
  virtual ~Fs() = default;
  /// Makes @p dir and its missing parents (their names durable only after fsync_dir of each
  /// parent).
  virtual void mkdirs(const std::string& dir) = 0;
  /// Creates or truncates @p path and writes @p bytes into it.
  virtual void write(const std::string& path, const std::string& bytes) = 0;
  /// Makes the bytes of the file @p path durable.
  virtual void fsync(const std::string& path) = 0;
  /// Makes the names in directory @p dir durable (what was created or renamed in it).
  virtual void fsync_dir(const std::string& dir) = 0;
  /// Renames @p from to @p to atomically, replacing @p to.
  virtual void rename(const std::string& from, const std::string& to) = 0;
  /// The names in @p dir (not "." and ".."), sorted; empty when it does not exist.
  virtual std::vector<std::string> list(const std::string& dir) = 0;
  /// The size of the file @p path in bytes, -1 when there is none.
  virtual int64_t size(const std::string& path) = 0;
  /// @p bytes bytes of @p path from @p offset.
  /// @throws CheckpointError naming @p path when it is missing or shorter
  virtual std::string read(const std::string& path, int64_t offset, int64_t bytes) = 0;
};

/// The disk, through POSIX calls (open, write, fsync, rename).
/// @throws CheckpointError naming the path on every failed call, with errno's message
class PosixFs : public Fs {
 public:
  void mkdirs(const std::string& dir) override;
  void write(const std::string& path, const std::string& bytes) override;
  void fsync(const std::string& path) override;
  void fsync_dir(const std::string& dir) override;
  void rename(const std::string& from, const std::string& to) override;
  std::vector<std::string> list(const std::string& dir) override;
  int64_t size(const std::string& path) override;
  std::string read(const std::string& path, int64_t offset, int64_t bytes) override;
};

/// A checkpoint that cannot be written or read: its what() names the file.
class CheckpointError : public std::runtime_error {
 public:
  CheckpointError(const std::string& path, const std::string& what);
  /// The file (or directory) at fault.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// CRC-32 (zlib's, the polynomial of gzip and PNG) of @p bytes.
uint32_t crc32_of(const std::string& bytes);

// ---------------------------------------------------------------------------------------------
// Pieces and metadata (given)
// ---------------------------------------------------------------------------------------------

/// A box of a tensor of shape S: the elements whose index i has offsets[d] <= i[d] <
/// offsets[d] + sizes[d] in every dimension d.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t numel() const;
  bool operator==(const Box& other) const {
    return offsets == other.offsets && sizes == other.sizes;
  }
};

/// One tensor of this rank's state, or a piece of one, as the checkpoint sees it.
struct StatePiece {
  std::string key;                    ///< the whole tensor's name, the same on every mesh
  std::vector<int64_t> global_shape;  ///< the whole tensor's shape
  Box box;                            ///< which of its elements this piece holds
  /// the piece's elements, box.sizes in shape, contiguous: saving reads it, loading writes
  /// into it (a view of the rank's parameter or moment, so that loading restores them)
  torch::Tensor tensor;
  /// whether this rank writes the piece: of the ranks that hold the same box (replicas), one
  bool write = true;
};

/// A saved piece, as metadata.json records it.
struct SavedPiece {
  std::string key;
  std::vector<int64_t> global_shape;
  Box box;
  std::string dtype;   ///< "float32"
  std::string file;    ///< the shard file's name within the step directory
  int64_t offset = 0;  ///< where its bytes start in the file
  int64_t bytes = 0;   ///< box.numel() x the element's size
  uint32_t crc32 = 0;  ///< crc32_of() its bytes
};

/// One rank's shard file.
struct ShardFile {
  std::string file;   ///< its name within the step directory: shard_RRRRR.bin
  int64_t bytes = 0;  ///< its size
  std::vector<SavedPiece> pieces;
};

/// What metadata.json holds.
struct Metadata {
  int64_t step = 0;              ///< the steps done when it was saved
  std::vector<ShardFile> files;  ///< every rank's, in rank order
  nlohmann::json train;          ///< the run's state besides the tensors (the program's)
};

nlohmann::json to_json(const Metadata& metadata);
/// @throws CheckpointError naming @p path when the text is not a checkpoint's metadata
Metadata metadata_from_json(const std::string& text, const std::string& path);

/// The step directory of @p step under @p root: ROOT/step_00000008.
std::string step_dir(const std::string& root, int64_t step);
/// The file names of a step directory.
inline constexpr const char* kMetadata = "metadata.json";
inline constexpr const char* kMetadataTmp = "metadata.json.tmp";
/// shard_RRRRR.bin, the file of rank @p rank.
std::string shard_name(int rank);

/// Flattened elements [begin, end) of a tensor of shape @p shape, as boxes of it (at most
/// 2 d - 1 for d dimensions), in the order of the elements: concatenated row-major, the boxes'
/// elements are those elements.
std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

/// What one rank contributes to a save and needs of the others (all-gather of their JSON,
/// given): every rank's ShardFile, in rank order, over @p comm.
std::vector<ShardFile> all_gather_files(const ShardFile& mine, Comm& comm);

// ---------------------------------------------------------------------------------------------
// What you implement (checkpoint.cpp)
// ---------------------------------------------------------------------------------------------

/// @brief The elements that both @p a and @p b hold, as a box; nothing when they share none
///   (or either is empty). Boxes of the same tensor: the same number of dimensions.
/// @throws std::invalid_argument for boxes of different dimensions
std::optional<Box> intersect(const Box& a, const Box& b);

/// @brief Writes the pieces of @p pieces whose `write` is set into @p dir / shard_name(@p rank),
///   one after the other (their tensors' bytes, fp32), and makes the file's bytes durable (its
///   name becomes durable with the commit's fsync of @p dir).
/// @return the file's record: its name and size, and for every piece written its key, shape,
///   box, dtype, offset, bytes and crc32_of() its bytes.
/// @throws std::invalid_argument for a piece whose tensor is not float32, not contiguous, or not
///   box.sizes in shape
ShardFile write_shard(Fs& fs, const std::string& dir, int rank,
                      const std::vector<StatePiece>& pieces);

/// @brief Makes @p metadata the committed metadata of @p dir, atomically: after a crash at any
///   point, dir/metadata.json is either absent or whole; once commit() returns, it survives a
///   crash (and so does @p dir's own name in its parent directory, the checkpoints' root).
///   @p dir is step_dir(root, step): the root is @p dir up to its last '/'.
void commit(Fs& fs, const std::string& dir, const Metadata& metadata);

/// @brief Saves step @p step of a run: every rank of @p comm calls it with its pieces, and when
///   it returns on any rank, step_dir(@p root, @p step) is committed (metadata.json durable),
///   which happens only once every rank's shard file is durable. Rank 0 commits; @p train is
///   metadata's train.
void save_checkpoint(Fs& fs, const std::string& root, int64_t step,
                     const std::vector<StatePiece>& pieces, Comm& comm,
                     const nlohmann::json& train);

/// @brief The newest committed checkpoint under @p root: the largest step of a directory named
///   exactly as step_dir() names one (step_ and 8 digits) that holds a metadata.json; nothing
///   when there is none (or no @p root).
std::optional<int64_t> latest_checkpoint(Fs& fs, const std::string& root);

/// @brief Fills every piece of @p pieces (those this rank writes and those it does not) from the
///   checkpoint in @p dir, on whatever mesh it was saved: each element from the saved piece of
///   the same key that holds it, copied into the piece's tensor in place (a view of the rank's
///   parameter or moment). Reads metadata.json once and only the saved pieces that overlap one of
///   @p pieces, each of them once, whole (their CRC-32 covers the whole piece).
/// @return the metadata it read (its step and train state)
/// @throws CheckpointError naming the file: no metadata.json, metadata of another step than the
///   directory's (step_dir(root, metadata's step) is not @p dir), a shard file missing or of
///   another size than the metadata's, a piece whose bytes' CRC-32 is not the metadata's; a saved
///   piece of a key of @p pieces in another global shape; or a piece of @p pieces some of whose
///   elements no saved piece holds (count the elements you fill: saved pieces never overlap)
Metadata load_checkpoint(Fs& fs, const std::string& dir, std::vector<StatePiece>& pieces);

}  // namespace dtc::l12

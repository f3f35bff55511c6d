// The course's training data: a byte-level text corpus that ships with the repository, and a
// batch sampler that is a pure function of (seed, step, row).
//
// The corpus, data/coriolanus.txt, is the first 32 KB of Shakespeare's Coriolanus (public
// domain) as it opens the "tiny Shakespeare" file of Karpathy's char-rnn. Tokens are its bytes:
// vocabulary 256, no tokenizer, nothing to download.
//
// Row r of step t starts at offset(seed, t, r): every rank can compute any row on its own, so a
// data-parallel rank takes rows [rank * B/W, (rank + 1) * B/W) of the same global batch that the
// single-device baseline trains on, and every strategy sees exactly the baseline's tokens.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtc {

/// A batch of next-token prediction: targets are the inputs shifted left by one token.
struct Batch {
  torch::Tensor inputs;   ///< (rows, seq) int64
  torch::Tensor targets;  ///< (rows, seq) int64: targets[r][t] = inputs[r][t + 1] in the corpus
  /// rows * seq
  int64_t tokens() const { return inputs.numel(); }
  /// Both tensors on @p device.
  Batch to(const torch::Device& device) const { return {inputs.to(device), targets.to(device)}; }
};

/// A corpus of byte tokens.
class ByteDataset {
 public:
  static constexpr int64_t kVocab = 256;

  explicit ByteDataset(std::vector<uint8_t> bytes);

  /// Reads a file's bytes.
  /// @throws dtc::UsageError("--data") when it cannot be read.
  static ByteDataset from_file(const std::string& path);

  /// The corpus that ships with the course: data/coriolanus.txt in the source tree.
  static ByteDataset builtin();

  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

  /// Where row @p row of step @p step starts: splitmix64 of (seed, step, row), modulo
  /// size - seq (so that seq + 1 bytes fit):
  ///   h = splitmix64(seed); h = splitmix64(h ^ step); h = splitmix64(h ^ row); h % (size - seq)
  /// @throws dtc::UsageError("--seq") when the corpus is not longer than seq.
  int64_t offset(uint64_t seed, int64_t step, int64_t row, int64_t seq) const;

  /// Rows [first_row, first_row + rows) of step @p step, on the CPU.
  Batch batch(uint64_t seed, int64_t step, int64_t rows, int64_t seq, int64_t first_row = 0) const;

 private:
  std::vector<uint8_t> bytes_;
};

/// @p relative inside the course's source tree (the checkout this program was built from),
/// e.g. source_path("data/coriolanus.txt").
std::string source_path(const std::string& relative);

}  // namespace dtc

// The byte-level corpus and its batch sampler (see dtc/data.h).
#include "dtc/data.h"

#include <fmt/format.h>

#include <fstream>
#include <iterator>

#include "dtc/errors.h"
#include "dtc/model.h"

namespace dtc {

ByteDataset::ByteDataset(std::vector<uint8_t> bytes) : bytes_(std::move(bytes)) {}

ByteDataset ByteDataset::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw UsageError("--data", fmt::format("cannot read '{}'", path),
                     "pass a readable text file, or leave --data out for the course's corpus "
                     "(data/coriolanus.txt)");
  }
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  return ByteDataset(std::move(bytes));
}

ByteDataset ByteDataset::builtin() { return from_file(source_path("data/coriolanus.txt")); }

int64_t ByteDataset::offset(uint64_t seed, int64_t step, int64_t row, int64_t seq) const {
  if (seq < 1 || size() <= seq) {
    throw UsageError("--seq",
                     fmt::format("sequences of {} tokens need a corpus of more than {} bytes; "
                                 "this one has {}",
                                 seq, seq, size()),
                     "use a shorter --seq or a longer --data file");
  }
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<uint64_t>(step));
  h = splitmix64(h ^ static_cast<uint64_t>(row));
  return static_cast<int64_t>(h % static_cast<uint64_t>(size() - seq));
}

Batch ByteDataset::batch(uint64_t seed, int64_t step, int64_t rows, int64_t seq,
                         int64_t first_row) const {
  auto inputs = torch::empty({rows, seq}, torch::kLong);
  auto targets = torch::empty({rows, seq}, torch::kLong);
  auto in = inputs.accessor<int64_t, 2>();
  auto out = targets.accessor<int64_t, 2>();
  for (int64_t r = 0; r < rows; ++r) {
    const auto start = static_cast<size_t>(offset(seed, step, first_row + r, seq));
    for (int64_t t = 0; t < seq; ++t) {
      in[r][t] = bytes_[start + static_cast<size_t>(t)];
      out[r][t] = bytes_[start + static_cast<size_t>(t) + 1];
    }
  }
  return {inputs, targets};
}

}  // namespace dtc

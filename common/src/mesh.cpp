#include "dtc/mesh.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "dtc/errors.h"

namespace dtc {

const std::vector<std::string>& Mesh::order() {
  static const std::vector<std::string> kOrder = {"pp", "dp_replicate", "dp_shard", "cp", "tp"};
  return kOrder;
}

size_t Mesh::index(const std::string& dim) {
  const auto& o = order();
  const auto it = std::find(o.begin(), o.end(), dim);
  if (it == o.end()) {
    throw std::invalid_argument(
        fmt::format("'{}' is not a mesh dimension (the dimensions: {})", dim, fmt::join(o, ", ")));
  }
  return static_cast<size_t>(it - o.begin());
}

std::string Mesh::key(const std::vector<std::string>& dims) {
  std::vector<bool> in(order().size(), false);
  for (const std::string& d : dims) {
    const size_t i = index(d);
    if (in[i]) {
      throw std::invalid_argument(fmt::format("'{}' is given twice in the set of dimensions {{{}}}",
                                              d, fmt::join(dims, ", ")));
    }
    in[i] = true;
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < order().size(); ++i) {
    if (in[i]) names.push_back(order()[i]);
  }
  return names.empty() ? "self" : fmt::format("{}", fmt::join(names, "+"));
}

void Mesh::check_rank(int rank) const {
  if (rank < 0 || rank >= world_) {
    throw std::out_of_range(fmt::format("rank {} is outside [0, {})", rank, world_));
  }
}

Mesh Mesh::build(int world, const std::vector<MeshDim>& dims) {
  const auto& o = order();
  if (world < 1) {
    throw UsageError("world size", fmt::format("is {}, must be at least 1", world),
                     "launch with torchrun --nproc_per_node N");
  }
  Mesh mesh;
  mesh.world_ = world;
  mesh.sizes_.assign(o.size(), 1);
  std::vector<bool> seen(o.size(), false);
  const MeshDim* inferred = nullptr;
  int64_t product = 1;
  for (const MeshDim& d : dims) {
    const std::string flag = d.flag.empty() ? d.name : d.flag;
    const auto it = std::find(o.begin(), o.end(), d.name);
    if (it == o.end()) {
      throw UsageError(flag, fmt::format("'{}' is not a mesh dimension", d.name),
                       fmt::format("use one of: {}", fmt::join(o, ", ")));
    }
    const auto i = static_cast<size_t>(it - o.begin());
    if (seen[i]) {
      throw UsageError(flag, fmt::format("the dimension {} is given twice", d.name),
                       "give each dimension once");
    }
    seen[i] = true;
    if (d.degree < 0) {
      throw UsageError(flag, fmt::format("is {}, must be at least 1", d.degree),
                       fmt::format("e.g. {} 2", flag));
    }
    if (d.degree == 0) {
      if (inferred) {
        throw UsageError(flag,
                         fmt::format("and {} are both left to be inferred; only one can be",
                                     inferred->flag.empty() ? inferred->name : inferred->flag),
                         fmt::format("give {} a degree", flag));
      }
      inferred = &d;
      continue;
    }
    mesh.sizes_[i] = d.degree;
    product *= d.degree;
  }
  // What was asked for, slowest first ("--dp 2 x --tp 2"), for the messages below.
  // Degrees of 1 (a flag left at its default, say) are left out when any degree is above 1.
  const bool any_above_1 =
      std::any_of(dims.begin(), dims.end(), [](const MeshDim& d) { return d.degree > 1; });
  const int least = any_above_1 ? 2 : 1;
  std::string asked;
  for (size_t i = 0; i < o.size(); ++i) {
    for (const MeshDim& d : dims) {
      if (d.name != o[i] || d.degree < least) continue;
      asked += fmt::format("{}{} {}", asked.empty() ? "" : " x ", d.flag.empty() ? d.name : d.flag,
                           d.degree);
    }
  }
  if (asked.empty()) asked = "a mesh of degree 1";
  // The flag at fault when the degrees do not fit: the last one (as the caller listed them)
  // given a degree above 1, else the last one given a degree, else the inferred one. A flag left
  // at its default of 1 is not blamed for another's degree.
  const MeshDim* last_given = nullptr;
  for (const MeshDim& d : dims) {
    if (d.degree >= least) last_given = &d;
  }
  if (!last_given) last_given = inferred;
  if (!last_given && product != world) {
    throw UsageError("world size", fmt::format("is {}, but no dimension was given", world),
                     "give the mesh's degrees (--dp, --tp, ...) whose product is the world size");
  }
  if (inferred) {
    const std::string flag = last_given->flag.empty() ? last_given->name : last_given->flag;
    if (world % product != 0) {
      throw UsageError(
          flag,
          fmt::format("{} needs a multiple of {} ranks, but this run has {} (the world "
                      "size torchrun started)",
                      asked, product, world),
          fmt::format("launch torchrun --nproc_per_node {} (or {}), or choose "
                      "degrees whose product divides {}",
                      product, 2 * product, world));
    }
    mesh.sizes_[mesh.index(inferred->name)] = static_cast<int>(world / product);
  } else if (product != world) {
    throw UsageError(last_given->flag.empty() ? last_given->name : last_given->flag,
                     fmt::format("{} needs {} ranks, but this run has {} (the world size "
                                 "torchrun started)",
                                 asked, product, world),
                     fmt::format("launch torchrun --nproc_per_node {}, or choose degrees whose "
                                 "product is {}",
                                 product, world));
  }
  mesh.strides_.assign(o.size(), 1);
  for (size_t i = o.size() - 1; i-- > 0;) {
    mesh.strides_[i] = mesh.strides_[i + 1] * mesh.sizes_[i + 1];
  }
  return mesh;
}

int Mesh::size(const std::string& dim) const { return sizes_[index(dim)]; }

int Mesh::size(const std::vector<std::string>& dims) const {
  key(dims);  // unknown or repeated names throw
  int n = 1;
  for (const std::string& d : dims) n *= size(d);
  return n;
}

int Mesh::coord(int rank, const std::string& dim) const {
  check_rank(rank);
  const size_t i = index(dim);
  return rank / strides_[i] % sizes_[i];
}

int Mesh::coord(int rank, const std::vector<std::string>& dims) const {
  // Flattened slowest first, in the mesh's order whatever the order of dims.
  key(dims);  // unknown or repeated names throw
  int c = 0;
  for (const std::string& d : order()) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) continue;
    c = c * size(d) + coord(rank, d);
  }
  return c;
}

int Mesh::rank_of(const std::map<std::string, int>& coords) const {
  int rank = 0;
  for (const auto& [dim, c] : coords) {
    const size_t i = index(dim);
    if (c < 0 || c >= sizes_[i]) {
      throw std::out_of_range(
          fmt::format("coordinate {} of {} is outside [0, {})", c, dim, sizes_[i]));
    }
    rank += c * strides_[i];
  }
  return rank;
}

std::vector<int> Mesh::group(int rank, const std::vector<std::string>& dims) const {
  check_rank(rank);
  key(dims);  // unknown or repeated names throw
  // Start from rank with its coordinates along dims zeroed, then walk every combination.
  int base = rank;
  std::vector<size_t> free;
  for (size_t i = 0; i < order().size(); ++i) {
    if (std::find(dims.begin(), dims.end(), order()[i]) == dims.end()) continue;
    base -= coord(rank, order()[i]) * strides_[i];
    free.push_back(i);
  }
  std::vector<int> ranks{base};
  for (size_t i : free) {
    std::vector<int> next;
    for (int r : ranks) {
      for (int c = 0; c < sizes_[i]; ++c) next.push_back(r + c * strides_[i]);
    }
    ranks = std::move(next);
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

std::string Mesh::group_name(int rank, const std::vector<std::string>& dims) const {
  return fmt::format("{}/{}", key(dims), fmt::join(group(rank, dims), "-"));
}

std::string Mesh::describe() const {
  std::vector<std::string> parts;
  for (size_t i = 0; i < order().size(); ++i) {
    if (sizes_[i] > 1) parts.push_back(fmt::format("{} {}", order()[i], sizes_[i]));
  }
  if (parts.empty()) parts.push_back("one rank");
  return fmt::format("{} ({} rank{})", fmt::join(parts, " x "), world_, world_ == 1 ? "" : "s");
}

MeshGroups::MeshGroups(const c10::intrusive_ptr<c10d::Store>& store, const Mesh& mesh, int rank,
                       const std::vector<std::vector<std::string>>& sets, BackendKind backend,
                       std::chrono::milliseconds timeout, const std::string& master_addr)
    : mesh_(mesh), rank_(rank) {
  for (const auto& dims : sets) {
    const std::string key = Mesh::key(dims);
    if (comms_.count(key)) continue;  // asked twice: built once
    comms_[key] = new_subgroup(store, mesh.group_name(rank, dims), mesh.group(rank, dims), rank,
                               backend, timeout, master_addr);
  }
}

const c10::intrusive_ptr<Comm>& MeshGroups::get(const std::vector<std::string>& dims) const {
  const auto it = comms_.find(Mesh::key(dims));
  if (it == comms_.end()) {
    throw std::out_of_range(fmt::format(
        "MeshGroups: no group over {} was built; pass it to the constructor", Mesh::key(dims)));
  }
  return it->second;
}

}  // namespace dtc

#include "dtc/digest.h"

#include <stdexcept>
#include <unordered_map>

namespace dtc {

nlohmann::json param_digest(const std::vector<std::string>& names,
                            const std::vector<NamedPiece>& pieces, Comm* comm) {
  return param_digest(names, pieces,
                      comm != nullptr ? std::vector<Comm*>{comm} : std::vector<Comm*>{});
}

nlohmann::json param_digest(const std::vector<std::string>& names,
                            const std::vector<NamedPiece>& pieces,
                            const std::vector<Comm*>& comms) {
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < names.size(); ++i) index[names[i]] = i;
  // (numel, sum, sumsq) per parameter, in double: one buffer, summed across ranks at once.
  auto acc = torch::zeros({static_cast<int64_t>(names.size()), 3}, torch::kDouble);
  for (const auto& [name, t] : pieces) {
    auto it = index.find(name);
    if (it == index.end()) {
      throw std::invalid_argument("param_digest: '" + name + "' is not a parameter of the model");
    }
    auto d = t.detach().to(torch::kCPU, torch::kDouble);
    auto row = acc[static_cast<int64_t>(it->second)];
    row[0] += static_cast<double>(d.numel());
    row[1] += d.sum().item<double>();
    row[2] += d.square().sum().item<double>();
  }
  for (Comm* comm : comms) {
    // The buffer goes where the communicator computes (NCCL: the current CUDA device).
    auto where = comm->getBackendName() == "nccl" ? acc.to(torch::kCUDA) : acc;
    std::vector<at::Tensor> v{where};
    comm->allreduce(v)->wait();
    acc = v[0].to(torch::kCPU);
  }
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < names.size(); ++i) {
    auto row = acc[static_cast<int64_t>(i)];
    out.push_back({{"name", names[i]},
                   {"numel", static_cast<int64_t>(row[0].item<double>())},
                   {"sum", row[1].item<double>()},
                   {"sumsq", row[2].item<double>()}});
  }
  return out;
}

nlohmann::json param_digest(const torch::nn::Module& model) {
  std::vector<std::string> names;
  std::vector<NamedPiece> pieces;
  for (const auto& item : model.named_parameters()) {
    names.push_back(item.key());
    pieces.emplace_back(item.key(), item.value());
  }
  return param_digest(names, pieces);
}

}  // namespace dtc

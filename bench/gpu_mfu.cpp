// gpu_mfu: model FLOPs utilisation (MFU) of the course's GPT on one device.
//
//   build-gpu/bin/gpu_mfu                        # GPU: GPT-2-small size, bf16, AdamW, MFU
//   build/bin/gpu_mfu --smoke                    # CPU: a tiny model, 3 steps, no MFU
//   build/bin/gpu_mfu --layers 2 --hidden 64 --heads 2 --seq 32 --vocab 256 --batch 2 --json
//
// The default size is GPT-2 small (12 layers, h 768, 12 heads, context 1024) with GPT-2's vocab
// padded to 50304 (a multiple of 128, as nanoGPT does); the course's byte corpus has 256 symbols,
// so the tokens here are random ints in [0, V): speed does not depend on what they say.
// Training is pure bf16 (model->to(bf16), AdamW on bf16 weights): a speed measurement, not a
// recipe (mixed precision keeps fp32 master weights).
//
// MFU = model FLOPs per second / peak (PaLM, Chowdhery et al. 2022, appendix B):
//   FLOPs per token = 6 N + 12 L h T    (N: parameters without the position embedding; the
//                                        second term is attention's QK^T and AV, forward and
//                                        backward, at sequence length T)
//   peak: the GPU's dense bf16 tensor-core rate, from the table below by device name.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "dtc/cli.h"
#include "dtc/compat.h"
#include "dtc/errors.h"
#include "dtc/model.h"

namespace {

// Dense bf16 peak (without 2:4 sparsity), TFLOP/s, by a substring of the CUDA device name.
struct Peak {
  const char* name_part;
  double tflops;
  const char* source;
};
const std::vector<Peak> kPeaks = {
    // NVIDIA H200 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS "with sparsity" -> 989 dense.
    {"H200", 989.0, "NVIDIA H200 datasheet, SXM, 1979/2 (dense)"},
    // NVIDIA H100 datasheet: SXM 1,979 with sparsity -> 989 dense; PCIe 1,513 -> 756 dense.
    {"H100 PCIe", 756.0, "NVIDIA H100 datasheet, PCIe, 1513/2 (dense)"},
    {"H100", 989.0, "NVIDIA H100 datasheet, SXM, 1979/2 (dense)"},
    // NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity).
    {"A100", 312.0, "NVIDIA A100 datasheet, 312 dense"},
    // NVIDIA L40S datasheet: BF16 362.05 TFLOPS (733 with sparsity).
    {"L40S", 362.0, "NVIDIA L40S datasheet, 362 dense"},
};

const Peak* find_peak(const std::string& device_name) {
  for (const auto& p : kPeaks) {
    if (device_name.find(p.name_part) != std::string::npos) return &p;
  }
  return nullptr;
}

double seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gpu_mfu: model FLOPs utilisation of the course's GPT on one device", "gpu_mfu"};
  dtc::GptConfig cfg;
  cfg.vocab = 50304;
  cfg.ctx = 1024;
  cfg.hidden = 768;
  cfg.layers = 12;
  cfg.heads = 12;
  int64_t batch = 8;
  int steps = 10;
  int warmup = 3;
  std::string dtype = "bf16";
  std::string device_flag = "auto";
  bool smoke = false;
  bool json = false;
  bool skip_without_gpu = false;
  double peak_override = 0;
  app.add_option("--layers", cfg.layers)->capture_default_str();
  app.add_option("--hidden", cfg.hidden)->capture_default_str();
  app.add_option("--heads", cfg.heads)->capture_default_str();
  app.add_option("--seq", cfg.ctx, "sequence length (= context)")->capture_default_str();
  app.add_option("--vocab", cfg.vocab)->capture_default_str();
  app.add_option("--batch", batch, "sequences per step")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--dtype", dtype)->check(CLI::IsMember({"bf16", "fp32"}))->capture_default_str();
  app.add_option("--device", device_flag)
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--peak-tflops", peak_override, "peak to divide by (default: table by GPU name)");
  app.add_flag("--smoke", smoke, "a tiny model for 3 steps (CPU check of this program)");
  app.add_flag("--skip-without-gpu", skip_without_gpu,
               "exit 77 (ctest: skipped) with a message when no CUDA device is visible");
  app.add_flag("--json", json, "print one JSON object on the last line");

  return dtc::run_cli(
      app, argc, argv,
      [&]() -> int {
        if (smoke) {
          cfg = dtc::GptConfig{};
          cfg.layers = 2, cfg.hidden = 64, cfg.heads = 2, cfg.ctx = 32, cfg.vocab = 256;
          batch = 2, steps = 3, warmup = 1;
        }
        const bool gpu = device_flag != "cpu" && dtc::cuda_device_count() > 0;
        if (skip_without_gpu && !gpu) {
          fmt::print("SKIP: no CUDA device visible ({}); gpu_mfu measures MFU on GPUs only\n",
                     dtc::kHaveCuda ? "a CUDA build, but torch::cuda::device_count() is 0"
                                    : "this LibTorch has no CUDA");
          return 77;
        }
        if (device_flag == "cuda" && !gpu) {
          throw dtc::UsageError("--device", "cuda asked for, but no CUDA device is visible",
                                "run on a GPU machine, or use --device cpu");
        }
        const torch::Device device = gpu ? dtc::cuda_device_for_local_rank(0) : torch::kCPU;
        const auto dt = dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
        torch::manual_seed(1);

        dtc::Gpt model(cfg);
        dtc::init_weights(model, 1);
        model->to(device, dt);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4));
        const int64_t n_params = dtc::count_parameters(*model);
        const int64_t n_flop_params = n_params - cfg.ctx * cfg.hidden;  // minus wpe
        const double flops_per_token =
            6.0 * n_flop_params + 12.0 * cfg.layers * cfg.hidden * cfg.ctx;
        const std::string name = gpu ? dtc::cuda_device_name(device.index()) : "cpu";
        fmt::print("gpu_mfu: {} ({}), L{} h{} a{} T{} V{}, batch {}, {}: {:.1f} M parameters\n",
                   name, device.str(), cfg.layers, cfg.hidden, cfg.heads, cfg.ctx, cfg.vocab, batch,
                   dtype, n_params / 1e6);

        // Random tokens on the device: (B, T+1) -> inputs (B, T), targets (B, T).
        auto data = torch::randint(cfg.vocab, {batch, cfg.ctx + 1},
                                   torch::TensorOptions().dtype(torch::kLong).device(device));
        auto x = data.narrow(1, 0, cfg.ctx), y = data.narrow(1, 1, cfg.ctx);
        auto sync = [&] {
          if (gpu) torch::cuda::synchronize();
        };
        std::vector<double> step_s;
        double loss = 0;
        for (int s = 0; s < warmup + steps; ++s) {
          sync();
          const auto t0 = std::chrono::steady_clock::now();
          opt.zero_grad();
          auto logits = model->forward(x);  // (B, T, V)
          auto l = torch::nn::functional::cross_entropy(
              logits.reshape({-1, cfg.vocab}).to(torch::kFloat32), y.reshape({-1}));
          l.backward();
          opt.step();
          loss = l.item<double>();  // also a sync point
          sync();
          if (s >= warmup) step_s.push_back(seconds(t0, std::chrono::steady_clock::now()));
        }
        std::sort(step_s.begin(), step_s.end());
        const double median = step_s[step_s.size() / 2];
        const double tokens_per_s = batch * cfg.ctx / median;
        const double achieved = flops_per_token * tokens_per_s;
        const Peak* peak = find_peak(name);
        const double peak_flops = peak_override > 0                  ? peak_override * 1e12
                                  : (gpu && peak && dtype == "bf16") ? peak->tflops * 1e12
                                                                     : 0.0;
        fmt::print(
            "median step {:.1f} ms over {} steps, {:.0f} tokens/s, {:.2f} TFLOP/s achieved, "
            "final loss {:.3f}\n",
            median * 1e3, steps, tokens_per_s, achieved / 1e12, loss);
        if (peak_flops > 0) {
          fmt::print("MFU {:.1f}% of {:.0f} TFLOP/s ({})\n", 100 * achieved / peak_flops,
                     peak_flops / 1e12, peak_override > 0 ? "--peak-tflops" : peak->source);
        } else {
          fmt::print("MFU: not computed ({})\n",
                     !gpu              ? "CPU run"
                     : dtype != "bf16" ? "peak table is bf16"
                                       : "GPU not in the peak table; pass --peak-tflops");
        }
        if (gpu) {
          const auto mem = dtc::cuda_memory_stats(device.index());
          fmt::print("CUDA memory: peak allocated {:.2f} GiB, peak reserved {:.2f} GiB\n",
                     mem.peak_allocated / 1073741824.0, mem.peak_reserved / 1073741824.0);
        }
        if (json) {
          nlohmann::json j = {{"device", name},
                              {"params", n_params},
                              {"layers", cfg.layers},
                              {"hidden", cfg.hidden},
                              {"heads", cfg.heads},
                              {"seq", cfg.ctx},
                              {"vocab", cfg.vocab},
                              {"batch", batch},
                              {"dtype", dtype},
                              {"median_step_s", median},
                              {"tokens_per_s", tokens_per_s},
                              {"achieved_tflops", achieved / 1e12},
                              {"flops_per_token", flops_per_token},
                              {"loss", loss}};
          j["mfu"] = peak_flops > 0 ? nlohmann::json(achieved / peak_flops) : nlohmann::json();
          j["peak_tflops"] = peak_flops > 0 ? nlohmann::json(peak_flops / 1e12) : nlohmann::json();
          if (gpu)
            j["peak_allocated_bytes"] = dtc::cuda_memory_stats(device.index()).peak_allocated;
          dtc::print_json_line(std::cout, j);
        }
        return 0;
      },
      std::cerr);
}

// The lesson02 program: trains the course's GPT on one device and prints the measured memory of
// its first step next to lesson 01's ledger. Given in full; the training step, the byte counts
// from the tensors and the checkpoint are yours, in baseline.cpp.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <ostream>

#include "dtc/cli.h"
#include "dtc/compat.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/model_flags.h"

namespace dtc::l02 {

// ---------------------------------------------------------------------------------------------
// Lesson 01's ledger for this model
// ---------------------------------------------------------------------------------------------

LedgerPrediction predict_memory(const GptConfig& m, int64_t batch) {
  LedgerPrediction p;
  const int64_t h = m.hidden, L = m.layers, V = m.vocab, ctx = m.ctx;
  // Lesson 01, section 4 (and REFERENCES: GPT-2 style): L(12h^2 + 13h) + Vh + ctx*h + 2h with a
  // tied output head; an untied one adds its own V x h matrix.
  p.params = L * (12 * h * h + 13 * h) + V * h + ctx * h + 2 * h + (m.tied ? 0 : V * h);
  // Lesson 01, section 2: fp32 + AdamW is 4 + 4 + 8 bytes per parameter.
  p.param_bytes = 4 * p.params;
  p.grad_bytes = 4 * p.params;
  p.optimizer_bytes = 8 * p.params;
  // Lesson 01, section 5, one block's stored tensors in elements (s tokens, b sequences):
  //   replicated: norm inputs 2sbh, norm outputs (QKV and MLP inputs) 2sbh       4sbh
  //   Q, K, V 3sbh; output projection's input sbh; GELU input and output 2 x 4sbh 12sbh
  //   softmax output a s^2 b (no dropout here: no masks, no dropout output)
  // at 4 bytes each (fp32): 64sbh + 4as^2b. Korthikanti's 34sbh + 5as^2b is the same list in
  // 16 bits with dropout.
  const int64_t s = ctx, b = batch, a = m.heads;
  p.activation_bytes = L * (64 * s * b * h + 4 * a * s * s * b);
  return p;
}

// ---------------------------------------------------------------------------------------------
// Measuring one step
// ---------------------------------------------------------------------------------------------

int64_t device_bytes_now(const torch::Device& device) {
  if (device.is_cuda()) return cuda_memory_stats(std::max<int>(device.index(), 0)).allocated;
  return cpu_memory().current;
}

MeasuredMemory measure_step(Gpt& model, torch::optim::AdamW& optimizer, const Batch& batch,
                            float& loss_value, const torch::Device& device) {
  const int gpu = std::max<int>(device.index(), 0);
  auto now = [&] { return device_bytes_now(device); };
  auto peak = [&] {
    return device.is_cuda() ? cuda_memory_stats(gpu).peak_allocated : cpu_memory().peak;
  };
  MeasuredMemory m;
  zero_grad_to_none(optimizer);
  const int64_t before = now();
  if (device.is_cuda()) {
    reset_cuda_peak_memory(gpu);
  } else {
    reset_cpu_peak();
  }
  torch::Tensor loss = forward_loss(model, batch);
  m.activations = now() - before;  // the graph's saved tensors (and the loss)
  loss.backward();                 // frees the graph as it goes
  m.step_peak = peak() - before;
  loss_value = loss.item<float>();
  loss = torch::Tensor();    // drop the 4-byte loss
  m.grads = now() - before;  // what backward left: the gradients
  const int64_t before_step = now();
  optimizer.step();
  m.optimizer = now() - before_step;  // AdamW's state, made on its first step
  return m;
}

std::vector<float> train_losses(const TrainConfig& config, int64_t steps) {
  const ByteDataset data = ByteDataset::builtin();
  Gpt model = make_model(config);
  auto optimizer = make_optimizer(model, config);
  std::vector<float> losses;
  for (int64_t step = 0; step < steps; ++step) {
    losses.push_back(train_step(model, *optimizer,
                                data.batch(config.seed, step, config.batch, config.model.ctx)));
  }
  return losses;
}

// ---------------------------------------------------------------------------------------------
// The program
// ---------------------------------------------------------------------------------------------

namespace {

struct Options {
  TrainFlags flags;
  GptConfig model;
  bool untied = false;
  double lr = TrainConfig{}.lr;
  std::string data;
  std::string save;
  std::string resume;
};

// 834304 -> "834,304"
std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n);
  for (int i = static_cast<int>(digits.size()) - 3; i > (n < 0 ? 1 : 0); i -= 3) {
    digits.insert(static_cast<size_t>(i), ",");
  }
  return digits;
}

std::string clock_time(double seconds) {
  const auto s = static_cast<int64_t>(std::lround(seconds));
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

nlohmann::json bytes_json(int64_t params, int64_t grads, int64_t optimizer) {
  return {{"params", params}, {"grads", grads}, {"optimizer", optimizer}};
}

void print_memory(std::ostream& out, const LedgerPrediction& p, const MeasuredMemory* m,
                  const StateBytes& t) {
  auto mib = [](double bytes) { return bytes / (1024.0 * 1024.0); };
  fmt::print(out,
             "\nMemory of one training step, fp32 + AdamW: measured vs lesson 01's ledger\n\n"
             "  {:<22} {:>14} {:>14} {:>14} {:>9} {:>10}\n",
             "", "allocator", "from tensors", "ledger", "MiB", "B/param");
  auto row = [&](const char* what, int64_t measured, int64_t tensors, int64_t ledger) {
    fmt::print(out, "  {:<22} {:>14} {:>14} {:>14} {:>9.2f} {:>10.2f}{}\n", what,
               m ? with_commas(measured) : "-", with_commas(tensors), with_commas(ledger),
               mib(static_cast<double>(ledger)),
               static_cast<double>(ledger) / static_cast<double>(p.params),
               m && measured != ledger ? "   <- differs" : "");
  };
  row("parameters", m ? m->params : 0, t.params, p.param_bytes);
  row("gradients", m ? m->grads : 0, t.grads, p.grad_bytes);
  row("optimizer states", m ? m->optimizer : 0, t.optimizer, p.optimizer_bytes);
  if (m) {
    fmt::print(out, "  {:<22} {:>14} {:>14} {:>14} {:>9.2f}   measured / ledger = {:.2f}\n",
               "activations (saved)", with_commas(m->activations), "-",
               with_commas(p.activation_bytes), mib(static_cast<double>(p.activation_bytes)),
               static_cast<double>(m->activations) / static_cast<double>(p.activation_bytes));
    fmt::print(out, "  {:<22} {:>14} {:>14} {:>14} {:>9.2f}\n", "peak of fwd + bwd",
               with_commas(m->step_peak), "-", "-", mib(static_cast<double>(m->step_peak)));
  } else {
    fmt::print(out,
               "  (allocator: not measured. The counting allocator sees CPU memory of a fresh "
               "run; this one ran on a GPU or resumed from a checkpoint.)\n");
  }
  fmt::print(out,
             "\n  allocator: bytes the counting CPU allocator saw (dtc/memory.h); from tensors:\n"
             "  your state_bytes(); ledger: lesson 01's formulas, activations for the blocks only\n"
             "  (fp32, no dropout: 64sbh + 4as^2b per layer). README section 6 explains the\n"
             "  activation difference.\n");
}

int run(const Options& o, std::ostream& out, std::ostream& err) {
  TrainConfig c;
  c.model = o.model;
  c.model.tied = !o.untied;
  c.batch = o.flags.global_batch;
  c.seed = o.flags.seed;
  c.lr = o.lr;
  validate(c.model);
  check_learning_rate(c.lr);
  const ByteDataset data = o.data.empty() ? ByteDataset::builtin() : ByteDataset::from_file(o.data);
  data.offset(c.seed, 0, 0, c.model.ctx);  // checks that sequences fit in the corpus
  if (!o.resume.empty() && !std::ifstream(o.resume).good()) {
    throw UsageError("--resume", fmt::format("cannot read '{}'", o.resume),
                     "pass a checkpoint written by --save");
  }

  const torch::Device device = default_device();
  install_counting_allocator();
  const int64_t before_model = device_bytes_now(device);
  Gpt model = make_model(c, device);
  const int64_t model_bytes = device_bytes_now(device) - before_model;
  auto optimizer = make_optimizer(model, c);
  int64_t first = 0;
  if (!o.resume.empty()) first = load_checkpoint(o.resume, model, *optimizer);
  const int64_t steps = o.flags.steps;
  if (first >= steps) {
    throw UsageError(
        "--steps",
        fmt::format("the checkpoint is already at step {}, and --steps is {}", first, steps),
        fmt::format("--steps counts from the start: pass more than {}", first));
  }
  const bool measure = (device.is_cpu() || device.is_cuda()) && first == 0;
  const LedgerPrediction predicted = predict_memory(c.model, c.batch);
  const int64_t tokens_per_step = c.batch * c.model.ctx;
  const int64_t params = count_parameters(*model);

  if (!o.flags.json) {
    fmt::print(out,
               "Lesson 02: the single-device baseline\n"
               "  model   GPT, {} layers, hidden {}, {} heads, seq {}, vocab {} (bytes), {} head: "
               "{} parameters\n"
               "  data    {} ({} bytes), {} x {} = {} tokens per step, seed {}\n"
               "  train   AdamW lr {:g}, steps {}..{}, on {} (LibTorch {})\n",
               c.model.layers, c.model.hidden, c.model.heads, c.model.ctx, c.model.vocab,
               c.model.tied ? "tied" : "untied", with_commas(params),
               o.data.empty() ? "data/coriolanus.txt" : o.data, with_commas(data.size()), c.batch,
               c.model.ctx, tokens_per_step, c.seed, c.lr, first, steps - 1, device.str(),
               torch_version());
    out.flush();
  }

  std::vector<float> losses;
  MeasuredMemory measured;
  StateBytes from_tensors;
  const int64_t every = std::max<int64_t>(1, (steps - first) / 10);
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  for (int64_t step = first; step < steps; ++step) {
    const Batch batch = data.batch(c.seed, step, c.batch, c.model.ctx).to(device);
    float loss = 0;
    if (step == first && measure) {
      measured = measure_step(model, *optimizer, batch, loss, device);
      measured.params = model_bytes;
      from_tensors = state_bytes(model, *optimizer);
    } else {
      loss = train_step(model, *optimizer, batch);
    }
    losses.push_back(loss);
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int64_t done = step - first + 1;
    if (done == 1 || (step + 1) % every == 0 || step + 1 == steps) {
      const double rate = static_cast<double>(done * tokens_per_step) / elapsed;
      fmt::print(
          err, "step {:>{}}/{}  loss {:.4f}  {:>7.1f}k tokens/s  ETA {}\n", step + 1,
          std::to_string(steps).size(), steps, loss, rate / 1000.0,
          clock_time(elapsed / static_cast<double>(done) * static_cast<double>(steps - step - 1)));
      err.flush();
    }
  }
  if (!measure) from_tensors = state_bytes(model, *optimizer);
  const double tokens_per_s =
      static_cast<double>(static_cast<int64_t>(losses.size()) * tokens_per_step) / elapsed;
  if (!o.save.empty()) save_checkpoint(o.save, model, *optimizer, steps);

  if (o.flags.json) {
    nlohmann::json j;
    j["losses"] = losses;
    j["param_digest"] = param_digest(*model);  // after the last step (dtc/digest.h)
    j["tokens_per_s"] = tokens_per_s;
    j["first_step"] = first;
    j["steps"] = steps;
    j["params"] = params;
    j["device"] = device.str();
    j["config"] = {{"layers", c.model.layers}, {"hidden", c.model.hidden}, {"heads", c.model.heads},
                   {"seq", c.model.ctx},       {"vocab", c.model.vocab},   {"tied", c.model.tied},
                   {"batch", c.batch},         {"seed", c.seed},           {"lr", c.lr}};
    nlohmann::json mem;
    mem["predicted"] =
        bytes_json(predicted.param_bytes, predicted.grad_bytes, predicted.optimizer_bytes);
    mem["predicted"]["activations"] = predicted.activation_bytes;
    mem["from_tensors"] =
        bytes_json(from_tensors.params, from_tensors.grads, from_tensors.optimizer);
    if (measure) {
      mem["measured"] = bytes_json(measured.params, measured.grads, measured.optimizer);
      mem["measured"]["activations"] = measured.activations;
      mem["measured"]["step_peak"] = measured.step_peak;
    } else {
      mem["measured"] = nullptr;
    }
    j["memory"] = mem;
    print_json_line(out, j);
    return kExitOk;
  }
  fmt::print(out, "\n  trained steps {}..{}: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, {:.1f} s\n",
             first, steps - 1, losses.front(), losses.back(), tokens_per_s, elapsed);
  if (!o.save.empty()) fmt::print(out, "  checkpoint: {} (after step {})\n", o.save, steps - 1);
  print_memory(out, predicted, measure ? &measured : nullptr, from_tensors);
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{
      "Lesson 02: the single-device baseline. Trains the course's GPT on a byte-level corpus\n"
      "(CUDA when available, else the CPU; DTC_DEVICE=cpu forces the CPU) and compares the\n"
      "memory of its first step with lesson 01's ledger.",
      "lesson02"};
  Options o;
  o.flags.steps = 500;
  add_train_flags(app, o.flags);
  add_model_flags(app, o.model, o.lr, &o.untied);
  app.add_option("--data", o.data, "a text file to train on (default data/coriolanus.txt)");
  app.add_option("--save", o.save, "write a checkpoint here after the last step");
  app.add_option("--resume", o.resume,
                 "continue from a checkpoint written by --save (same flags; --steps counts from "
                 "step 0)");
  return run_cli(
      app, argc, argv, [&] { return run(o, out, err); }, err);
}

}  // namespace dtc::l02

// The lesson02 program: trains the course's GPT on one device and prints the measured memory of
// its first step next to lesson 01's ledger. Given in full; the training step, the byte counts
// from the tensors and the checkpoint are yours, in baseline.cpp, and the recomputation, the
// loss scaler and the master-weight step in mixed.cpp.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <ostream>

#include "dtc/compat.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/format.h"
#include "dtc/memory.h"
#include "dtc/program.h"
#include "dtc/trace.h"

namespace dtc::l02 {

// ---------------------------------------------------------------------------------------------
// Lesson 01's ledger for this model
// ---------------------------------------------------------------------------------------------

LedgerPrediction predict_memory(const GptConfig& m, int64_t batch, Precision precision,
                                bool fp32_grads, Recompute recompute) {
  LedgerPrediction p;
  const int64_t h = m.hidden, L = m.layers, V = m.vocab, ctx = m.ctx;
  // Lesson 01, section 4 (and REFERENCES: GPT-2 style): L(12h^2 + 13h) + Vh + ctx*h + 2h with a
  // tied output head; an untied one adds its own V x h matrix.
  p.params = L * (12 * h * h + 13 * h) + V * h + ctx * h + 2 * h + (m.tied ? 0 : V * h);
  // Lesson 01, section 2: fp32 + AdamW is 4 + 4 + 8 bytes per parameter; mixed precision is
  // 2 + 2 + (4 + 8), the fp32 master copy counted apart here, and 2 + 4 + (4 + 8) with fp32
  // gradients.
  const bool fp32 = precision == Precision::kFp32;
  const int64_t e = fp32 ? 4 : 2;  // bytes per element of weights and activations
  p.param_bytes = e * p.params;
  p.grad_bytes = (fp32 || fp32_grads ? 4 : 2) * p.params;
  p.master_bytes = fp32 ? 0 : 4 * p.params;
  p.optimizer_bytes = 8 * p.params;
  // Lesson 01, section 5, one block's stored tensors in elements (s tokens, b sequences):
  //   replicated: norm inputs 2sbh, norm outputs (QKV and MLP inputs) 2sbh       4sbh
  //   Q, K, V 3sbh; output projection's input sbh; GELU input and output 2 x 4sbh 12sbh
  //   softmax output a s^2 b (no dropout here: no masks, no dropout output)
  // 16sbh + as^2b elements, e bytes each: 64sbh + 4as^2b in fp32. Korthikanti's 34sbh + 5as^2b is
  // the same list in 16 bits with dropout. Selective recomputation drops the s x s scores; full
  // recomputation keeps the block's input only (sbh).
  const int64_t s = ctx, b = batch, a = m.heads;
  switch (recompute) {
    case Recompute::kNone:
      p.activation_bytes_per_layer = e * (16 * s * b * h + a * s * s * b);
      break;
    case Recompute::kSelective: p.activation_bytes_per_layer = e * 16 * s * b * h; break;
    case Recompute::kFull: p.activation_bytes_per_layer = e * s * b * h; break;
  }
  p.activation_bytes = L * p.activation_bytes_per_layer;
  return p;
}

// ---------------------------------------------------------------------------------------------
// Measuring one step
// ---------------------------------------------------------------------------------------------

int64_t device_bytes_now(const torch::Device& device) {
  if (device.is_cuda()) return cuda_memory_stats(std::max<int>(device.index(), 0)).allocated;
  return cpu_memory().current;
}

namespace {

// One first training step in its pieces, each measured: @p zero_grad, forward_loss, @p backward
// from the loss, @p step (which returns whether it stepped).
MeasuredMemory measure_pieces(Gpt& model, const Batch& batch, float& loss_value,
                              const torch::Device& device, const std::function<void()>& zero_grad,
                              const std::function<void(const torch::Tensor&)>& backward,
                              const std::function<bool()>& step) {
  const int gpu = std::max<int>(device.index(), 0);
  auto now = [&] { return device_bytes_now(device); };
  auto peak = [&] {
    return device.is_cuda() ? cuda_memory_stats(gpu).peak_allocated : cpu_memory().peak;
  };
  MeasuredMemory m;
  zero_grad();
  const int64_t before = now();
  if (device.is_cuda()) {
    reset_cuda_peak_memory(gpu);
  } else {
    reset_cpu_peak();
  }
  torch::Tensor loss = forward_loss(model, batch);
  m.activations = now() - before;  // the graph's saved tensors (and the loss)
  backward(loss);                  // frees the graph as it goes
  m.step_peak = peak() - before;
  loss_value = loss.item<float>();
  loss = torch::Tensor();    // drop the 4-byte loss
  m.grads = now() - before;  // what backward left: the gradients (16-bit, or fp32 buffers)
  const int64_t before_step = now();
  m.stepped = step();
  m.optimizer = now() - before_step;  // AdamW's state, made on its first step; the mixed step's
                                      // fp32 gradient copies are gone again
  return m;
}

}  // namespace

MeasuredMemory measure_step(Gpt& model, torch::optim::AdamW& optimizer, const Batch& batch,
                            float& loss_value, const torch::Device& device) {
  return measure_pieces(
      model, batch, loss_value, device, [&] { zero_grad_to_none(optimizer); },
      [](const torch::Tensor& loss) { loss.backward(); },
      [&] {
        optimizer.step();
        return true;
      });
}

MeasuredMemory measure_mixed_step(Gpt& model, MasterWeights& master, LossScaler* scaler,
                                  const Batch& batch, float& loss_value,
                                  const torch::Device& device) {
  return measure_pieces(
      model, batch, loss_value, device, [&] { master.zero_grad(); },
      [&](const torch::Tensor& loss) {
        (scaler != nullptr ? scaler->scale(loss) : loss).backward();
      },
      [&] { return master.step(scaler); });
}

TrainedRun train_run(const TrainConfig& config, int64_t steps,
                     const LossScalerOptions& scaler_options) {
  const ByteDataset data = ByteDataset::builtin();
  TrainedRun run;
  run.model = make_model(config);
  if (config.precision == Precision::kFp32) {
    auto optimizer = make_optimizer(run.model, config);
    for (int64_t step = 0; step < steps; ++step) {
      run.losses.push_back(train_step(
          run.model, *optimizer, data.batch(config.seed, step, config.batch, config.model.ctx)));
      run.stepped.push_back(true);
      run.scales.push_back(1.0);
    }
    run.weights = run.model->parameters();
    return run;
  }
  MasterWeights master(run.model, config);
  std::optional<LossScaler> scaler;
  if (config.precision == Precision::kFp16) scaler.emplace(scaler_options);
  for (int64_t step = 0; step < steps; ++step) {
    run.scales.push_back(scaler ? scaler->scale_value() : 1.0);
    bool stepped = true;
    run.losses.push_back(
        train_step_mixed(run.model, master, scaler ? &*scaler : nullptr,
                         data.batch(config.seed, step, config.batch, config.model.ctx), &stepped));
    run.stepped.push_back(stepped);
  }
  run.weights = master.master();
  return run;
}

std::vector<float> train_losses(const TrainConfig& config, int64_t steps) {
  return train_run(config, steps).losses;
}

// ---------------------------------------------------------------------------------------------
// The program
// ---------------------------------------------------------------------------------------------

namespace {

struct Options {  // lesson 02's own flags (the shared ones: dtc::TrainCli)
  std::string data;
  std::string save;
  std::string resume;
};

nlohmann::json bytes_json(int64_t params, int64_t grads, int64_t master, int64_t optimizer) {
  return {{"params", params}, {"grads", grads}, {"master", master}, {"optimizer", optimizer}};
}

// "fp32", or e.g. "bf16 (fp32 master weights, bf16 gradients)".
std::string precision_text(const TrainConfig& c) {
  if (c.precision == Precision::kFp32) return "fp32";
  const char* name = precision_name(c.precision);
  return fmt::format("{} (fp32 master weights and AdamW state, {} gradients{})", name,
                     c.fp32_grads ? "fp32" : name,
                     c.precision == Precision::kFp16 ? ", dynamic loss scaling" : "");
}

void print_memory(std::ostream& out, const TrainConfig& c, const LedgerPrediction& p,
                  const MeasuredMemory* m, const MeasuredMemory& t) {
  auto mib = [](double bytes) { return bytes / (1024.0 * 1024.0); };
  fmt::print(out,
             "\nMemory of one training step, {} + AdamW, recompute {}: measured vs lesson 01's "
             "ledger\n\n  {:<22} {:>14} {:>14} {:>14} {:>9} {:>10}\n",
             precision_name(c.precision), recompute_name(c.recompute), "", "allocator",
             "from tensors", "ledger", "MiB", "B/param");
  auto row = [&](const char* what, int64_t measured, int64_t tensors, int64_t ledger) {
    fmt::print(out, "  {:<22} {:>14} {:>14} {:>14} {:>9.2f} {:>10.2f}{}\n", what,
               m ? with_commas(measured) : "-", with_commas(tensors), with_commas(ledger),
               mib(static_cast<double>(ledger)),
               static_cast<double>(ledger) / static_cast<double>(p.params),
               m && measured != ledger ? "   <- differs" : "");
  };
  row("parameters", m ? m->params : 0, t.params, p.param_bytes);
  row("gradients", m ? m->grads : 0, t.grads, p.grad_bytes);
  if (p.master_bytes > 0) row("master weights", m ? m->master : 0, t.master, p.master_bytes);
  row("optimizer states", m ? m->optimizer : 0, t.optimizer, p.optimizer_bytes);
  if (m && !m->stepped) {
    fmt::print(out, "  (the loss scaler skipped the measured step: AdamW has made no state yet)\n");
  }
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
             "  your state_bytes() (fp32), the tensors MasterWeights holds (bf16/fp16); ledger:\n"
             "  lesson 01's formulas, activations for the blocks only (no dropout: 16sbh + as^2b\n"
             "  elements per layer, 16sbh selective, sbh full). README sections 6 and 9 explain\n"
             "  the activation difference.\n");
}

// The run's first lines: the model, the data and the training set-up.
void print_run_header(std::ostream& out, const TrainConfig& c, const Options& o,
                      const ByteDataset& data, int64_t params, int64_t first, int64_t steps,
                      const torch::Device& device) {
  fmt::print(out,
             "Lesson 02: the single-device baseline\n"
             "  model   GPT, {} layers, hidden {}, {} heads, seq {}, vocab {} (bytes), {} head: "
             "{} parameters\n"
             "  data    {} ({} bytes), {} x {} = {} tokens per step, seed {}\n"
             "  train   AdamW lr {:g}, steps {}..{}, on {} (LibTorch {})\n"
             "  numerics precision {}, recompute {}\n",
             c.model.layers, c.model.hidden, c.model.heads, c.model.ctx, c.model.vocab,
             c.model.tied ? "tied" : "untied", with_commas(params),
             o.data.empty() ? "data/coriolanus.txt" : o.data, with_commas(data.size()), c.batch,
             c.model.ctx, c.batch * c.model.ctx, c.seed, c.lr, first, steps - 1, device.str(),
             torch_version(), precision_text(c), recompute_name(c.recompute));
  out.flush();
}

// The --json line's "memory": predicted by the ledger, counted from the tensors, and measured
// by the allocator (null when this run was not measured).
nlohmann::json memory_json(const LedgerPrediction& predicted, const MeasuredMemory& from_tensors,
                           const MeasuredMemory* measured) {
  nlohmann::json mem;
  mem["predicted"] = bytes_json(predicted.param_bytes, predicted.grad_bytes, predicted.master_bytes,
                                predicted.optimizer_bytes);
  mem["predicted"]["activations"] = predicted.activation_bytes;
  mem["predicted"]["activations_per_layer"] = predicted.activation_bytes_per_layer;
  mem["from_tensors"] = bytes_json(from_tensors.params, from_tensors.grads, from_tensors.master,
                                   from_tensors.optimizer);
  mem["measured"] = nullptr;
  if (measured != nullptr) {
    mem["measured"] =
        bytes_json(measured->params, measured->grads, measured->master, measured->optimizer);
    mem["measured"]["activations"] = measured->activations;
    mem["measured"]["step_peak"] = measured->step_peak;
  }
  return mem;
}

int64_t tensor_bytes(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// The state a bf16/fp16 run holds, counted from MasterWeights' tensors.
MeasuredMemory mixed_state(Gpt& model, MasterWeights& master) {
  MeasuredMemory t;
  const StateBytes own = state_bytes(model, master.optimizer());
  t.params = own.params;
  t.optimizer = own.optimizer;
  for (size_t i = 0; i < master.master().size(); ++i) {
    t.grads += tensor_bytes(master.grad(i));
    t.master += tensor_bytes(master.master()[i]);
  }
  return t;
}

MeasuredMemory fp32_state(Gpt& model, torch::optim::AdamW& optimizer) {
  const StateBytes own = state_bytes(model, optimizer);
  MeasuredMemory t;
  t.params = own.params;
  t.grads = own.grads;
  t.optimizer = own.optimizer;
  return t;
}

int run(const TrainOptions& t, const Options& o, std::ostream& out, std::ostream& err) {
  // 1. configuration: the flags, checked before anything is built.
  const TrainConfig c = t.run_config();
  const ByteDataset data = o.data.empty() ? ByteDataset::builtin() : ByteDataset::from_file(o.data);
  data.offset(c.seed, 0, 0, c.model.ctx);  // checks that sequences fit in the corpus
  const bool mixed = c.precision != Precision::kFp32;
  if (mixed && (!o.save.empty() || !o.resume.empty())) {
    throw UsageError(o.save.empty() ? "--resume" : "--save",
                     fmt::format("checkpoints hold fp32 training, not --precision {}",
                                 precision_name(c.precision)),
                     "drop --save/--resume, or train with --precision fp32");
  }

  // 2. build: one device, the model (its bytes counted by the allocator), AdamW (over the fp32
  //    master weights in bf16/fp16).
  const torch::Device device = default_device();
  if (c.precision == Precision::kFp16 && device.is_cpu() && !kCpuFp16Training) {
    throw UsageError("--precision",
                     fmt::format("fp16 on the CPU needs LibTorch 2.x (this is {}: no CPU fp16 "
                                 "LayerNorm)",
                                 torch_version()),
                     "pass --precision bf16, or run on a GPU");
  }
  {
    // Lesson 01's ledger, before anything is allocated: a batch that cannot fit is a usage
    // error, not the allocator's "can't allocate". The ledger leaves out the logits (b s V,
    // fp32, and their gradient) and the batch's tokens (inputs and targets, int64): added here.
    const LedgerPrediction ledger =
        predict_memory(c.model, c.batch, c.precision, c.fp32_grads, c.recompute);
    const int64_t tokens = c.batch * c.model.ctx;
    const int64_t per_batch = ledger.activation_bytes + tokens * (2 * 4 * c.model.vocab + 2 * 8);
    const int64_t states =
        ledger.param_bytes + ledger.grad_bytes + ledger.master_bytes + ledger.optimizer_bytes;
    const int64_t have = available_memory(device);
    const int64_t fits =
        have > states ? (have - states) / std::max<int64_t>(per_batch / c.batch, 1) : 0;
    check_fits_in_memory(
        states + per_batch, device, "--global-batch",
        fmt::format("{} sequences of {} tokens: {} of activations, logits and tokens, {} of "
                    "weights, gradients and AdamW state, by lesson 01's ledger",
                    with_commas(c.batch), c.model.ctx, human_bytes(static_cast<double>(per_batch)),
                    human_bytes(static_cast<double>(states))),
        fits > 0 ? fmt::format("pass --global-batch {} or less (or a smaller model: --layers, "
                               "--hidden, --ctx)",
                               with_commas(fits))
                 : "the weights and optimizer state alone do not fit: pass a smaller model "
                   "(--layers, --hidden)");
  }
  install_counting_allocator();
  const int64_t before_model = device_bytes_now(device);
  Gpt model = make_model(c, device);
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::unique_ptr<MasterWeights> master;
  std::optional<LossScaler> scaler;
  int64_t model_bytes = device_bytes_now(device) - before_model;
  int64_t master_bytes = 0;
  if (mixed) {
    const int64_t before_copy = device_bytes_now(device);
    master = std::make_unique<MasterWeights>(
        model, c, [&] { master_bytes = device_bytes_now(device) - before_copy; });
    // the cast replaced the fp32 parameters by 16-bit ones
    model_bytes = device_bytes_now(device) - before_model - master_bytes;
    if (c.precision == Precision::kFp16) scaler.emplace();
  } else {
    optimizer = make_optimizer(model, c);
  }
  const int64_t first = o.resume.empty() ? 0 : load_checkpoint(o.resume, model, *optimizer);
  const int64_t steps = t.train.steps;
  check_resume_step(first, steps);
  const bool measure = (device.is_cpu() || device.is_cuda()) && first == 0;
  const int64_t tokens_per_step = c.batch * c.model.ctx;
  const int64_t params = count_parameters(*model);
  if (!t.train.json) print_run_header(out, c, o, data, params, first, steps, device);

  // --trace DIR: a timeline of the run (each step, each block's forward and backward, bytes in
  // use), one rank on its own clock.
  std::unique_ptr<Tracer> tracer;
  std::unique_ptr<TraceScope> tracing;
  if (!t.trace.empty()) {
    tracer = std::make_unique<Tracer>(0, device);
    tracing = std::make_unique<TraceScope>(tracer.get());
  }

  // 3. the loop: the first step of a fresh run is measured, byte by byte.
  StepLog log(err, /*talk=*/true, first, steps, tokens_per_step);
  MeasuredMemory measured;
  MeasuredMemory from_tensors;
  int64_t skipped = 0;
  for (int64_t step = first; step < steps; ++step) {
    log.begin_step();
    const Batch batch = data.batch(c.seed, step, c.batch, c.model.ctx).to(device);
    float loss = 0;
    LossScaler* s = scaler ? &*scaler : nullptr;
    if (step == first && measure) {
      measured = mixed ? measure_mixed_step(model, *master, s, batch, loss, device)
                       : measure_step(model, *optimizer, batch, loss, device);
      measured.params = model_bytes;
      measured.master = master_bytes;
      skipped += measured.stepped ? 0 : 1;
      from_tensors = mixed ? mixed_state(model, *master) : fp32_state(model, *optimizer);
    } else if (mixed) {
      bool stepped = true;
      loss = train_step_mixed(model, *master, s, batch, &stepped);
      skipped += stepped ? 0 : 1;
    } else {
      loss = train_step(model, *optimizer, batch);
    }
    log.end_step(step, loss);
  }
  if (!measure) from_tensors = mixed ? mixed_state(model, *master) : fp32_state(model, *optimizer);
  if (!o.save.empty()) save_checkpoint(o.save, model, *optimizer, steps);
  if (tracer) write_trace(*tracer, nullptr, 1, t.trace);

  // 4. the report.
  const LedgerPrediction predicted =
      predict_memory(c.model, c.batch, c.precision, c.fp32_grads, c.recompute);
  if (t.train.json) {
    nlohmann::json j = run_json(log, steps, device);
    j["param_digest"] = param_digest(*model);  // after the last step (dtc/digest.h)
    j["first_step"] = first;
    j["params"] = params;
    j["config"] = config_json(c.model, c.batch, c.seed, c.lr);
    j["precision"] = precision_name(c.precision);
    j["grad_dtype"] = c.fp32_grads || !mixed ? "fp32" : precision_name(c.precision);
    j["recompute"] = recompute_name(c.recompute);
    j["median_step_s"] = log.median_step_s();  // after 2 warm-up steps
    if (scaler) {
      j["loss_scale"] = scaler->scale_value();
      j["skipped_steps"] = skipped;
    }
    j["memory"] = memory_json(predicted, from_tensors, measure ? &measured : nullptr);
    print_json_line(out, j);
    return kExitOk;
  }
  const auto& losses = log.losses();
  fmt::print(out, "\n  trained steps {}..{}: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, {:.1f} s\n",
             first, steps - 1, losses.front(), losses.back(), log.tokens_per_s(), log.elapsed_s());
  if (scaler) {
    fmt::print(out, "  loss scale {:g} at the end; {} of {} steps skipped on inf/NaN gradients\n",
               scaler->scale_value(), skipped, steps - first);
  }
  if (!o.save.empty()) fmt::print(out, "  checkpoint: {} (after step {})\n", o.save, steps - 1);
  print_memory(out, c, predicted, measure ? &measured : nullptr, from_tensors);
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  TrainCli cli("lesson02",
               "Lesson 02: the single-device baseline. Trains the course's GPT on a byte-level "
               "corpus\n(CUDA when available, else the CPU; DTC_DEVICE=cpu forces the CPU) and "
               "compares the\nmemory of its first step with lesson 01's ledger.",
               /*default_steps=*/500);
  cli.add_precision_flags();
  Options o;
  cli.app().add_option("--data", o.data, "a text file to train on (default data/coriolanus.txt)");
  cli.app().add_option("--save", o.save, "write a checkpoint here after the last step");
  cli.app()
      .add_option("--resume", o.resume,
                  "continue from a checkpoint written by --save (same flags; --steps counts from "
                  "step 0)")
      ->check(readable_file("pass a checkpoint written by --save"));
  return cli.run(argc, argv, err, [&] { return run(cli.options(), o, out, err); });
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l02

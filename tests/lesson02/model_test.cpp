// Lesson 02 tests of the code the lesson gives: the course's GPT, its corpus and sampler, the
// counting allocator and the ledger's prediction. They pass on the untouched exercise.
// Expected values: PyTorch's own run (tests/reference/lesson02_reference.py), closed forms, and
// published parameter counts.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "baseline.h"
#include "dtc/compare.h"
#include "dtc/data.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/model.h"
#include "dtc_test.h"
#include "program.h"
#include "reference.h"

namespace dtc::l02 {
namespace {

using test::config_of;
using test::gpt_params;
using test::reference_case;

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

TEST(L02ModelGiven, ParamCountIsLesson01Formula) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    GptConfig m;
    m.tied = tied;
    Gpt model(m);
    EXPECT_EQ(count_parameters(*model), gpt_params(m))
        << "lesson 01's GPT count: L(12h^2 + 13h) + Vh + ctx*h + 2h (+ Vh untied)";
    EXPECT_EQ(predict_memory(m, 8).params, gpt_params(m));
  }
}

TEST(L02ModelGiven, Gpt2ShapeHasGpt2sCount) {
  // GPT-2 small as released: 124,439,808 parameters (Hugging Face's gpt2 checkpoint).
  GptConfig gpt2{50257, 1024, 768, 12, 12, true};
  EXPECT_EQ(predict_memory(gpt2, 1).params, 124439808);
}

TEST(L02ModelGiven, InitialWeightsMatchPyTorch) {
  for (const char* name : {"tiny_tied", "tiny_untied"}) {
    SCOPED_TRACE(name);
    const auto& ref = reference_case(name);
    Gpt model = make_model(config_of(ref));
    std::set<std::string> ours, theirs;
    for (const auto& item : ref.at("init").items()) theirs.insert(item.key());
    for (const auto& item : model->named_parameters()) {
      ours.insert(item.key());
      if (!ref.at("init").contains(item.key())) continue;
      const auto& r = ref.at("init").at(item.key());
      const auto flat = item.value().flatten();
      for (int64_t i = 0; i < 4 && i < flat.numel(); ++i) {
        EXPECT_EQ(flat[i].item<float>(), r.at("first")[i].get<float>())
            << item.key() << "[" << i << "]: same formula, same bits (PyTorch reference)";
      }
      const double sum = item.value().to(torch::kDouble).sum().item<double>();
      EXPECT_NEAR(sum, r.at("sum").get<double>(), 1e-9 + 1e-9 * std::fabs(sum)) << item.key();
    }
    EXPECT_EQ(ours, theirs) << "parameter names differ from the PyTorch reference model's";
  }
}

TEST(L02ModelGiven, InitialLossMatchesPyTorch) {
  // The loss of the first step is computed before any update: forward only.
  for (const char* name : {"tiny_tied", "tiny_untied"}) {
    SCOPED_TRACE(name);
    const auto& ref = reference_case(name);
    const TrainConfig c = config_of(ref);
    Gpt model = make_model(c);
    const Batch b = ByteDataset::builtin().batch(c.seed, 0, c.batch, c.model.ctx);
    torch::NoGradGuard no_grad;
    auto logits = model->forward(b.inputs);
    ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{c.batch, c.model.ctx, c.model.vocab}));
    const float loss =
        torch::nn::functional::cross_entropy(logits.view({-1, c.model.vocab}), b.targets.view({-1}))
            .item<float>();
    EXPECT_TENSOR_CLOSE(torch::tensor(loss), torch::tensor(ref.at("losses")[0].get<float>()),
                        kFp32VsPyTorch);
    // Closed form: weights of std 0.02 give logits near 0, a near-uniform prediction over 256
    // bytes, so the loss is near ln 256 = 5.545.
    EXPECT_CLOSE_REL(static_cast<double>(loss), std::log(256.0), 0.01, "closed form: ln V");
  }
}

TEST(L02ModelGiven, ForwardIsCausal) {
  // Changing a later token must not change the logits of earlier positions.
  GptConfig m{256, 16, 32, 2, 4, true};
  TrainConfig c;
  c.model = m;
  Gpt model = make_model(c);
  torch::NoGradGuard no_grad;
  auto a = torch::randint(0, 256, {1, 16}, torch::kLong);
  auto b = a.clone();
  b[0][10] = (a[0][10].item<int64_t>() + 1) % 256;
  auto la = model->forward(a), lb = model->forward(b);
  EXPECT_TENSOR_CLOSE(lb.slice(1, 0, 10), la.slice(1, 0, 10), kExact);
  EXPECT_FALSE(torch::equal(lb.slice(1, 10), la.slice(1, 10)));
}

TEST(L02ModelGiven, BadShapesAreUsageErrors) {
  GptConfig m;
  m.heads = 3;  // does not divide 128
  EXPECT_THROW(validate(m), UsageError);
  m = GptConfig{};
  m.layers = 0;
  EXPECT_THROW(Gpt{m}, UsageError);
}

// ---------------------------------------------------------------------------------------------
// The data
// ---------------------------------------------------------------------------------------------

TEST(L02DataGiven, CorpusIsTheShippedFile) {
  const auto& ref = test::reference();
  EXPECT_EQ(ByteDataset::builtin().size(), ref.at("corpus").at("bytes").get<int64_t>());
}

TEST(L02DataGiven, FirstBatchMatchesPyTorch) {
  const ByteDataset data = ByteDataset::builtin();
  for (const char* name : {"tiny_tied", "tiny_untied"}) {
    SCOPED_TRACE(name);
    const auto& ref = reference_case(name);
    const TrainConfig c = config_of(ref);
    const auto& first = ref.at("first_batch");
    for (int64_t r = 0; r < c.batch; ++r) {
      EXPECT_EQ(data.offset(c.seed, 0, r, c.model.ctx), first.at("offsets")[r].get<int64_t>());
    }
    const Batch b = data.batch(c.seed, 0, c.batch, c.model.ctx);
    EXPECT_TENSOR_CLOSE(b.inputs[0],
                        torch::tensor(first.at("inputs_row0").get<std::vector<int64_t>>()), kExact);
    EXPECT_TENSOR_CLOSE(
        b.targets[0], torch::tensor(first.at("targets_row0").get<std::vector<int64_t>>()), kExact);
  }
}

TEST(L02DataGiven, TargetsAreInputsShiftedByOne) {
  const Batch b = ByteDataset::builtin().batch(3, 5, 4, 32);
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{4, 32}));
  EXPECT_TENSOR_CLOSE(b.targets.slice(1, 0, 31), b.inputs.slice(1, 1, 32), kExact);
}

TEST(L02DataGiven, AnyRankCanComputeItsRows) {
  // Rows are a function of (seed, step, row): rows 2..3 alone equal rows 2..3 of the whole
  // batch, which is how a data-parallel rank will take its share of the baseline's batch.
  const ByteDataset data = ByteDataset::builtin();
  const Batch all = data.batch(1, 7, 4, 32);
  const Batch part = data.batch(1, 7, 2, 32, /*first_row=*/2);
  EXPECT_TENSOR_CLOSE(part.inputs, all.inputs.slice(0, 2, 4), kExact);
  EXPECT_FALSE(torch::equal(data.batch(2, 7, 4, 32).inputs, all.inputs)) << "seed must matter";
  EXPECT_FALSE(torch::equal(data.batch(1, 8, 4, 32).inputs, all.inputs)) << "step must matter";
}

TEST(L02DataGiven, SequenceLongerThanCorpusIsUsageError) {
  const ByteDataset tiny(std::vector<uint8_t>(10, 'a'));
  EXPECT_THROW(tiny.offset(1, 0, 0, 10), UsageError);
  EXPECT_NO_THROW(tiny.offset(1, 0, 0, 9));
  EXPECT_THROW(ByteDataset::from_file("/nonexistent/corpus.txt"), UsageError);
}

// ---------------------------------------------------------------------------------------------
// The counting allocator
// ---------------------------------------------------------------------------------------------

TEST(L02MemoryGiven, CountsEveryByte) {
  install_counting_allocator();
  ASSERT_TRUE(counting_allocator_installed());
  const int64_t before = cpu_memory().current;
  reset_cpu_peak();
  {
    auto a = torch::empty({1000}, torch::kFloat32);  // 4000 bytes
    EXPECT_EQ(cpu_memory().current - before, 4000);
    auto b = torch::empty({3000}, torch::kFloat32);  // 12000 bytes
    EXPECT_EQ(cpu_memory().current - before, 16000);
  }
  EXPECT_EQ(cpu_memory().current, before) << "freed tensors must be uncounted";
  EXPECT_EQ(cpu_memory().peak - before, 16000);
  {
    auto c = torch::empty({10}, torch::kDouble);  // 80 bytes
    EXPECT_EQ(cpu_memory().current - before, 80);
  }
}

TEST(L02MemoryGiven, ModelParametersAreFourBytesEach) {
  install_counting_allocator();
  TrainConfig c;
  c.model = GptConfig{256, 32, 64, 2, 4, true};
  const int64_t before = cpu_memory().current;
  Gpt model = make_model(c);
  EXPECT_EQ(cpu_memory().current - before, 4 * gpt_params(c.model))
      << "fp32: 4 bytes per parameter (lesson 01, section 2), and nothing else is kept";
}

// ---------------------------------------------------------------------------------------------
// The ledger's prediction
// ---------------------------------------------------------------------------------------------

TEST(L02LedgerGiven, FourFourEightBytesPerParameter) {
  // Lesson 01 section 2 / EleutherAI "Transformer Math 101": fp32 weights 4, gradients 4,
  // AdamW 8 (two fp32 moments).
  const GptConfig m;
  const LedgerPrediction p = predict_memory(m, 8);
  EXPECT_EQ(p.param_bytes, 4 * gpt_params(m));
  EXPECT_EQ(p.grad_bytes, 4 * gpt_params(m));
  EXPECT_EQ(p.optimizer_bytes, 8 * gpt_params(m));
}

TEST(L02LedgerGiven, ActivationsAreKorthikantiInFp32WithoutDropout) {
  // Korthikanti et al. 2022, Table 2: sbh(34 + 5as/h) bytes per layer in 16 bits with dropout.
  // Without dropout, drop the two sbh masks (34 -> 32) and the as^2b mask and 2as^2b dropout
  // output (5 -> 2); fp32 doubles the rest: 2 * (32sbh + 2as^2b) per layer.
  const GptConfig m;  // s = ctx = 64, h = 128, a = 4, L = 4
  const int64_t b = 8, s = m.ctx, h = m.hidden, a = m.heads;
  EXPECT_EQ(predict_memory(m, b).activation_bytes,
            m.layers * 2 * (32 * s * b * h + 2 * a * s * s * b));
}

}  // namespace
}  // namespace dtc::l02

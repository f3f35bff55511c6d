// The shared model flags (dtc/model_flags.h).
#include "dtc/model_flags.h"

#include "dtc/cli.h"

namespace dtc {

void add_model_flags(CLI::App& app, GptConfig& model, double& lr, bool* untied) {
  app.add_option("--layers", model.layers, "transformer blocks L")
      ->check(positive_count("--layers 4"))
      ->capture_default_str();
  app.add_option("--hidden", model.hidden, "model width h")
      ->check(positive_count("--hidden 128"))
      ->capture_default_str();
  app.add_option("--heads", model.heads, "attention heads a (they must divide --hidden)")
      ->check(positive_count("--heads 4"))
      ->capture_default_str();
  app.add_option("--seq", model.ctx, "tokens per sequence (the model's context)")
      ->check(positive_count("--seq 64"))
      ->capture_default_str();
  if (untied != nullptr) {
    app.add_flag("--untied", *untied, "a separate output head instead of the tied embedding");
  }
  app.add_option("--lr", lr, "AdamW learning rate")
      ->check(finite_positive("--lr 3e-3"))
      ->capture_default_str();
}

}  // namespace dtc

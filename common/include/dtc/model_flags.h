// The model and optimizer flags shared by the training programs (lesson 02 on), so that every
// lesson trains the same GPT from the same command line:
//   --layers L  --hidden h  --heads a  --seq T  [--untied]  --lr LR
#pragma once

#include <CLI/CLI.hpp>

#include "dtc/model.h"

namespace dtc {

/// Adds --layers, --hidden, --heads, --seq (the model's context) and --lr to @p app, bound to
/// @p model and @p lr, and --untied bound to @p untied unless it is nullptr (a program whose
/// model is always untied, such as the pipeline's, leaves the flag out).
void add_model_flags(CLI::App& app, GptConfig& model, double& lr, bool* untied = nullptr);

}  // namespace dtc

#include "dtc/cli.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <ostream>
#include <sstream>

#include "dtc/errors.h"
#include "dtc/todo.h"

namespace dtc {

void add_train_flags(CLI::App& app, TrainFlags& flags) {
  app.add_option("--steps", flags.steps, "optimizer steps to run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seed", flags.seed, "seed for weights and data")->capture_default_str();
  app.add_option("--global-batch", flags.global_batch, "sequences per step, all ranks together")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--json", flags.json, "print one JSON object on the last line of stdout");
  app.add_option("--backend", flags.backend, "collectives: gloo, or nccl on GPU nodes")
      ->check(CLI::IsMember({"gloo", "nccl"}))
      ->capture_default_str();
}

int run_cli(CLI::App& app, int argc, const char* const* argv, const std::function<int()>& body,
            std::ostream& err) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    err << app.help();
    return kExitOk;
  } catch (const CLI::CallForAllHelp&) {
    err << app.help("", CLI::AppFormatMode::All);
    return kExitOk;
  } catch (const CLI::CallForVersion& e) {
    err << e.what() << "\n";
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    fmt::print(err, "{}: error: {}\nHINT: run '{} --help' for the flags and their ranges\n",
               app.get_name(), e.what(), app.get_name());
    return kExitUsage;
  }
  try {
    return body();
  } catch (const UsageError& e) {
    fmt::print(err, "{}: error: {}\n", app.get_name(), e.what());
    return kExitUsage;
  } catch (const TodoError& e) {
    fmt::print(err, "{}: {}\n", app.get_name(), e.what());
    return kExitTodo;
  } catch (const std::exception& e) {
    fmt::print(err, "{}: failed: {}\n", app.get_name(), e.what());
    return kExitFailure;
  }
}

void print_json_line(std::ostream& out, const nlohmann::json& object) {
  out << object.dump() << std::endl;
}

}  // namespace dtc

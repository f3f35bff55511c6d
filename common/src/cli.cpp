#include "dtc/cli.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <sstream>

#include <unistd.h>

#include "dtc/errors.h"
#include "dtc/todo.h"

namespace dtc {
namespace {

// LibTorch's errors (c10::Error) carry a C++ stack trace after their message ("Exception raised
// from ... frame #0 ..."): noise for an error a user can cause. DTC_SHOW_STACKTRACE=1 keeps it.
std::string without_backtrace(const std::string& what) {
  const char* keep = std::getenv("DTC_SHOW_STACKTRACE");
  if (keep && std::string(keep) == "1") return what;
  for (const char* marker : {"\nException raised from ", "Exception raised from ", "\nframe #0"}) {
    auto at = what.find(marker);
    if (at != std::string::npos && at > 0) return what.substr(0, at);
  }
  return what;
}

}  // namespace

namespace {
CLI::Validator count_at_least(int64_t least, const std::string& example) {
  return CLI::Validator(
      [least, example](std::string& text) -> std::string {
        int64_t value = 0;
        if (CLI::detail::lexical_cast(text, value) && value >= least) return {};
        return fmt::format("'{}' is not a whole number >= {}: pass e.g. {}", text, least, example);
      },
      fmt::format("N >= {}", least));
}
}  // namespace

CLI::Validator positive_count(const std::string& example) { return count_at_least(1, example); }

CLI::Validator non_negative_count(const std::string& example) { return count_at_least(0, example); }

CLI::Validator finite_positive(const std::string& example) {
  return CLI::Validator(
      [example](std::string& text) -> std::string {
        double value = 0;
        if (CLI::detail::lexical_cast(text, value) && std::isfinite(value) && value > 0) {
          return {};
        }
        return fmt::format("'{}' is not a finite number > 0: pass e.g. {}", text, example);
      },
      "X > 0");
}

CLI::Validator one_of(std::vector<std::string> values, const std::string& what) {
  std::string list;
  for (const auto& v : values) list += (list.empty() ? "" : ", ") + v;
  return CLI::Validator(
      [values, list, what](std::string& text) -> std::string {
        for (const auto& v : values) {
          if (text == v) return {};
        }
        return fmt::format("'{}' is not {}: use one of {}", text, what, list);
      },
      "{" + list + "}");
}

CLI::Validator readable_file(const std::string& hint) {
  return CLI::Validator(
      [hint](std::string& path) -> std::string {
        if (std::ifstream(path).good()) return {};
        return fmt::format("cannot read '{}': {}", path, hint);
      },
      "FILE");
}

CLI::Validator existing_directory(const std::string& hint) {
  return CLI::Validator(
      [hint](std::string& path) -> std::string {
        if (std::filesystem::is_directory(path)) return {};
        return fmt::format("'{}' is not a directory: {}", path, hint);
      },
      "DIR");
}

CLI::Validator writable_directory(const std::string& hint) {
  return CLI::Validator(
      [hint](std::string& path) -> std::string {
        namespace fs = std::filesystem;
        std::error_code ec;
        if (path.empty()) return fmt::format("an empty path is no directory: {}", hint);
        if (fs::exists(path, ec) && !fs::is_directory(path, ec)) {
          return fmt::format("'{}' is a file, not a directory: {}", path, hint);
        }
        if (!fs::create_directories(path, ec) && ec) {
          return fmt::format("cannot create the directory '{}' ({}): {}", path, ec.message(), hint);
        }
        // Creating it is not writing in it (a read-only mount, another user's directory).
        const fs::path probe = fs::path(path) / fmt::format(".write-probe-{}", ::getpid());
        {
          std::ofstream out(probe);
          if (!out) return fmt::format("cannot write files in '{}': {}", path, hint);
        }
        fs::remove(probe, ec);
        return {};
      },
      "DIR");
}

void add_train_flags(CLI::App& app, TrainFlags& flags) {
  app.add_option("--steps", flags.steps, "optimizer steps to run")
      ->check(positive_count("--steps 20"))
      ->capture_default_str();
  app.add_option("--seed", flags.seed, "seed for weights and data")->capture_default_str();
  app.add_option("--global-batch", flags.global_batch, "sequences per step, all ranks together")
      ->check(positive_count("--global-batch 8"))
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
    fmt::print(err, "{}: failed: {}\n", app.get_name(), without_backtrace(e.what()));
    return kExitFailure;
  }
}

void print_json_line(std::ostream& out, const nlohmann::json& object) {
  out << object.dump() << std::endl;
}

}  // namespace dtc

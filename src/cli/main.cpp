// The `weightstream` command.
#include <iostream>
#include <string>
#include <string_view>

#include "cli/command.hpp"
#include "cli/draft_flags.hpp"
#include "cli/peer_flags.hpp"
#include "cli/update_via.hpp"
#include "weightstream/error.hpp"

namespace {

/// Usage errors (a bad flag, a missing argument, an unknown command) exit with 2, as
/// getopt-style tools and the shells' builtins do; failures of the work itself exit with 1.
constexpr int kUsageExit = 2;
/// A bug (an exception that is not a weightstream::Error); 3 is audit's "not clean".
constexpr int kInternalExit = 70;  // EX_SOFTWARE of sysexits.h

std::string command_list(const CLI::App& app) {
  std::string names;
  for (const CLI::App* command : app.get_subcommands([](const CLI::App* sub) { return !sub->get_group().empty(); })) {
    names += (names.empty() ? "" : ", ") + command->get_name();
  }
  return names;
}

/// One line: CLI11 may spread a message over several.
std::string one_line(std::string text) {
  for (size_t at = 0; (at = text.find('\n', at)) != std::string::npos;) text.replace(at, 1, "; ");
  while (text.size() >= 2 && text.ends_with("; ")) text.resize(text.size() - 2);
  return text;
}

int usage_error(const std::string& message) {
  std::cout.flush();
  std::cerr << "weightstream: error: " << one_line(message) << " (see weightstream --help)\n";
  return kUsageExit;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"weightstream: stream safetensors checkpoints from disk or object storage into host or GPU memory"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "weightstream 0.1.0");
  weightstream::cli::add_inspect_command(app);
  weightstream::cli::add_load_command(app);
  weightstream::cli::add_digest_command(app);
  weightstream::cli::add_synth_command(app);
  weightstream::cli::add_plan_command(app);
  weightstream::cli::add_export_command(app);
  weightstream::cli::add_audit_command(app);
  weightstream::cli::add_s3_command(app);
  weightstream::cli::add_resolve_command(app);
  weightstream::cli::add_serve_command(app);
  if (argc >= 2) {
    std::string_view first = argv[1];
    const CLI::App& commands = app;
    bool known = !commands.get_subcommands([&](const CLI::App* sub) { return sub->check_name(std::string(first)); }).empty();
    if (!first.starts_with("-") && !known) {
      return usage_error("unknown command '" + std::string(first) + "' (commands: " + command_list(app) + ")");
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& request) {
    return app.exit(request);
  } catch (const CLI::CallForAllHelp& request) {
    return app.exit(request);
  } catch (const CLI::CallForVersion& request) {
    return app.exit(request);
  } catch (const CLI::RuntimeError& status) {
    // A command's verdict, not a usage error: `audit` ends with 3 when the load is not
    // clean, after its report; no error line follows it.
    std::cout.flush();
    return status.get_exit_code();
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return app.exit(error);
    return usage_error(error.what());
  } catch (const weightstream::Error& error) {
    // A flag's value that is malformed, out of range or in conflict with another flag is a
    // usage error, however deep the check that found it (parse_size, the layout's rules).
    if (error.code() == weightstream::ErrorCode::kInvalidArgument) return usage_error(error.what());
    std::cout.flush();
    std::cerr << "weightstream: error: " << error.what() << "\n";
    return 1;
  } catch (const std::exception& error) {
    std::cout.flush();
    std::cerr << "weightstream: internal error: " << error.what() << "\n";
    return kInternalExit;
  }
  return 0;
}

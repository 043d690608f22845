// The `weightstream` command.
#include <iostream>

#include "cli/command.hpp"
#include "cli/draft_flags.hpp"
#include "weightstream/error.hpp"

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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  } catch (const weightstream::Error& error) {
    std::cout.flush();
    std::cerr << "weightstream: error: " << error.what() << "\n";
    return 1;
  } catch (const std::exception& error) {
    std::cout.flush();
    std::cerr << "weightstream: internal error: " << error.what() << "\n";
    return 2;
  }
  return 0;
}

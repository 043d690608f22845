// weightstream export URI OUT.safetensors [--tp-size T] [--tp-rank R] [--quantize fp8]
// Writes this rank's parameters as loaded (engine layout, after processing and hooks), so
// a rank can later load a pre-sharded checkpoint directly (TensorFormat::kEngine).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "cli/layout_flags.hpp"
#include "cli/metrics.hpp"
#include "cli/peer_flags.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream::cli {
namespace {

/// Throws Error(kInvalidArgument) when `output` is the local checkpoint `uri` (a file) or
/// lies inside it (a directory): written over, a shard the index names would hold the
/// export instead, and the checkpoint would be broken. Symbolic links and `..` are
/// resolved first; a hard link to the checkpoint file is caught by its inode.
void refuse_output_inside_input(const std::string& uri, const std::string& output) {
  if (source_kind(uri) != SourceKind::kFile) return;
  Uri input = parse_uri(uri);
  namespace fs = std::filesystem;
  std::error_code error;
  fs::path source = fs::weakly_canonical(fs::absolute(input.path), error);
  fs::path target = fs::weakly_canonical(fs::absolute(output), error);
  if (error) return;  // an unresolvable path is reported by the read or the write itself
  bool inside = fs::is_directory(source, error)
                    ? std::mismatch(source.begin(), source.end(), target.begin(), target.end()).first == source.end()
                    : target == source || fs::equivalent(source, target, error);
  if (inside) {
    throw Error(ErrorCode::kInvalidArgument,
                              "export: the output " + output + " is " + (target == source ? "" : "inside ") +
                                  "the checkpoint " + uri +
                                  " that it reads; writing it would replace the checkpoint's own bytes. Write it elsewhere");
  }
}

struct ExportFlags {
  std::string uri;
  std::string output;
  LayoutFlags layout;
  bool json = false;
  StreamFlags stream;
  PeerFlags peer;  // peer:// sources
  MetricsFlags metrics;
};

}  // namespace

void add_export_command(CLI::App& app) {
  auto flags = std::make_shared<ExportFlags>();
  auto* command = app.add_subcommand("export", "Write this rank's parameters, as loaded, to one safetensors file");
  command->add_option("uri", flags->uri, "Checkpoint with config.json: a directory, file://, s3://, gs:// or az://")->required();
  command->add_option("output", flags->output, "The .safetensors file to write")->required();
  add_layout_flags(*command, flags->layout);
  command->add_flag("--json", flags->json, "Print JSON: output, layout, tensors, bytes");
  add_stream_flags(*command, flags->stream);
  add_peer_flags(*command, flags->peer);
  add_metrics_flags(*command, flags->metrics);  // the load's series (docs/METRICS.md)
  add_metrics_linger_flag(*command, flags->metrics);
  command->callback([flags] {
    refuse_output_inside_input(flags->uri, flags->output);
    Options options = resolve_options(flags->stream);
    std::unique_ptr<MetricsEndpoint> metrics = start_metrics(flags->metrics);
    LoadProgress progress;
    Publication progress_series = publish(metrics.get(), [&progress] { return progress.series(); });
    Publication load_series;
    SourceLayout loaded;
    {
      ProgressLine line(progress_enabled(flags->stream, options) && !flags->json, progress.observer());
      loaded = load_from_source(flags->uri, flags->layout, Device{}, flags->peer, options,
                                [&line](uint64_t done, uint64_t total) { line.update(done, total); });
    }
    const bool from_checkpoint = source_is_checkpoint(loaded.load.kind) && loaded.load.failure.empty();
    load_series = publish_load(metrics.get(),
                               source_load_record(loaded.load), flags->metrics);
    const ModelLayout& layout = loaded.layout;
    SafetensorsWriter writer;
    uint64_t bytes = 0;
    for (const Parameter& parameter : layout.parameters()) {
      std::vector<std::byte> data = parameter_bytes(parameter);
      bytes += data.size();
      writer.add(parameter.name, parameter.dtype, parameter.shape, data);
    }
    writer.set_metadata("format", "weightstream-engine");
    writer.set_metadata("layout", layout.description());
    writer.set_metadata("tp_size", std::to_string(flags->layout.tp_size.value_or(1)));
    writer.set_metadata("tp_rank", std::to_string(flags->layout.tp_rank.value_or(0)));
    writer.set_metadata("source", loaded.load.uri);
    writer.write(flags->output);
    if (flags->json) {
      nlohmann::json result = {{"output", flags->output},
                               {"layout", layout.description()},
                               {"tensors", layout.parameters().size()},
                               {"bytes", bytes}};
      if (!from_checkpoint) result.update(peer_load_json(loaded));
      print_json(result);
    } else {
      std::printf("wrote %zu parameters (%s) of %s to %s\n", layout.parameters().size(), format_size(bytes).c_str(),
                  layout.description().c_str(), flags->output.c_str());
    }
    linger_metrics(metrics.get(), flags->metrics);
  });
}

}  // namespace weightstream::cli

// weightstream load URI [--device cpu|cuda:N] [--concurrency N] [--memory-limit SIZE] [--json]
//                       [--metrics-listen HOST:PORT [--link-rate GB/S] [--metrics-linger SECONDS]]
#include <algorithm>
#include <cstdio>

#include "cli/command.hpp"
#include "cli/draft_flags.hpp"
#include "cli/layout_flags.hpp"
#include "cli/metrics.hpp"
#include "cli/peer_flags.hpp"
#include "weightstream/load.hpp"

namespace weightstream::cli {

namespace {
struct LoadFlags {
  std::string uri;
  std::string device = "cpu";
  bool json = false;
  StreamFlags stream;
  MetricsFlags metrics;
};

/// Runs the load the flags ask for (the first path that takes them) and prints its summary;
/// `observer` sees its progress (a pull from peers reports none).
LoadRecord run_load(const LoadFlags& flags, const LayoutLoadFlags& layout_flags, const DraftFlags& draft_flags,
                    const PeerFlags& peer_flags, const ProgressCallback& observer) {
  if (!flags.uri.empty() && !source_is_checkpoint(source_kind(flags.uri))) {  // peers serve layouts only
    return run_peer_load(flags.uri, layout_flags.layout, flags.device, peer_flags, flags.stream, flags.json);
  }
  if (draft_flags.requested()) {  // source resolution and drafts
    return run_draft_load(flags.uri, draft_flags, layout_options_from_flags(layout_flags.layout), flags.device,
                          flags.stream, flags.json, observer);
  }
  if (flags.uri.empty()) throw CLI::RequiredError("uri");
  if (layout_flags.requested()) {  // model layout path
    return run_layout_load(flags.uri, layout_flags.layout, flags.device, flags.stream, flags.json, observer);
  }
  auto options = resolve_options(flags.stream);
  auto device = parse_device(flags.device);
  auto checkpoint = Checkpoint::open(flags.uri, options);
  LoadedCheckpoint loaded;
  {
    ProgressLine progress(progress_enabled(flags.stream, options) && !flags.json, observer);
    loaded = load_checkpoint(checkpoint, device, options.stream,
                             [&progress](uint64_t done, uint64_t total) { progress.update(done, total); });
  }
  // Tensors handed out as copy-on-write views of the page cache (a host load at --io auto
  // or mmap), the rest copied.
  auto in_place = static_cast<uint64_t>(std::ranges::count_if(loaded.tensors, &LoadedTensor::in_place));
  if (flags.json) {
    auto summary = stats_json(stat_fields(loaded.stats));
    summary["uri"] = checkpoint.uri();
    summary["device"] = device.name();
    summary["shards"] = checkpoint.shards().size();
    summary["tensors_in_place"] = in_place;
    print_json(summary);
  } else {
    print_stream_summary("loaded", loaded.stats, device.name());
    if (in_place > 0) {
      std::printf("%llu of them in place: copy-on-write views of the page cache (--io pread copies them)\n",
                  static_cast<unsigned long long>(in_place));
    }
  }
  return checkpoint_load_record(checkpoint, loaded.stats);
}

}  // namespace

void print_stream_summary(const char* verb, const StreamStats& stats, const std::string& device) {
  std::printf("%s %llu tensors, %s in %.3f s (%.2f GB/s) to %s; peak staging %s\n", verb,
              static_cast<unsigned long long>(stats.tensors), format_size(stats.bytes).c_str(), stats.seconds, stats.gbps(),
              device.c_str(), format_size(stats.peak_staging_bytes).c_str());
}

void add_load_command(CLI::App& app) {
  auto flags = std::make_shared<LoadFlags>();
  auto* command = app.add_subcommand("load", "Stream every tensor of a checkpoint into memory and report the throughput");
  // Required unless the resolve path below is taken (its sources can name the checkpoint).
  command->add_option("uri", flags->uri, "Checkpoint: a .safetensors file, a directory, file://, s3://, gs:// or az://");
  command->add_option("--device", flags->device, "Destination: cpu or cuda:N (default cpu)");
  command->add_flag("--json", flags->json, "Print JSON: tensors, bytes, seconds, gbps, peak_staging_bytes, ...");
  add_stream_flags(*command, flags->stream);
  // ---- model layout path (model layer; see cli/layout_flags.hpp) ----
  // --tp-size/--tp-rank/--ep-size build the layout from config.json and load through a
  // LoadSession; --raw (or no layout flag) keeps the plain tensor load below.
  auto layout_flags = std::make_shared<LayoutLoadFlags>();
  add_layout_load_flags(*command, *layout_flags);
  // ---- end of model layout path ----
  // ---- source resolution and drafts (resolve layer; see cli/draft_flags.hpp) ----
  // --model/--model-weights/--speculative mtp/--draft-only resolve the target's and the
  // draft's sources and load them as modules; the URI, when given, is the target's --model.
  auto draft_flags = std::make_shared<DraftFlags>();
  add_draft_load_flags(*command, *draft_flags);
  for (const char* name : {"--model", "--model-weights", "--draft-model", "--draft-model-weights", "--speculative",
                           "--draft-only", "--share-embeddings"}) {
    command->get_option("--raw")->excludes(command->get_option(name));
  }
  // ---- end of source resolution and drafts ----
  auto peer_flags = std::make_shared<PeerFlags>();  // peer:// sources (cli/peer_flags.hpp)
  add_peer_flags(*command, *peer_flags);
  add_metrics_flags(*command, flags->metrics);  // docs/METRICS.md
  add_metrics_linger_flag(*command, flags->metrics);
  command->callback([flags, layout_flags, draft_flags, peer_flags] {
    // Before the load, so that a scrape during a long load reaches it; a port in use fails here.
    std::unique_ptr<MetricsEndpoint> metrics = start_metrics(flags->metrics);
    LoadProgress progress;
    Publication progress_series = publish(metrics.get(), [&progress] { return progress.series(); });
    Publication load_series = publish_load(
        metrics.get(), run_load(*flags, *layout_flags, *draft_flags, *peer_flags, progress.observer()), flags->metrics);
    linger_metrics(metrics.get(), flags->metrics);
  });
}

}  // namespace weightstream::cli

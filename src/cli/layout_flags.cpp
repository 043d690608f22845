#include "cli/layout_flags.hpp"

#include <cstdio>

#include "weightstream/error.hpp"

namespace weightstream::cli {

void add_layout_flags(CLI::App& command, LayoutFlags& flags) {
  command.add_option("--tp-size", flags.tp_size, "Tensor-parallel ranks (default 1)")->check(CLI::Range(1, 4096));
  command.add_option("--tp-rank", flags.tp_rank, "This tensor-parallel rank (default 0)")->check(CLI::Range(0, 4095));
  command.add_option("--ep-size", flags.ep_size, "Expert-parallel ranks: routed experts divided whole (default 1)")
      ->check(CLI::Range(1, 4096));
  command.add_option("--ep-rank", flags.ep_rank, "This expert-parallel rank (default 0)")->check(CLI::Range(0, 4095));
  command.add_option("--quantize", flags.quantize, "Per-layer processing of linear weights: none or fp8 (E4M3, per-tensor scale)")
      ->check(CLI::IsMember({"none", "fp8"}));
}

Parallelism parallelism_from_flags(const LayoutFlags& flags) {
  Parallelism parallel{flags.tp_size.value_or(1), flags.tp_rank.value_or(0), flags.ep_size, flags.ep_rank};
  WS_EXPECT(parallel.tp_rank < parallel.tp_size, ErrorCode::kInvalidArgument,
            "--tp-rank " + std::to_string(parallel.tp_rank) + " must be below --tp-size " +
                std::to_string(parallel.tp_size));
  WS_EXPECT(parallel.ep_rank < parallel.ep_size, ErrorCode::kInvalidArgument,
            "--ep-rank " + std::to_string(parallel.ep_rank) + " must be below --ep-size " +
                std::to_string(parallel.ep_size));
  return parallel;
}

LayoutOptions layout_options_from_flags(const LayoutFlags& flags) {
  LayoutOptions options;
  options.parallel = parallelism_from_flags(flags);
  if (flags.quantize == "fp8") options.quantize = Processing::kFp8PerTensor;
  return options;
}

ModelLayout checkpoint_layout(const Checkpoint& checkpoint, const LayoutFlags& flags, const Device& device,
                              const ModelConfig* held_as) {
  EngineLayoutOptions options;
  options.layout = layout_options_from_flags(flags);
  options.device = device;
  if (held_as != nullptr) options.held_as = *held_as;
  return engine_layout(checkpoint, options);
}

void add_layout_load_flags(CLI::App& command, LayoutLoadFlags& flags) {
  add_layout_flags(command, flags.layout);
  auto* raw = command.add_flag("--raw", flags.raw,
                               "Plain tensor load, without a model layout (the default without a layout flag)");
  for (const char* name : {"--tp-size", "--tp-rank", "--ep-size", "--ep-rank", "--quantize"}) {
    raw->excludes(command.get_option(name));
  }
}

LoadRecord run_layout_load(const std::string& uri, const LayoutFlags& flags, const std::string& device_name,
                           const StreamFlags& stream_flags, bool json, const ProgressCallback& observer) {
  Options options = resolve_options(stream_flags);
  Device device = parse_device(device_name);
  Checkpoint checkpoint = Checkpoint::open(uri, options);
  WS_EXPECT(checkpoint.config_json().has_value(), ErrorCode::kNotFound,
            checkpoint.uri() + " has no config.json beside its shards: --tp-size, --tp-rank, --ep-size, --ep-rank "
                               "and --quantize need it to build the model layout (without them, load reads every "
                               "tensor as it is)");
  ModelLayout layout = checkpoint_layout(checkpoint, flags, device);
  LayoutLoad load;
  {
    ProgressLine progress(progress_enabled(stream_flags, options) && !json, observer);
    load = load_layout(layout, checkpoint, LoadMode::kCold, options.stream,
                       [&progress](uint64_t done, uint64_t total) { progress.update(done, total); });
  }
  uint64_t parameter_bytes = 0;
  for (const Parameter& parameter : layout.parameters()) parameter_bytes += parameter.bytes();
  if (json) {
    nlohmann::json report = stats_json(stat_fields(load.stream));
    report.update({{"uri", checkpoint.uri()},
                   {"layout", layout.description()},
                   {"device", device.name()},
                   {"parameters", layout.parameters().size()},
                   {"parameter_bytes", parameter_bytes},
                   {"checkpoint_bytes", checkpoint.tensor_bytes()},
                   {"session", stats_json(stat_fields(load.counters))}});
    print_json(report);
    return checkpoint_load_record(checkpoint, load.stream);
  }
  std::printf("loaded %s (%s) of %s into %s: read %s of %s in %.3f s (%.2f GB/s); %s\n",
              counted(layout.parameters().size(), "parameter").c_str(), format_size(parameter_bytes).c_str(),
              layout.description().c_str(), device.name().c_str(), format_size(load.stream.bytes).c_str(),
              format_size(checkpoint.tensor_bytes()).c_str(), load.stream.seconds, load.stream.gbps(),
              counted(load.counters.model_hook_runs, "model hook run").c_str());
  return checkpoint_load_record(checkpoint, load.stream);
}

}  // namespace weightstream::cli

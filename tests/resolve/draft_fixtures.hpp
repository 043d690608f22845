#pragma once
// Fixtures of the source-resolution and draft tests: a deepseek_v3 checkpoint with MTP
// layers from synthesize_checkpoint (fixed seed), a model directory that holds only config
// and tokenizer files (as an engine's local snapshot does), and one module set up the way an
// engine sets it up: config, layout with storage, resolution.

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "support/test_support.hpp"
#include "weightstream/resolve.hpp"

namespace weightstream::testing {

/// SynthOptions of a small deepseek_v3 with `mtp_layers` MTP layers over `shards` shards.
inline SynthOptions deepseek_options(int64_t mtp_layers = 1, int64_t shards = 4, uint64_t seed = 5) {
  SynthOptions options;
  options.arch = "deepseek_v3";
  options.layers = 2;
  options.hidden = 64;
  options.vocab = 1000;
  options.shards = shards;
  options.seed = seed;
  options.mtp_layers = mtp_layers;
  return options;
}

/// A synthesized checkpoint on disk.
struct SynthCheckpoint {
  TempDir directory;
  SynthResult result;
  std::string uri() const { return directory.path().string(); }
};

inline std::unique_ptr<SynthCheckpoint> synth_checkpoint(const SynthOptions& options) {
  auto checkpoint = std::make_unique<SynthCheckpoint>();
  checkpoint->result = synthesize_checkpoint(checkpoint->directory.path(), options);
  return checkpoint;
}

/// A model directory with config.json (copied from `checkpoint`) and tokenizer files only.
inline void write_config_only_model(const std::filesystem::path& directory, const SynthCheckpoint& checkpoint) {
  std::filesystem::create_directories(directory);
  std::filesystem::copy_file(checkpoint.directory.path() / "config.json", directory / "config.json");
  write_file(directory / "tokenizer.json", R"({"version": "1.0", "model": {"type": "BPE"}})");
  write_file(directory / "tokenizer_config.json", R"({"model_max_length": 4096})");
}

/// True for a tensor of an MTP layer of `config` (model.layers.{num_hidden_layers + i}.*).
inline bool is_mtp_tensor(const ModelConfig& config, const std::string& name) {
  for (int64_t i = 0; i < config.num_nextn_predict_layers; ++i) {
    if (name.starts_with("model.layers." + std::to_string(config.num_hidden_layers + i) + ".")) return true;
  }
  return false;
}

/// Bytes of the MTP tensors and the shards that hold them, from the opened checkpoint.
struct MtpFootprint {
  uint64_t bytes = 0;
  uint64_t tensors = 0;
  std::set<std::string> shards;
};

inline MtpFootprint mtp_footprint(const Checkpoint& checkpoint, const ModelConfig& config) {
  MtpFootprint footprint;
  for (const CheckpointTensor& tensor : checkpoint.tensors()) {
    if (!is_mtp_tensor(config, tensor.name)) continue;
    footprint.bytes += tensor.bytes;
    ++footprint.tensors;
    footprint.shards.insert(checkpoint.shards()[tensor.shard].name);
  }
  return footprint;
}

/// One module as an engine sets it up: layout (host storage allocated) and resolution.
struct ModuleFixture {
  ModelLayout layout;
  SourceResolution resolution;
  ModuleLoadRequest request() { return {resolution.role, &layout, resolution}; }
};

inline ModuleFixture module_fixture(ModuleRole role, const ModelSource& source, const std::string& checkpoint_uri,
                                    const Options& options, bool allocate = true) {
  ModuleFixture module;
  ModelConfigSource config = find_model_config(source, checkpoint_uri, options);
  module.layout = build_module_layout(config.config, role);
  if (allocate) module.layout.allocate(Device{});
  module.resolution = resolve_source(source, checkpoint_uri, role, module.layout, options,
                                     role == ModuleRole::kDraft ? "mtp" : "");
  return module;
}

/// A fresh layout of `role` cold-loaded straight from `checkpoint` (the reference).
inline ModelLayout reference_layout(const Checkpoint& checkpoint, ModuleRole role) {
  ModelLayout layout = build_module_layout(checkpoint_model_config(checkpoint), role);
  layout.allocate(Device{});
  load_layout(layout, checkpoint, LoadMode::kCold, StreamOptions{});
  return layout;
}

}  // namespace weightstream::testing

#pragma once
// Fixtures of the source-resolution and draft tests: deepseek_v3 and qwen3_next checkpoints
// with MTP layers from synthesize_checkpoint (fixed seeds), a model directory that holds only config
// and tokenizer files (as an engine's local snapshot does), and one module set up the way an
// engine sets it up: config, layout with storage, resolution.

#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "support/test_support.hpp"
#include "weightstream/error.hpp"
#include "weightstream/synth.hpp"
#include "weightstream/resolve.hpp"

namespace weightstream::testing {

/// SynthOptions of a small `arch` model of `layers` layers with `mtp_layers` MTP layers over
/// `shards` shards.
inline SynthOptions mtp_model_options(const std::string& arch, int64_t layers, int64_t mtp_layers, int64_t shards,
                                      uint64_t seed) {
  SynthOptions options;
  options.arch = arch;
  options.layers = layers;
  options.hidden = 64;
  options.vocab = 1000;
  options.shards = shards;
  options.seed = seed;
  options.mtp_layers = mtp_layers;
  return options;
}

/// A small deepseek_v3 (two layers).
inline SynthOptions deepseek_options(int64_t mtp_layers = 1, int64_t shards = 4, uint64_t seed = 5) {
  return mtp_model_options("deepseek_v3", 2, mtp_layers, shards, seed);
}

/// A small qwen3_next (four layers: three Gated DeltaNet, one full attention); its mtp.*
/// module comes last.
inline SynthOptions qwen3_next_options(int64_t mtp_layers = 1, int64_t shards = 4, uint64_t seed = 3) {
  return mtp_model_options("qwen3_next", 4, mtp_layers, shards, seed);
}

/// An architecture whose checkpoint ships MTP layers, as the draft tests use it.
struct MtpArchitecture {
  std::string name;
  SynthOptions (*options)(int64_t mtp_layers, int64_t shards, uint64_t seed);
  std::string first_layer_tensor;      ///< a tensor of the first MTP layer, loaded whole into its namesake
  std::string first_layer_label;       ///< "MTP layer 2"
  std::string second_layer_label;      ///< "MTP layer 3"
  std::string second_layer_prefix;     ///< how the second MTP layer's tensors are named
  std::string second_layer_parameter;  ///< a parameter of the second MTP layer
};

/// DeepSeek-V3 (MTP layers continue model.layers) and Qwen3-Next (its MTP module under mtp.*).
inline std::vector<MtpArchitecture> mtp_architectures() {
  return {{"deepseek_v3", deepseek_options, "model.layers.2.eh_proj.weight", "MTP layer 2", "MTP layer 3",
           "model.layers.3.", "model.layers.3.eh_proj.weight"},
          {"qwen3_next", qwen3_next_options, "mtp.fc.weight", "MTP layer 4", "MTP layer 5", "mtp.layers.1.",
           "mtp.layers.1.self_attn.qkv_proj.weight"}};
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

/// What a test of resolution and drafts starts from: a synthesized checkpoint, and the
/// engine's local snapshot of its model (config and tokenizer files only).
class SnapshotFixture {
 protected:
  void make_checkpoint(const SynthOptions& options) {
    checkpoint_ = synth_checkpoint(options);
    snapshot_ = scratch_.path() / "snapshot";
    write_config_only_model(snapshot_, *checkpoint_);
  }
  std::string snapshot() const { return snapshot_.string(); }
  std::string weights() const { return checkpoint_->uri(); }
  const ModelConfig& config() const { return checkpoint_->result.config; }

  std::unique_ptr<SynthCheckpoint> checkpoint_;
  TempDir scratch_;
  std::filesystem::path snapshot_;
  Options options_;
};

/// The message of the Error that `action` throws (its code in `code`); fails the test when
/// it throws none.
template <typename Action>
std::string error_of(Action&& action, ErrorCode* code = nullptr) {
  try {
    action();
  } catch (const Error& error) {
    if (code) *code = error.code();
    return error.what();
  }
  ADD_FAILURE() << "no error thrown";
  return {};
}

/// True for a tensor of the MTP layers of `config`: model.layers.{num_hidden_layers + i}.*
/// (DeepSeek-V3), or mtp.* (Qwen3-Next).
inline bool is_mtp_tensor(const ModelConfig& config, const std::string& name) {
  if (config.model_type == "qwen3_next") return name.starts_with("mtp.");
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

/// `options` with the checkpoint URI `uri` as the environment gives it through `variable`
/// (WEIGHTSTREAM_MODEL_URI or its alias MX_MODEL_URI); an empty `uri` leaves it unset.
inline Options with_checkpoint_uri(Options options, const std::string& uri,
                                   const std::string& variable = "WEIGHTSTREAM_MODEL_URI") {
  Options read = uri.empty() ? Options{} : options_from_environment({{variable, uri}});
  options.model_uri = read.model_uri;
  options.model_uri_origin = read.model_uri_origin;
  return options;
}

/// One module as an engine sets it up: layout (host storage allocated) and resolution.
struct ModuleFixture {
  ModelLayout layout;
  SourceResolution resolution;
  ModuleLoadRequest request() { return {resolution.role, &layout, resolution}; }
};

/// `checkpoint_uri` is set as WEIGHTSTREAM_MODEL_URI sets it (see with_checkpoint_uri).
inline ModuleFixture module_fixture(ModuleRole role, const ModelSource& source, const std::string& checkpoint_uri,
                                    const Options& options, bool allocate = true) {
  ModuleFixture module;
  Options resolved = with_checkpoint_uri(options, checkpoint_uri);
  ModelConfigSource config = find_model_config(source, resolved);
  module.layout = build_module_layout(config.config, role);
  if (allocate) module.layout.allocate(Device{});
  module.resolution = resolve_source(source, role, module.layout, resolved, role == ModuleRole::kDraft ? "mtp" : "");
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

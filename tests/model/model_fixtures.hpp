#pragma once
// Checkpoints in memory for the model tests: synthesized by `synthesize_checkpoint` (fixed
// seeds), read back with the format layer only, and handed to sessions as TensorViews.

#include <algorithm>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "support/test_support.hpp"
#include "weightstream/format.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"

namespace weightstream::testing {

/// One checkpoint tensor with its bytes.
struct MemoryTensor {
  std::string name;
  Dtype dtype = Dtype::kBF16;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;

  TensorView view() const {
    return TensorView{name, dtype, shape, bytes.data(), Device{}, 0, bytes.size()};
  }
  /// A view of bytes [offset, offset + length).
  TensorView piece(uint64_t offset, uint64_t length) const {
    return TensorView{name, dtype, shape, bytes.data() + offset, Device{}, offset, length};
  }
};

/// A whole checkpoint in memory, tensors in file order.
struct MemoryCheckpoint {
  ModelConfig config;
  std::vector<MemoryTensor> tensors;

  const MemoryTensor& tensor(std::string_view name) const {
    for (const MemoryTensor& tensor : tensors) {
      if (tensor.name == name) return tensor;
    }
    throw std::runtime_error("no tensor " + std::string(name));
  }
  std::vector<TensorView> views() const {
    std::vector<TensorView> result;
    for (const MemoryTensor& tensor : tensors) result.push_back(tensor.view());
    return result;
  }
  std::vector<TensorView> views_matching(std::string_view needle) const {
    std::vector<TensorView> result;
    for (const MemoryTensor& tensor : tensors) {
      if (tensor.name.find(needle) != std::string::npos) result.push_back(tensor.view());
    }
    return result;
  }
  std::vector<TensorView> views_except(std::string_view needle) const {
    std::vector<TensorView> result;
    for (const MemoryTensor& tensor : tensors) {
      if (tensor.name.find(needle) == std::string::npos) result.push_back(tensor.view());
    }
    return result;
  }
};

/// Synthesizes a checkpoint and reads every shard back into memory.
inline MemoryCheckpoint synth_in_memory(const SynthOptions& options) {
  TempDir directory;
  SynthResult result = synthesize_checkpoint(directory.path(), options);
  MemoryCheckpoint checkpoint;
  checkpoint.config = result.config;
  for (const std::string& file : result.files) {
    if (!file.ends_with(".safetensors")) continue;
    std::string text = read_file(file);
    std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(text.data()), text.size());
    SafetensorsHeader header = parse_safetensors_bytes(file, bytes);
    for (const TensorInfo& info : header.tensors) {
      auto data = bytes.subspan(header.data_offset() + info.data_begin, info.bytes());
      checkpoint.tensors.push_back({info.name, info.dtype, info.shape, {data.begin(), data.end()}});
    }
  }
  return checkpoint;
}

inline SynthOptions synth_options(std::string arch, uint64_t seed = 1, int64_t hidden = 256) {
  SynthOptions options;
  options.arch = std::move(arch);
  options.layers = 2;
  options.hidden = hidden;
  options.shards = 2;
  options.seed = seed;
  options.vocab = 1000;  // not a multiple of 64: exercises vocabulary padding
  return options;
}

/// synth_in_memory(synth_options(arch, seed)), synthesized once per test binary.
inline const MemoryCheckpoint& cached_checkpoint(const std::string& arch, uint64_t seed = 1) {
  static std::map<std::pair<std::string, uint64_t>, MemoryCheckpoint> cache;
  auto key = std::make_pair(arch, seed);
  if (!cache.contains(key)) cache.emplace(key, synth_in_memory(synth_options(arch, seed)));
  return cache.at(key);
}

/// A layout of `checkpoint` for one rank, with host storage.
inline ModelLayout host_layout(const MemoryCheckpoint& checkpoint, int64_t tp_size = 1, int64_t tp_rank = 0,
                               LayoutOptions options = {}) {
  options.parallel.tp_size = tp_size;
  options.parallel.tp_rank = tp_rank;
  ModelLayout layout = build_model_layout(checkpoint.config, options);
  layout.allocate(Device{});
  return layout;
}

/// Runs one load of `batches` into `layout`.
inline LoadCounters run_load(ModelLayout& layout, LoadMode mode, const std::vector<std::vector<TensorView>>& batches) {
  LoadSession session(layout);
  session.begin(mode);
  for (const auto& batch : batches) session.load(batch);
  session.finish();
  return session.counters();
}

/// A host layout of `checkpoint` for one rank, cold-loaded from all of it in one batch.
inline ModelLayout cold_loaded_layout(const MemoryCheckpoint& checkpoint, int64_t tp_size = 1, int64_t tp_rank = 0) {
  ModelLayout layout = host_layout(checkpoint, tp_size, tp_rank);
  run_load(layout, LoadMode::kCold, {checkpoint.views()});
  return layout;
}

/// Bytes of a parameter, on the host.
inline std::vector<std::byte> bytes_of(const ModelLayout& layout, std::string_view name) {
  return parameter_bytes(layout.parameter(name));
}

/// The rectangle [row_begin, +rows) x [column_begin, +columns) of a tensor viewed as
/// [shape[0], product of the rest], in its dtype.
inline std::vector<std::byte> slice_of(const MemoryTensor& tensor, int64_t row_begin, int64_t rows,
                                       int64_t column_begin, int64_t columns) {
  int64_t width = 1;
  for (size_t i = 1; i < tensor.shape.size(); ++i) width *= tensor.shape[i];
  size_t element = dtype_bits(tensor.dtype) / 8;
  std::vector<std::byte> result;
  for (int64_t row = row_begin; row < row_begin + rows; ++row) {
    auto begin = tensor.bytes.begin() + static_cast<ptrdiff_t>((row * width + column_begin) * element);
    result.insert(result.end(), begin, begin + static_cast<ptrdiff_t>(columns * element));
  }
  return result;
}

}  // namespace weightstream::testing

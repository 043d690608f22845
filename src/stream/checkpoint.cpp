// Opening a checkpoint: list shards, read and validate every header (in parallel, since
// object-storage round trips dominate for many shards), check index and headers agree.
#include <algorithm>
#include <map>
#include <unordered_map>

#include "base/parallel.hpp"
#include "weightstream/error.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {
namespace {

constexpr std::string_view kConfigFileName = "config.json";
constexpr uint64_t kMaxConfigBytes = 16 * kMiB;
constexpr uint64_t kMaxIndexBytes = 256 * kMiB;
// The first read of a shard fetches this much, which holds the whole header of almost every
// real checkpoint, so one request per shard usually suffices.
constexpr uint64_t kHeaderProbeBytes = 1 * kMiB;

SafetensorsHeader read_header(Storage& storage, const std::string& name, uint64_t size) {
  auto uri = storage.object_uri(name);
  WS_EXPECT(size >= 8, ErrorCode::kFormat,
            uri + ": file of " + std::to_string(size) + " bytes is too short for a safetensors header (needs at least 8)");
  std::string probe(std::min(size, kHeaderProbeBytes), '\0');
  auto probe_bytes = std::as_writable_bytes(std::span(probe.data(), probe.size()));
  storage.read(name, 0, probe_bytes);
  uint64_t header_length = parse_header_length(uri, probe_bytes.first(8), size);
  std::string header;
  if (8 + header_length <= probe.size()) {
    header = probe.substr(8, header_length);
  } else {
    header.resize(header_length);
    storage.read(name, 8, std::as_writable_bytes(std::span(header.data(), header.size())));
  }
  return parse_safetensors_header(uri, header, size);
}

}  // namespace

Checkpoint Checkpoint::open(std::string_view uri_text, const Options& options) {
  auto uri = parse_uri(uri_text);
  std::string object;
  std::shared_ptr<Storage> storage = open_storage(uri, options, &object);
  auto checkpoint = open(std::move(storage), object);
  checkpoint.uri_ = uri.text;
  return checkpoint;
}

Checkpoint Checkpoint::open(std::shared_ptr<Storage> storage, const std::string& single_object) {
  Checkpoint checkpoint;
  checkpoint.storage_ = std::move(storage);
  auto& store = *checkpoint.storage_;
  checkpoint.uri_ = single_object.empty() ? store.root_uri() : store.object_uri(single_object);

  std::vector<ObjectInfo> shard_objects;
  if (!single_object.empty()) {
    shard_objects.push_back(store.stat(single_object));
  } else {
    auto objects = store.list();
    std::unordered_map<std::string, uint64_t> sizes;
    for (const auto& object : objects) sizes[object.name] = object.size;
    if (sizes.contains(std::string(kConfigFileName))) {
      checkpoint.config_json_ = read_object(store, kConfigFileName, kMaxConfigBytes);
    }
    if (sizes.contains(std::string(kIndexFileName))) {
      auto text = read_object(store, kIndexFileName, kMaxIndexBytes);
      checkpoint.index_ = parse_checkpoint_index(store.object_uri(kIndexFileName), text);
      for (const auto& shard : checkpoint.index_->shards) {
        auto it = sizes.find(shard);
        if (it != sizes.end()) {
          shard_objects.push_back({shard, it->second});
          continue;
        }
        // A listing shows regular files only: a shard that is there but is a directory or a
        // FIFO, say, gets its own error from stat, naming what it is.
        try {
          shard_objects.push_back(store.stat(shard));
          continue;
        } catch (const Error& error) {
          if (error.code() != ErrorCode::kNotFound) throw;
        }
        WS_FAIL(ErrorCode::kNotFound, store.object_uri(kIndexFileName) + ": names shard '" + shard +
                                        "', which does not exist in " + store.root_uri());
      }
    } else {
      for (const auto& object : objects) {
        if (object.name.ends_with(".safetensors")) shard_objects.push_back(object);
      }
      std::sort(shard_objects.begin(), shard_objects.end(),
                [](const ObjectInfo& a, const ObjectInfo& b) { return natural_less(a.name, b.name); });
    }
    WS_EXPECT(!shard_objects.empty(), ErrorCode::kNotFound,
              "no *.safetensors files in " + store.root_uri() + " (and no " + std::string(kIndexFileName) + ")");
  }

  // Read headers in parallel; the first failure is the one reported.
  checkpoint.shards_.resize(shard_objects.size());
  detail::run_parallel(shard_objects.size(), store.preferred_concurrency(), [&](size_t, size_t index) {
    auto& shard = checkpoint.shards_[index];
    shard.name = shard_objects[index].name;
    shard.size = shard_objects[index].size;
    shard.header = read_header(store, shard.name, shard.size);
  });

  std::unordered_map<std::string, uint32_t> owner;
  for (uint32_t shard_index = 0; shard_index < checkpoint.shards_.size(); ++shard_index) {
    const auto& shard = checkpoint.shards_[shard_index];
    for (const auto& info : shard.header.tensors) {
      auto [it, inserted] = owner.try_emplace(info.name, shard_index);
      WS_EXPECT(inserted, ErrorCode::kFormat,
                "tensor '" + info.name + "' is in two shards: " + store.object_uri(checkpoint.shards_[it->second].name) +
                    " and " + store.object_uri(shard.name));
      if (checkpoint.index_) {
        auto mapped = checkpoint.index_->weight_map.find(info.name);
        WS_EXPECT(mapped != checkpoint.index_->weight_map.end(), ErrorCode::kFormat,
                  store.object_uri(kIndexFileName) + ": does not list tensor '" + info.name + "', which is in shard " +
                      shard.name);
        WS_EXPECT(mapped->second == shard.name, ErrorCode::kFormat,
                  store.object_uri(kIndexFileName) + ": maps tensor '" + info.name + "' to shard " + mapped->second +
                      ", but it is in shard " + shard.name);
      }
      checkpoint.tensors_.push_back({info.name, info.dtype, info.shape, shard_index,
                                     shard.header.data_offset() + info.data_begin, info.bytes()});
    }
  }
  for (size_t i = 0; i < checkpoint.tensors_.size(); ++i) checkpoint.by_name_.emplace(checkpoint.tensors_[i].name, i);
  if (checkpoint.index_) {
    for (const auto& [name, shard] : checkpoint.index_->weight_map) {
      WS_EXPECT(owner.contains(name), ErrorCode::kFormat,
                store.object_uri(kIndexFileName) + ": maps tensor '" + name + "' to shard " + shard +
                    ", but that shard has no such tensor");
    }
  }
  return checkpoint;
}

std::optional<size_t> Checkpoint::find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

uint64_t Checkpoint::tensor_bytes() const noexcept {
  uint64_t total = 0;
  for (const auto& tensor : tensors_) total += tensor.bytes;
  return total;
}

std::string Checkpoint::shard_uri(uint32_t shard) const { return storage_->object_uri(shards_.at(shard).name); }

}  // namespace weightstream

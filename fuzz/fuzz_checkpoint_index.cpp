// Fuzzes model.safetensors.index.json parsing. An accepted index must name only plain
// shard files, list its shards in natural order, and survive a serialize/parse round trip.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "weightstream/error.hpp"
#include "weightstream/format.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view json(reinterpret_cast<const char*>(data), size);
  weightstream::CheckpointIndex index;
  try {
    index = weightstream::parse_checkpoint_index("fuzz.index.json", json);
  } catch (const weightstream::Error&) {
    return 0;
  }
  for (const auto& [tensor, shard] : index.weight_map) {
    if (shard.empty() || shard.find('/') != std::string::npos || shard.find('\\') != std::string::npos ||
        shard == ".." || shard == "." || shard.find('\0') != std::string::npos) {
      std::abort();
    }
  }
  for (size_t i = 1; i < index.shards.size(); ++i) {
    if (!weightstream::natural_less(index.shards[i - 1], index.shards[i])) std::abort();
  }
  auto again = weightstream::parse_checkpoint_index("round trip", weightstream::index_json(index));
  if (again.weight_map != index.weight_map || again.shards != index.shards || again.total_size != index.total_size) {
    std::abort();
  }
  return 0;
}

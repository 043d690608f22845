#pragma once
// Internals of the resolve layer shared by resolution and the strategies: what a source
// holds, learned from its listing and its index without reading any shard when it can.

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/text.hpp"
#include "weightstream/model.hpp"
#include "weightstream/stream.hpp"

namespace weightstream::resolve {

using detail::join;

/// What one source holds.
struct SourceListing {
  std::shared_ptr<Storage> storage;
  std::string object;  ///< set when the URI names a single object
  std::vector<std::string> safetensors;  ///< *.safetensors objects, in natural order
  bool has_index = false;
  bool has_config = false;
  std::optional<CheckpointIndex> index;  ///< parsed model.safetensors.index.json
};

/// Opens and lists `uri`, reading and parsing its index when there is one and `read_index`
/// (else only has_index says it is there). Throws the storage's or the index's Error.
SourceListing list_source(const std::string& uri, const Options& options, bool read_index = true);

/// Shards of an opened checkpoint that hold at least one tensor `layout` wants, in natural order.
std::vector<std::string> shards_holding(const Checkpoint& checkpoint, const ModelLayout& layout);

/// Shards that hold at least one tensor `layout` wants, in natural order: per the index when
/// there is one, else from the shards' headers (then the opened checkpoint is kept in
/// `opened` when it is not null).
std::vector<std::string> wanted_shards(const SourceListing& listing, const ModelLayout& layout,
                                       const Options& options, std::optional<Checkpoint>* opened);

}  // namespace weightstream::resolve

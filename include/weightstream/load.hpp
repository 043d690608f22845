#pragma once
/// @file load.hpp
/// Loading a checkpoint into a ModelLayout: the plan of which byte ranges each rank reads
/// (a contiguous row slice is read as its own range; other slices read whole and copied
/// strided by the session), and the glue that streams those ranges into a LoadSession.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "weightstream/model.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {

/// One checkpoint tensor that a layout reads, and how.
struct PlannedTensor {
  size_t tensor = 0;   ///< index into Checkpoint::tensors()
  ByteRange range;     ///< bytes of the tensor read (length never 0)
  bool slice = false;  ///< true when `range` is this rank's contiguous slice, not the whole tensor
  std::vector<std::pair<size_t, size_t>> targets;  ///< (parameter, part) indices it fills
};

/// A checkpoint tensor the layout does not read, and why.
struct UnusedTensor {
  size_t tensor = 0;   ///< index into Checkpoint::tensors()
  std::string reason;  ///< the ignore rule, or the rank or module that owns it
};

/// What a layout reads from a checkpoint.
struct LoadPlan {
  std::vector<PlannedTensor> reads;     ///< in checkpoint file order
  std::vector<UnusedTensor> unused;   ///< ignored or owned elsewhere; never read
  std::vector<std::string> missing;   ///< tensors the layout wants that the checkpoint lacks
  uint64_t bytes_to_read = 0;         ///< sum of the reads' lengths
  /// The stream requests, parallel to `reads`.
  std::vector<TensorRequest> requests() const;
  /// A plan of the reads at `indices` only (for loading in batches).
  LoadPlan subset(std::span<const size_t> indices) const;
};

/// Plans the reads of `layout` from `checkpoint`. Throws Error(kModel) naming every
/// checkpoint tensor that matches no parameter and no ignore rule (with its shard), and
/// every tensor whose shape cannot fill its parameter, before any byte is read.
LoadPlan plan_layout_load(const ModelLayout& layout, const Checkpoint& checkpoint);

/// Streams the plan's reads into `session` (which must have begun), piece by piece as the
/// reader pool completes them. Returns the stream's counters; throws the first error.
StreamStats stream_into_session(const Checkpoint& checkpoint, const LoadPlan& plan, LoadSession& session,
                                const StreamOptions& options, const ProgressCallback& progress = {});

/// Result of load_layout.
struct LayoutLoad {
  StreamStats stream;
  LoadCounters counters;
};

/// One whole load of `layout` from `checkpoint`: plan, begin(mode), stream, finish().
LayoutLoad load_layout(ModelLayout& layout, const Checkpoint& checkpoint, LoadMode mode, const StreamOptions& options,
                       const ProgressCallback& progress = {});

/// The checkpoint's config.json, parsed. Throws Error(kNotFound) naming the checkpoint
/// when it has none.
ModelConfig checkpoint_model_config(const Checkpoint& checkpoint);

}  // namespace weightstream

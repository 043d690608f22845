#pragma once
// Part of the stream layer, not of the installed API: the staged streamer of streamer.cpp
// with the storage it reads given, for the device path (mapped_source.cpp), which reads a
// warm local checkpoint through a mapping whatever read method it was opened with.

#include "weightstream/storage.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {

/// stream_tensors(), reading the checkpoint's shards through `storage` (the same objects,
/// opened again with another read method) instead of checkpoint.storage().
StreamStats stream_tensors_through(Storage& storage, const Checkpoint& checkpoint,
                                   std::span<const TensorRequest> requests, TensorSink& sink,
                                   const StreamOptions& options, const ProgressCallback& progress,
                                   HostMemory staging);

}  // namespace weightstream

#pragma once
// Internal to the stream layer: the CUDA destinations of load_checkpoint() and
// digest_checkpoint(), to which those dispatch when the device is a CUDA device. They use
// only the public device API (DeviceCopier, HostRegistration, Buffer); no CUDA header here.

#include <vector>

#include "weightstream/stream.hpp"

namespace weightstream {

/// Loads every tensor of `checkpoint` into one arena on CUDA `device`, by the path
/// options.gpu_path names (kAuto: kMapped for local files read through the page cache,
/// kStaged otherwise). Host memory held for the copies (pinned staging, or registered
/// windows of the mapped files) stays within options.memory_limit. Throws Error(kDevice)
/// naming the device, the tensor and the CUDA error; Error(kUnsupported) for kMapped on
/// storage that is not local files.
LoadedCheckpoint load_checkpoint_cuda(const Checkpoint& checkpoint, const Device& device, const StreamOptions& options,
                                      const ProgressCallback& progress);

/// Lands every tensor on `device` as load_checkpoint_cuda() does, then copies each back
/// in chunks (within options.memory_limit of pinned memory) and hashes it on the host, so
/// the digests cover the bytes the device holds. Needs device memory for the whole
/// checkpoint. Digests are in the order of Checkpoint::tensors().
std::vector<TensorDigest> digest_checkpoint_cuda(const Checkpoint& checkpoint, HashKind kind, const Device& device,
                                                 const StreamOptions& options, StreamStats* stats,
                                                 const ProgressCallback& progress);

}  // namespace weightstream

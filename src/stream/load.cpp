// Loading a whole checkpoint into one arena on a device.
#include <mutex>
#include <vector>

#include "stream/cuda_load.hpp"
#include "weightstream/error.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {
namespace {

// Tensors start on 256-byte boundaries in the arena: what CUDA allocations guarantee and
// what vectorized kernels and DLPack consumers expect.
constexpr uint64_t kTensorAlignment = 256;

uint64_t align_up(uint64_t value) { return (value + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment; }

/// Reads straight into a host arena: no staging, no extra copy.
class HostArenaSink final : public TensorSink {
 public:
  HostArenaSink(std::byte* arena, const std::vector<uint64_t>& offsets) : arena_(arena), offsets_(offsets) {}
  std::byte* direct_destination(size_t request) override { return arena_ + offsets_[request]; }
  void consume(TensorPiece&&) override {}

 private:
  std::byte* arena_;
  const std::vector<uint64_t>& offsets_;
};

}  // namespace

LoadedCheckpoint load_checkpoint(const Checkpoint& checkpoint, const Device& device, const StreamOptions& options,
                                 const ProgressCallback& progress) {
  require_device(device);
  if (device.is_cuda()) return load_checkpoint_cuda(checkpoint, device, options, progress);
  const auto& tensors = checkpoint.tensors();
  std::vector<uint64_t> offsets(tensors.size());
  uint64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    offsets[i] = total;
    total = align_up(total + tensors[i].bytes);
  }
  LoadedCheckpoint loaded;
  loaded.arena = Buffer(device, std::max<uint64_t>(total, 1));
  auto requests = all_tensors(checkpoint);
  HostArenaSink sink(loaded.arena.data(), offsets);
  loaded.stats = stream_tensors(checkpoint, requests, sink, options, progress);
  loaded.tensors.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) loaded.tensors[i] = {i, loaded.arena.data() + offsets[i], tensors[i].bytes};
  return loaded;
}

}  // namespace weightstream

#pragma once
// FP8 E4M3 block quantization on a GPU, in the order of a DeviceCopier's lanes: what the model
// layer's ParameterWriter issues when a BF16 (F16, F32) update lands in an FP8 block-scaled
// parameter held on a GPU. Internal to the library (not installed), like copies.hpp; the
// kernel is quantize_kernels.cu, its rule e4m3_rule.hpp (the host quantizer's, bit for bit);
// copier_cuda.cpp implements this, device_cuda_fallback.cpp refuses it.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "weightstream/device.hpp"
#include "weightstream/format.hpp"

namespace weightstream {

/// True where this build can quantize on a GPU (CUDA with its own kernels compiled); a
/// caller quantizes on the host otherwise.
bool device_quantizes_e4m3() noexcept;

/// One matrix quantized block by block into E4M3 codes and F32 scales, all in memory of the
/// copier's device: `rows` x `columns` values of `dtype` (BF16, F16 or F32) at `source`, rows
/// `source_pitch` bytes apart (element-aligned); codes written compactly at `codes` (`columns`
/// bytes a row), scales compactly at `scales`, ceil(rows / block_rows) x ceil(columns /
/// block_columns) of them.
struct E4m3BlockJob {
  const std::byte* source = nullptr;
  uint64_t source_pitch = 0;
  Dtype dtype = Dtype::kBF16;
  uint64_t rows = 0, columns = 0;
  uint64_t block_rows = 128, block_columns = 128;
  std::byte* codes = nullptr;
  float* scales = nullptr;
};

/// Device memory for work on one lane of a DeviceCopier, taken from and given back to the
/// stream-ordered pool in that lane's order (cudaMallocAsync / cudaFreeAsync): work enqueued
/// on the lane after the allocation may use it, and the destructor returns it after the work
/// enqueued on the lane before it, without waiting (cudaFree would wait for the whole device).
/// Keeps the lane's stream alive, so it may outlive its copier.
class LaneScratch {
 public:
  /// `bytes` (at least 1) on lane `lane % lanes()` of `copier`. Throws Error(kDevice) naming
  /// the device, the size and the CUDA error; Error(kUnsupported) without CUDA.
  LaneScratch(DeviceCopier& copier, unsigned lane, size_t bytes);
  ~LaneScratch();
  LaneScratch(const LaneScratch&) = delete;
  LaneScratch& operator=(const LaneScratch&) = delete;

  std::byte* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }

 private:
  Device device_;
  std::shared_ptr<const void> stream_owner_;
  void* stream_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

/// Enqueues the quantization of `job` on lane `lane % lanes()` of `copier`, after the copies
/// enqueued on that lane before it, and returns at once. `keepalive` is dropped once it is
/// done; DeviceCopier::synchronize() waits for it and throws its error. `what` names the
/// work in errors ("tensor 'x'"). Throws Error(kInvalidArgument) for a job the kernel cannot take,
/// Error(kDevice) when the launch fails, Error(kUnsupported) where device_quantizes_e4m3()
/// is false.
void quantize_e4m3_blocks(DeviceCopier& copier, unsigned lane, const E4m3BlockJob& job,
                          std::shared_ptr<const void> keepalive, std::string_view what);
/// quantize_e4m3_blocks() of every job of `jobs`, in as few launches as their kinds allow (up
/// to 44 jobs a launch): a bucket of thousands of experts costs tens of launches. `what`
/// names the batch in errors.
void quantize_e4m3_blocks(DeviceCopier& copier, unsigned lane, std::span<const E4m3BlockJob> jobs,
                          std::shared_ptr<const void> keepalive, std::string_view what);

}  // namespace weightstream

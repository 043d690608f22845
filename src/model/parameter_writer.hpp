#pragma once
// The one device path of the model layer: every byte a LoadSession writes from a source into
// parameter storage goes through a ParameterWriter. On the host it is a memcpy on the
// calling thread; on a GPU, copies are asynchronous on the lanes (streams) of a
// DeviceCopier: pinned or registered sources are read by the copy engine directly, a column
// slice is one 2-D copy, a batch of engine-format tensors is one driver call or one gather
// kernel, and nothing waits per piece. wait() is the one synchronization: the session calls
// it before per-layer processing, model hooks, the end of a load, and before a receiver
// hands a bucket's slot back to its sender.
//
// Writes into parameter memory that do not go through the writer, and why:
//  - processing.cpp (process_parameter): a processed parameter's FP8 codes and its scale are
//    copied synchronously from host buffers it has just computed. It runs after the writer's
//    wait(), once per parameter, and frees those buffers on return: nothing is left to overlap.
//  - hooks.cpp (tied_lm_head, fused_kv): model hooks copy between parameters and their derived
//    buffers after the load's last wait(). A ModelHook sees the ModelLayout, not the writer
//    (hooks written outside the library copy the same way), and runs once per load.
//  - session.cpp (LoadSession::begin): a cold load zeroes the padding rows no piece fills (a
//    vocabulary padded to a multiple of kVocabPadding), after wait(); the writer copies, it
//    has no fill.
//  - session_progress.cpp (account_part): the staging of a processed parameter is zeroed when
//    it is made. Staging is the session's memory, not the parameter's: processing writes the
//    parameter from it.
//  - session_writes.cpp (write_changes): changed elements (a delta) are scattered by memcpy
//    into host parameters only (the checks refuse a GPU parameter), as the host writer would
//    copy them; the writer has no scatter.
// Held pieces (session_held.cpp) are copied into the session's own memory, not a
// parameter's; they reach their parameter later through the writer.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "device/shared/copies.hpp"

#include "device/shared/quantize.hpp"
#include "weightstream/device.hpp"
#include "weightstream/format.hpp"

namespace weightstream::model {

class ParameterWriter {
 public:
  /// A writer into memory of `device` (the layout's).
  explicit ParameterWriter(const Device& device);
  /// Waits for the copies in flight (never throws).
  ~ParameterWriter();
  ParameterWriter(const ParameterWriter&) = delete;
  ParameterWriter& operator=(const ParameterWriter&) = delete;

  const Device& device() const noexcept { return device_; }
  /// True when copies may still be in flight after a call returns (a GPU writer).
  bool asynchronous() const noexcept { return copier_ != nullptr; }

  /// Copies `bytes` from `source` (host memory or memory of `source_device`) to
  /// `destination` (memory of the writer's device). `keepalive`, when set, keeps the source
  /// valid until the copy has landed; without one the source must stay valid until wait().
  /// A source equal to the destination (bytes read there directly) copies nothing.
  /// `what` names the tensor in errors. On a GPU the copy runs on lane `lane` when given
  /// (after the work issued there before: see take_lane()), on the next lane otherwise.
  /// Throws Error(kDevice).
  void copy(std::byte* destination, const std::byte* source, const Device& source_device, uint64_t bytes,
            std::shared_ptr<const void> keepalive, std::string_view what, std::optional<unsigned> lane = std::nullopt);
  /// Copies `rows` rows of `width` bytes, source rows `source_pitch` bytes apart,
  /// destination rows `destination_pitch` bytes apart (one 2-D copy on a GPU).
  void copy_rows(std::byte* destination, uint64_t destination_pitch, const std::byte* source,
                 const Device& source_device, uint64_t source_pitch, uint64_t width, uint64_t rows,
                 std::shared_ptr<const void> keepalive, std::string_view what,
                 std::optional<unsigned> lane = std::nullopt);
  /// One rectangle of copy_from_host(): as copy_rows() takes it (one row: a contiguous run).
  struct HostCopy {
    std::byte* destination = nullptr;
    uint64_t destination_pitch = 0;
    const std::byte* source = nullptr;
    uint64_t source_pitch = 0;
    uint64_t width = 0;
    uint64_t rows = 1;
    /// The allocation the source lies in (its keepalive's), or null when unknown: only
    /// rectangles of one allocation share a landing copy, whose span may cover bytes between
    /// them (never memory between two allocations, which may not be mapped).
    const void* allocation = nullptr;
  };
  /// Copies every rectangle from host memory (pinned or registered, kept valid by
  /// `keepalive` until the copies land) into the writer's device memory, as copy_rows() would
  /// each. On a GPU whose build has kernels, the small ones (runs under 4 MiB, narrow rows)
  /// whose sources lie close together in one allocation land in one copy a group, written out by one kernel:
  /// a read of many small tensors (MoE experts, their scales) or of a column window costs a
  /// copy, not one per tensor or row. `what` names the batch in errors. Throws Error(kDevice).
  void copy_from_host(std::span<const HostCopy> copies, std::shared_ptr<const void> keepalive, std::string_view what);
  /// Copies every range (destinations in the writer's device memory; sources in host memory
  /// or, all of them, in the memory of the writer's GPU) as one batch: from the host, one
  /// driver call that has landed when this returns; within the GPU, one gather kernel that
  /// is only issued, its sources kept valid by `keepalives` (or by the caller) until wait().
  /// Not for sources on another GPU: copy() them.
  void copy_ranges(std::span<const CopyRange> ranges, const Device& source_device,
                   std::vector<std::shared_ptr<const void>> keepalives);

  /// True when quantize_e4m3() runs on the device: a GPU writer of a build with CUDA kernels.
  /// A source on the host or on the writer's GPU may then be staged there and quantized
  /// without coming back to the host.
  bool quantizes_on_device() const noexcept { return copier_ && device_quantizes_e4m3(); }
  /// A lane for work that must run in order: copies into a scratch (copy(..., lane)), then
  /// the quantization that reads it. GPU writers only.
  unsigned take_lane() noexcept { return next_lane_.fetch_add(1, std::memory_order_relaxed); }
  /// Device memory of `bytes` for work on lane `lane`, returned in that lane's order when the
  /// last reference goes (LaneScratch). GPU writers only. Throws Error(kDevice).
  std::shared_ptr<LaneScratch> scratch(uint64_t bytes, unsigned lane);
  /// Quantizes every job (E4m3BlockJob: source, codes and scales in the writer's GPU) on lane
  /// `lane`, asynchronously, in as few launches as they allow; wait() waits for it and throws its error. `keepalive` keeps the
  /// source until it has run. Where quantizes_on_device() is false, throws
  /// Error(kUnsupported).
  void quantize_e4m3(std::span<const E4m3BlockJob> jobs, std::shared_ptr<const void> keepalive, unsigned lane,
                     std::string_view what);
  /// Waits until every copy issued so far has landed; throws the first copy's error.
  void wait();

 private:
  /// Whether narrow rows from the host far apart are gathered on the CPU (gather_rows()): a
  /// few columns of wide rows, whose span would carry many times their bytes.
  bool gathers(uint64_t width, uint64_t rows, uint64_t source_pitch, uint64_t destination_pitch) const;
  /// Whether a rectangle from the host lands in device scratch to be written out by a kernel
  /// (a run under 4 MiB; narrow rows whose span carries few other bytes) rather than copied
  /// on its own.
  bool lands(uint64_t width, uint64_t rows, uint64_t source_pitch, uint64_t destination_pitch) const;
  /// Notes a copy_bytes() between two GPUs, which returns before the copy engine is done.
  void copied_between_devices() noexcept { between_devices_.store(true, std::memory_order_relaxed); }

  /// Pinned host buffers that narrow rows far apart are gathered into (copy_rows()).
  class GatherPool;
  /// Copies narrow rows far apart (a rank's few columns of wide rows) by gathering them on
  /// the CPU into a pinned buffer and sending only their bytes; false when no buffer is free
  /// (the caller copies them another way).
  bool gather_rows(std::byte* destination, uint64_t destination_pitch, const std::byte* source, uint64_t source_pitch,
                   uint64_t width, uint64_t rows, unsigned lane, std::string_view what);

  Device device_;
  std::unique_ptr<DeviceCopier> copier_;
  std::shared_ptr<GatherPool> gather_pool_;  ///< shared with the buffers it lends
  std::atomic<unsigned> next_lane_{0};
  std::atomic<bool> between_devices_{false};
  std::mutex gather_mutex_;  ///< guards the gathers and their keepalives
  std::vector<std::shared_ptr<const void>> gather_keepalives_;
  std::optional<CopyQueue> gathers_;  ///< declared after its keepalives: destroyed (and waited for) first
};

/// Copies `elements` values from `source` (dtype `source_dtype`, on `source_device`) into
/// `destination` (dtype `destination_dtype`, on `destination_device`), synchronously,
/// converting between BF16, F16 and F32 on the host when the dtypes differ.
void copy_elements(std::byte* destination, const Device& destination_device, Dtype destination_dtype,
                   const std::byte* source, const Device& source_device, Dtype source_dtype, uint64_t elements);

}  // namespace weightstream::model

#pragma once
// The changed-elements encoding of a delta update (docs/DELTA.md): one tensor's elements that
// differ from the version the receiver holds, as ascending positions (LEB128 varints, each
// the gap after the previous one) and their new values, closed by an xxh64 checksum.
//
//   changed u64, position_bytes u64, positions (position_bytes bytes: `changed` varints),
//   values (changed x element bytes), checksum u64 (xxh64, seed 0, of every byte before it)
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "weightstream/model.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream::transfer {

/// Bytes of an encoding of no changed element (its two counts and its checksum).
inline constexpr uint64_t kChangedElementsOverhead = 24;

/// A tensor this large or larger is compared in ranges on several threads (smaller ones, each
/// on one thread, several at once: UpdateSender::send_changes of many tensors).
inline constexpr uint64_t kParallelEncodingBytes = 16ull << 20;

/// A rectangle of a checkpoint tensor's two-dimensional view (rows: shape[0]; columns: the
/// product of the rest) that a receiver holds: one part of one of its parameters
/// (ParameterPart's slice). A delta update's receiver lists its windows of every declared
/// tensor in ACCEPTED; the sender compares and sends only the elements inside them, and
/// digests them for the receiver's check of what it holds after the update (docs/DELTA.md).
struct HeldWindow {
  uint64_t row_begin = 0;
  uint64_t rows = 0;
  uint64_t column_begin = 0;
  uint64_t columns = 0;
  bool operator==(const HeldWindow&) const = default;
};

/// The windows of one tensor (of `rows` x `columns` in its 2-D view): the receiver's, or the
/// union of several receivers'. Whole: every element (a full update, a replicated tensor).
struct TensorWindows {
  uint64_t rows = 0;
  uint64_t columns = 0;
  std::vector<HeldWindow> windows;  ///< empty: no element, unless `whole`
  bool whole = true;

  /// Calls `range(begin, end)` for each run of held elements (row-major indices), ascending,
  /// disjoint and not adjacent to the next; an element inside several windows comes once.
  void for_each_range(const std::function<void(uint64_t begin, uint64_t end)>& range) const;
  /// Elements inside the windows (each counted once).
  uint64_t elements() const;
};

/// The receiver's windows of each tensor of `manifest` (checkpoint format), in the order of
/// the parts they fill (ModelLayout::route): none for a tensor it skips or ignores.
std::vector<std::vector<HeldWindow>> held_windows(const ModelLayout& layout, std::span<const DeclaredTensor> manifest);

/// xxh3-64 of the elements of `tensor` (row-major host bytes of `element_bytes` an element,
/// `columns` a row of its 2-D view) inside `windows`, each window's rows in order, the windows
/// in the order given: what a receiver holding those windows must hold after a delta update.
uint64_t windows_digest(std::span<const std::byte> tensor, uint64_t element_bytes, uint64_t columns,
                        std::span<const HeldWindow> windows);

/// windows_digest() of what `layout` holds of `tensor` now, read from its host parameters
/// (converted back to the tensor's dtype where a parameter holds another float dtype), its
/// windows as held_windows() lists them.
uint64_t held_digest(const ModelLayout& layout, const DeclaredTensor& tensor);

/// After a delta update landed: checks what `layout` holds of each tensor `digests` names
/// (index in `manifest`, the sender's windows_digest of the target) with held_digest(), on up
/// to `threads` threads. `sent_as_changes` flags the tensors that arrived as changed elements:
/// each must have a digest. Returns how many were checked. Throws Error(kProtocol) for an index
/// outside the manifest or a changed tensor without its digest, and Error(kModel) naming each
/// tensor whose held elements differ from the target `target` (the first 20, then a count) with
/// the parameters that hold it.
uint64_t check_held_digests(const ModelLayout& layout, std::span<const DeclaredTensor> manifest,
                            std::span<const std::pair<uint32_t, uint64_t>> digests,
                            const std::vector<bool>& sent_as_changes, const std::string& target, unsigned threads);

/// The encoding of the elements of `tensor` that differ bit for bit from `base` (host bytes of
/// one size, `element_bytes` an element: 1, 2, 4 or 8), only those inside `held` (the
/// receivers' windows; nullptr: every element), or std::nullopt as soon as it would take more
/// than `limit` bytes (the tensor then travels whole). A tensor of 16 MiB or more is compared
/// in ranges on up to `threads` threads; the encoding is the same.
std::optional<std::vector<std::byte>> encode_changed_elements(std::span<const std::byte> base,
                                                              std::span<const std::byte> tensor, uint64_t element_bytes,
                                                              uint64_t limit, unsigned threads = 1,
                                                              const TensorWindows* held = nullptr);

/// Decodes an encoding of changed elements of a tensor of `elements` elements of
/// `element_bytes` bytes. Throws Error(kProtocol) starting with `what` (the tensor and its
/// bucket) when it is truncated or overlong, its checksum does not match (corrupted), or a
/// position lies outside the tensor.
ChangedElements decode_changed_elements(std::span<const std::byte> encoded, uint64_t element_bytes, uint64_t elements,
                                        const std::string& what);

}  // namespace weightstream::transfer

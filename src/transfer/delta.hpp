#pragma once
// The changed-elements encoding of a delta update (docs/DELTA.md): one tensor's elements that
// differ from the version the receiver holds, as ascending positions (LEB128 varints, each
// the gap after the previous one) and their new values, closed by an xxh64 checksum.
//
//   changed u64, position_bytes u64, positions (position_bytes bytes: `changed` varints),
//   values (changed x element bytes), checksum u64 (xxh64, seed 0, of every byte before it)
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "weightstream/model.hpp"

namespace weightstream::transfer {

/// Bytes of an encoding of no changed element (its two counts and its checksum).
inline constexpr uint64_t kChangedElementsOverhead = 24;

/// A tensor this large or larger is compared in ranges on several threads (smaller ones, each
/// on one thread, several at once: UpdateSender::send_changes of many tensors).
inline constexpr uint64_t kParallelEncodingBytes = 16ull << 20;

/// The encoding of the elements of `tensor` that differ bit for bit from `base` (host bytes of
/// one size, `element_bytes` an element: 1, 2, 4 or 8), or std::nullopt as soon as it would
/// take more than `limit` bytes (the tensor then travels whole). A tensor of 16 MiB or more is
/// compared in ranges on up to `threads` threads; the encoding is the same.
std::optional<std::vector<std::byte>> encode_changed_elements(std::span<const std::byte> base,
                                                              std::span<const std::byte> tensor, uint64_t element_bytes,
                                                              uint64_t limit, unsigned threads = 1);

/// Decodes an encoding of changed elements of a tensor of `elements` elements of
/// `element_bytes` bytes. Throws Error(kProtocol) starting with `what` (the tensor and its
/// bucket) when it is truncated or overlong, its checksum does not match (corrupted), or a
/// position lies outside the tensor.
ChangedElements decode_changed_elements(std::span<const std::byte> encoded, uint64_t element_bytes, uint64_t elements,
                                        const std::string& what);

}  // namespace weightstream::transfer

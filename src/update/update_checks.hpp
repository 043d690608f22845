#pragma once
// What an update receiver checks of an update before anything of it lands: the manifest at
// START (whole, against the layout) and its ledger while buckets arrive, and each bucket's
// entries as views for the session, a delta's changed elements decoded (receiver.cpp).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "update/transport.hpp"
#include "update/wire.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream::transfer {

/// Problems listed in a refusal: the first ones, then how many more.
inline constexpr size_t kProblemsListed = 20;

/// The views of a bucket's entries for the session: bytes in the bucket buffer stay valid
/// until the receiver answers APPLIED (kSettle), bytes in a shared region until the update
/// ends (kLoad); a delta entry's changed elements stand undecoded until decode_changes(). Only
/// where the bytes are is checked here; names, shapes, dtypes, rules and what arrives twice
/// are the session's checks. Throws Error(kProtocol) for bytes outside their region.
std::vector<TensorView> bucket_views(const BucketManifest& manifest, const std::byte* slot,
                                     const ReceiverTransport& transport);

/// Decodes the changed elements of `manifest`'s delta entries (their bytes in the bucket
/// buffer at `slot`) into their views, every one before any is applied. Throws
/// Error(kProtocol) naming the tensor and the bucket for a truncated or corrupted one.
void decode_changes(const BucketManifest& manifest, const std::byte* slot, std::vector<TensorView>& views);

/// An update's manifest as the receiver holds it while the update runs: each declared
/// tensor's index by name (the keys view the START message's names), its whole size, and
/// the bytes of it that arrived.
struct ManifestLedger {
  std::unordered_map<std::string_view, size_t> index;
  std::vector<uint64_t> bytes;
  std::vector<uint64_t> received;
  std::vector<bool> sent_as_changes;  ///< arrived as changed elements (a delta's, checked at FINISH)

  /// Counts the entries of a bucket as received, each checked against `declared` (the update's
  /// manifest): a tensor it does not declare, or declares with another dtype or shape, and
  /// changed elements outside a delta update or after bytes of their tensor are
  /// Error(kProtocol). Changed elements count as their whole tensor. Returns how many entries
  /// carry changed elements.
  uint64_t account(const BucketManifest& manifest, std::span<const DeclaredTensor> declared, bool delta);
};

/// Checks an update's manifest whole against `layout`, before any bucket: each tensor
/// through `session` (begun in update mode in `format`: the checks of its load(), on views
/// of no bytes), each name once, and FP8 block-scaled weights sent as codes declared with
/// their block scales (and scales with codes; a BF16, F16 or F32 weight quantized here comes
/// alone). Returns the ledger of the update. Throws Error(kModel) listing every problem.
ManifestLedger check_manifest(const ModelLayout& layout, const LoadSession& session, TensorFormat format,
                              std::span<const DeclaredTensor> manifest, bool delta);

}  // namespace weightstream::transfer

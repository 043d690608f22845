#pragma once
// Internal: preparing the caller's memory that a storage read writes into.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace weightstream::storage {

/// Faults in, in one madvise(MADV_POPULATE_WRITE) call per run of pages, the pages of
/// `destination` that are not yet in memory, before a read copies into it. A read into
/// fresh memory (a load's arena) otherwise takes one page fault per 4 KiB page inside the
/// kernel's copy (pread) or libcurl's callback; populating them first is cheaper
/// (bench/HISTORY.md, "Figures once in source comments"). Pages already present (reused staging
/// buffers) are found by mincore() and skipped: populating them again still walks every page.
///
/// Advice only: the contents never change, and errors are ignored (where the kernel lacks
/// MADV_POPULATE_WRITE, before Linux 5.14, the pages fault in as before; a bad address is
/// the read's own error to report).
void populate_destination(std::span<std::byte> destination) noexcept;

/// The bytes a scatter read's segments hold in all.
uint64_t segments_bytes(std::span<const std::span<std::byte>> segments) noexcept;

/// Bytes [begin, begin + length) of the sequence the segments make, as segments of their own
/// (empty ones left out). The range lies within segments_bytes(segments).
std::vector<std::span<std::byte>> slice_segments(std::span<const std::span<std::byte>> segments, uint64_t begin,
                                                 uint64_t length);

}  // namespace weightstream::storage

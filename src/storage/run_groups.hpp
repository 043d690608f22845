#pragma once
// Internal: the runs of a strided read that storage reads together.

#include <cstddef>
#include <cstdint>
#include <span>

#include "weightstream/storage.hpp"

namespace weightstream::storage {

/// Calls `group(first, last)` for each group of consecutive `runs` (ascending, disjoint)
/// whose gaps are at most `merge_gap` bytes: runs[first] to runs[last], read together.
template <typename Group>
void for_each_run_group(std::span<const ByteRange> runs, uint64_t merge_gap, Group&& group) {
  size_t first = 0;
  while (first < runs.size()) {
    size_t last = first;
    while (last + 1 < runs.size() && runs[last + 1].offset - (runs[last].offset + runs[last].length) <= merge_gap) {
      ++last;
    }
    group(first, last);
    first = last + 1;
  }
}

}  // namespace weightstream::storage

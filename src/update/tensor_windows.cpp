// The runs of elements a receiver's windows of a tensor cover, in the tensor's order: what
// a delta's sender compares and encodes (delta.hpp). Apart from delta_windows.cpp, which
// reads model layouts, so that the encoder builds on its own (fuzz/).
#include <algorithm>

#include "update/delta.hpp"

namespace weightstream::transfer {
namespace {

/// A column interval [begin, end) of one row.
using Interval = std::pair<uint64_t, uint64_t>;

/// The column intervals of the windows covering row band [row, ...), merged, ascending.
std::vector<Interval> band_intervals(std::span<const HeldWindow> windows, uint64_t row) {
  std::vector<Interval> intervals;
  for (const HeldWindow& window : windows) {
    if (window.row_begin <= row && row < window.row_begin + window.rows && window.columns > 0) {
      intervals.emplace_back(window.column_begin, window.column_begin + window.columns);
    }
  }
  std::ranges::sort(intervals);
  std::vector<Interval> merged;
  for (const Interval& interval : intervals) {
    if (!merged.empty() && interval.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, interval.second);
    } else {
      merged.push_back(interval);
    }
  }
  return merged;
}

}  // namespace

void TensorWindows::for_each_range(const std::function<void(uint64_t begin, uint64_t end)>& range) const {
  if (whole) {
    if (rows * columns > 0) range(0, rows * columns);
    return;
  }
  // Runs end where one window begins or ends: between two such rows the same windows cover
  // every row, so their merged column intervals hold for the band.
  std::vector<uint64_t> edges;
  for (const HeldWindow& window : windows) {
    edges.push_back(window.row_begin);
    edges.push_back(window.row_begin + window.rows);
  }
  std::ranges::sort(edges);
  edges.erase(std::unique(edges.begin(), edges.end()), edges.end());
  uint64_t pending_begin = 0, pending_end = 0;  // a run not yet handed on (adjacent ones join)
  auto add = [&](uint64_t begin, uint64_t end) {
    if (begin == pending_end && pending_end > pending_begin) {
      pending_end = end;
      return;
    }
    if (pending_end > pending_begin) range(pending_begin, pending_end);
    pending_begin = begin, pending_end = end;
  };
  for (size_t i = 0; i + 1 < edges.size(); ++i) {
    const std::vector<Interval> intervals = band_intervals(windows, edges[i]);
    if (intervals.size() == 1 && intervals[0] == Interval{0, columns}) {
      add(edges[i] * columns, edges[i + 1] * columns);
      continue;
    }
    for (uint64_t row = edges[i]; row < edges[i + 1]; ++row) {
      for (const Interval& interval : intervals) add(row * columns + interval.first, row * columns + interval.second);
    }
  }
  if (pending_end > pending_begin) range(pending_begin, pending_end);
}

uint64_t TensorWindows::elements() const {
  uint64_t count = 0;
  for_each_range([&](uint64_t begin, uint64_t end) { count += end - begin; });
  return count;
}

}  // namespace weightstream::transfer

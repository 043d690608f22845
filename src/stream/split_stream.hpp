#pragma once
// Internal to the stream layer: two sources at once on disjoint sets of the requests, into
// one sink. The GPU's "both" path runs the staged source (CPU copies out of the page cache)
// beside the mapped one (the copy engine reading registered page-cache pages), so each
// brings its own limit and the device link sees the sum.

#include <functional>
#include <span>

#include "weightstream/stream.hpp"

namespace weightstream {

/// One of the two sources of split_stream(): streams `requests` (indices local to the
/// subset) into `sink` with `options`; `progress` is called as stream_tensors() calls it
/// and an exception it throws must cancel the source.
using SplitSource = std::function<StreamStats(std::span<const TensorRequest> requests, TensorSink& sink,
                                              const StreamOptions& options, const ProgressCallback& progress)>;

/// How split_stream() divides the work.
struct SplitPlan {
  double second_share = 0.5;  ///< fraction of the bytes the second source streams, in [0, 1]
  unsigned second_concurrency = 4;  ///< workers of the second source (the first gets the rest, at least 1)
};

/// Streams `requests` into `sink` with `first` and `second` running at once: requests are
/// dealt in file order so that each source holds its share of the bytes all along the
/// checkpoint; each source gets its part of options.concurrency and of options.memory_limit
/// (so the two together stay within the limit). The sink sees the original request indices,
/// pieces from both sources concurrently, each request completed once, and one finish()
/// after both sources are done. The first error (or a throw from `progress`, which is called
/// on this thread) cancels the other source and is the error thrown.
StreamStats split_stream(const Checkpoint& checkpoint, std::span<const TensorRequest> requests, TensorSink& sink,
                         const StreamOptions& options, const ProgressCallback& progress, const SplitPlan& plan,
                         const SplitSource& first, const SplitSource& second);

}  // namespace weightstream

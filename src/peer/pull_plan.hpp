#pragma once
// The plan of a pull (peer_pull.cpp): what each of a LoadSession's parameters needs, in
// checkpoint coordinates, and where it comes from.
//
// Each part of a puller's parameter is a rectangle of a checkpoint tensor (ModelLayout's
// rules), and so is each part of a serving parameter (its manifest). On a cold load, a puller
// parameter that a peer holds identically (same name, dtype and rectangles: the same layout)
// is read whole straight into the parameter's storage (a Direct). Any other need is covered
// by serving parameters' rectangles (an Assembly of Pieces): those parameters are read whole
// into staging, so that each is checked against its digest, and the rows the puller needs
// are assembled from them in Batches of whole layers that fit the staging buffers.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "weightstream/model.hpp"
#include "weightstream/peer.hpp"

namespace weightstream::transfer::pull {

/// A staged pull (a reload or update, or a layout unlike the server's) reads batches into
/// this many staging buffers in turn: the session writes one batch (on the committer's
/// thread) while the reads of the next two land, so the pipe to the peers never drains
/// between batches.
inline constexpr size_t kStagingSlots = 3;
/// The size of each, or of the largest layer where larger, but at most
/// PeerPullOptions::memory_limit / kStagingSlots (a single serving parameter larger than
/// that gets a buffer its size): a few layers of a model, never a copy of all of it.
inline constexpr uint64_t kStagingSlotBytes = 32ull << 20;
/// Where each serving parameter and each assembled tensor starts in a staging buffer.
inline constexpr uint64_t kStagingAlign = 64;

/// A rectangle [row_begin, row_end) x [column_begin, column_end) of a tensor's 2-D view.
struct Rect {
  int64_t row_begin = 0, row_end = 0, column_begin = 0, column_end = 0;
  bool empty() const { return row_begin >= row_end || column_begin >= column_end; }
  static Rect of(const ParameterPart& part) {
    return {part.row_begin, part.row_begin + part.rows, part.column_begin, part.column_begin + part.columns};
  }
  Rect intersect(const Rect& other) const {
    return {std::max(row_begin, other.row_begin), std::min(row_end, other.row_end),
            std::max(column_begin, other.column_begin), std::min(column_end, other.column_end)};
  }
  /// This rectangle minus `cut`: at most four rectangles.
  std::vector<Rect> minus(const Rect& cut) const;
  std::string text() const;
};

inline uint64_t element_bytes(Dtype dtype) { return std::max<uint64_t>(dtype_bits(dtype) / 8, 1); }

/// "peer HOST:PORT (tp rank R of N, ep rank E of M)", for messages.
std::string peer_text(const PeerManifest& manifest);

/// A serving peer as the plan sees it: its manifest and its parameters' indices by name.
struct ServingPeer {
  const PeerManifest* manifest = nullptr;
  const std::map<std::string, size_t, std::less<>>* by_name = nullptr;
};

/// One part of a puller's parameter: a rectangle of a checkpoint tensor.
struct Need {
  size_t parameter = 0;
  size_t part = 0;
  Rect rect;
};

/// A puller's parameter that a peer holds identically, read whole in place.
struct Direct {
  size_t link = 0;       ///< the serving peer
  size_t served = 0;     ///< its parameter
  size_t parameter = 0;  ///< the puller's
};

/// What one serving part contributes to an assembly.
struct Piece {
  size_t link = 0;
  size_t served = 0;
  const ParameterPart* part = nullptr;  ///< the serving part
  Rect rect;                            ///< what it contributes
};

/// The rows of a checkpoint tensor the puller needs, and the serving parts that cover them.
struct Assembly {
  std::string tensor;
  int64_t layer = -1;  ///< of the first parameter that wants it
  Dtype dtype = Dtype::kBF16;
  int64_t row_begin = 0, row_end = 0;
  std::vector<Piece> pieces;
};

using ServedKey = std::pair<size_t, size_t>;  ///< link, serving parameter

/// A serving parameter a batch reads into staging.
struct StagedRead {
  uint64_t offset = 0;                                 ///< where the serving parameter lies
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  ///< the bytes of it that are needed
};

/// Assemblies [first, end) laid out in one staging buffer: the serving parameters they read
/// from (whole, at their own offsets, though only the digest pieces holding what is needed
/// are read) and the rows assembled from them.
struct Batch {
  size_t first = 0, end = 0;
  std::map<ServedKey, StagedRead> reads;
  std::vector<uint64_t> rows;  ///< per assembly: where its rows are assembled (kAsIs: none)
  uint64_t bytes = 0;
};

/// Batch::rows of an assembly handed to the session straight from its staged serving parameter.
inline constexpr uint64_t kAsIs = ~uint64_t{0};

/// The whole plan of a pull.
struct PullPlan {
  std::map<std::string, const PeerTensor*, std::less<>> tensors;  ///< the checkpoint's, by name
  std::map<std::string, std::vector<Need>, std::less<>> needs;    ///< per checkpoint tensor
  std::vector<std::string> order;  ///< tensors in the order the layout's parameters first want them
  std::vector<Direct> directs;
  std::vector<Assembly> assemblies;  ///< whole layers together, in the order the layout wants them
  std::vector<Batch> batches;
};

/// The needs of `layout`'s parameters (plan.needs, plan.order), from plan.tensors. Throws
/// Error(kModel) for a tensor the checkpoint served by `uri` does not have.
void plan_needs(PullPlan& plan, const ModelLayout& layout, const std::string& uri);
/// The parameters a peer holds identically whose storage `session` lets a read land in
/// (`gpu_direct`: GPU memory may be read into straight from the peers).
void plan_directs(PullPlan& plan, LoadSession& session, const std::vector<ServingPeer>& peers, bool gpu_direct);
/// The assemblies of every needed tensor not read in place. Throws Error(kModel) for rows
/// no peer holds (naming a peer that holds them only processed) or a tensor held in two dtypes.
void plan_assemblies(PullPlan& plan, const ModelLayout& layout, const std::vector<ServingPeer>& peers,
                     const std::string& uri);
/// The batches of the assemblies, each at most a staging buffer's budget (from `memory_limit`).
void plan_batches(PullPlan& plan, const std::vector<ServingPeer>& peers, uint64_t memory_limit);

/// The views of `batch` staged at `base`, its rows assembled there first.
std::vector<TensorView> batch_views(const PullPlan& plan, const Batch& batch, std::byte* base);

}  // namespace weightstream::transfer::pull

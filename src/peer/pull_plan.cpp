// The plan of a pull (pull_plan.hpp).
#include "peer/pull_plan.hpp"

#include <cstring>
#include <optional>

#include "weightstream/error.hpp"

namespace weightstream::transfer::pull {
namespace {

bool same_parts(const std::vector<ParameterPart>& a, const std::vector<ParameterPart>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].tensor != b[i].tensor || a[i].row_begin != b[i].row_begin || a[i].rows != b[i].rows ||
        a[i].column_begin != b[i].column_begin || a[i].columns != b[i].columns ||
        a[i].element_offset != b[i].element_offset || a[i].shape != b[i].shape) {
      return false;
    }
  }
  return true;
}

/// Whether `parameter`, held by `peer` as its `served`, can be read whole into its storage.
bool readable_in_place(const Parameter& parameter, const PeerParameter& served, LoadSession& session,
                       bool gpu_direct) {
  if (served.dtype != parameter.dtype || served.bytes != parameter.bytes() || served.processing != Processing::kNone ||
      !same_parts(served.parts, parameter.parts) || !parameter.padding.empty()) {
    return false;
  }
  const uint64_t size = element_bytes(parameter.dtype);
  bool writable = true;
  for (const ParameterPart& part : parameter.parts) {
    const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * size;
    std::byte* at = session.direct_destination(part.tensor, parameter.dtype, part.shape,
                                               static_cast<uint64_t>(part.row_begin) * row_bytes,
                                               static_cast<uint64_t>(part.rows) * row_bytes, gpu_direct);
    writable &= at == parameter.data + part.element_offset * size;
  }
  return writable;
}

/// The serving parts that cover what the puller needs of tensor `name` (`wanted`).
Assembly cover(const std::string& name, const std::vector<Need>& wanted, const ModelLayout& layout,
               const std::vector<ServingPeer>& peers, const std::string& uri) {
  Assembly assembly;
  assembly.tensor = name;
  assembly.layer = layout.parameters()[wanted.front().parameter].layer;
  assembly.row_begin = wanted.front().rect.row_begin;
  assembly.row_end = wanted.front().rect.row_end;
  std::vector<Rect> left;
  for (const Need& need : wanted) {
    assembly.row_begin = std::min(assembly.row_begin, need.rect.row_begin);
    assembly.row_end = std::max(assembly.row_end, need.rect.row_end);
    left.push_back(need.rect);
  }
  std::string processed;  // a peer that holds the tensor only processed, for the error
  std::optional<Dtype> dtype;
  for (size_t l = 0; l < peers.size() && !left.empty(); ++l) {
    const PeerManifest& manifest = *peers[l].manifest;
    for (size_t s = 0; s < manifest.parameters.size() && !left.empty(); ++s) {
      const PeerParameter& served = manifest.parameters[s];
      for (const ParameterPart& part : served.parts) {
        if (part.tensor != name) continue;
        if (served.processing != Processing::kNone) {
          processed = served.name + " of " + peer_text(manifest);
          continue;
        }
        const Rect have = Rect::of(part);
        std::vector<Rect> next;
        for (const Rect& rect : left) {
          Rect inner = rect.intersect(have);
          if (inner.empty()) {
            next.push_back(rect);
            continue;
          }
          WS_EXPECT(!dtype || *dtype == served.dtype, ErrorCode::kModel,
                    "tensor " + name + " is held in " + std::string(dtype_name(*dtype)) + " and in " +
                        std::string(dtype_name(served.dtype)) + " by the peers of " + uri);
          dtype = served.dtype;
          assembly.pieces.push_back(Piece{l, s, &part, inner});
          for (const Rect& rest : rect.minus(inner)) next.push_back(rest);
        }
        left = std::move(next);
      }
    }
  }
  if (!left.empty()) {
    const Need& need = wanted.front();
    WS_FAIL(ErrorCode::kModel,
            "no peer of " + uri + " holds " + left.front().text() + " of tensor " + name + " (wanted by " +
                layout.parameters()[need.parameter].name + " of " + layout.description() + ")" +
                (processed.empty() ? std::string()
                                   : "; " + processed + " holds it processed (quantized), which cannot be read back "
                                                        "as checkpoint bytes: serve without --quantize"));
  }
  assembly.dtype = *dtype;
  return assembly;
}

int64_t columns_of(const PullPlan& plan, const Assembly& assembly) {
  return ParameterPart{.shape = plan.tensors.find(assembly.tensor)->second->shape}.tensor_columns();
}

/// An assembly whose one piece is whole rows of its tensor on both sides (the puller's part
/// and the server's) is handed to the session straight from the staged serving parameter:
/// no rows to assemble. On a reload or update, where every parameter comes this way, that
/// saves a copy of the whole model.
bool staged_as_is(const Assembly& assembly, int64_t columns) {
  if (assembly.pieces.size() != 1) return false;
  const Piece& piece = assembly.pieces.front();
  return piece.part->column_begin == 0 && piece.part->columns == columns && piece.rect.column_begin == 0 &&
         piece.rect.column_end == columns && piece.rect.row_begin == assembly.row_begin &&
         piece.rect.row_end == assembly.row_end;
}

uint64_t aligned(uint64_t bytes) { return (std::max<uint64_t>(bytes, 1) + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

/// Lays assemblies out in batches.
class BatchLayout {
 public:
  BatchLayout(const PullPlan& plan, const std::vector<ServingPeer>& peers) : plan_(plan), peers_(peers) {}

  /// Bytes `assembly` adds to `batch` (serving parameters already in `fresh` count once).
  uint64_t cost(const Batch& batch, const Assembly& assembly, std::set<ServedKey>& fresh) const {
    const int64_t columns = columns_of(plan_, assembly);
    uint64_t more = staged_as_is(assembly, columns)
                        ? 0
                        : aligned(static_cast<uint64_t>(assembly.row_end - assembly.row_begin) * columns *
                                  element_bytes(assembly.dtype));
    for (const Piece& piece : assembly.pieces) {
      const ServedKey key{piece.link, piece.served};
      if (batch.reads.count(key) == 0 && fresh.insert(key).second) more += aligned(served_bytes(piece));
    }
    return more;
  }

  /// Adds assembly `a` to `batch`.
  void add(Batch& batch, size_t a) const {
    const Assembly& assembly = plan_.assemblies[a];
    const int64_t columns = columns_of(plan_, assembly);
    const uint64_t size = element_bytes(assembly.dtype);
    for (const Piece& piece : assembly.pieces) {
      auto [at, inserted] = batch.reads.try_emplace(ServedKey{piece.link, piece.served});
      if (inserted) {
        at->second.offset = batch.bytes;
        batch.bytes += aligned(served_bytes(piece));
      }
      // Whole rows of the serving part: one range of the serving parameter.
      const ParameterPart& part = *piece.part;
      const uint64_t row_bytes = static_cast<uint64_t>(part.columns) * size;
      const uint64_t start = part.element_offset * size;
      at->second.ranges.emplace_back(start + static_cast<uint64_t>(piece.rect.row_begin - part.row_begin) * row_bytes,
                                     start + static_cast<uint64_t>(piece.rect.row_end - part.row_begin) * row_bytes);
    }
    if (staged_as_is(assembly, columns)) {
      batch.rows.push_back(kAsIs);
    } else {
      batch.rows.push_back(batch.bytes);
      batch.bytes += aligned(static_cast<uint64_t>(assembly.row_end - assembly.row_begin) * columns * size);
    }
    batch.end = a + 1;
  }

 private:
  uint64_t served_bytes(const Piece& piece) const { return peers_[piece.link].manifest->parameters[piece.served].bytes; }
  const PullPlan& plan_;
  const std::vector<ServingPeer>& peers_;
};

/// Copies what `assembly`'s pieces, staged at `base`, hold of its rows into `rows`.
void assemble_rows(const Assembly& assembly, const Batch& batch, const std::byte* base, int64_t columns,
                   std::byte* rows) {
  const uint64_t size = element_bytes(assembly.dtype);
  const uint64_t row_bytes = static_cast<uint64_t>(columns) * size;
  for (const Piece& piece : assembly.pieces) {
    const std::byte* source = base + batch.reads.at({piece.link, piece.served}).offset;
    const ParameterPart& part = *piece.part;
    const uint64_t width = static_cast<uint64_t>(piece.rect.column_end - piece.rect.column_begin) * size;
    if (part.column_begin == 0 && part.columns == columns && piece.rect.column_begin == 0 &&
        piece.rect.column_end == columns) {  // whole rows on both sides: one run
      std::memcpy(rows + static_cast<uint64_t>(piece.rect.row_begin - assembly.row_begin) * row_bytes,
                  source + (part.element_offset + static_cast<uint64_t>(piece.rect.row_begin - part.row_begin) *
                                                      static_cast<uint64_t>(columns)) * size,
                  static_cast<uint64_t>(piece.rect.row_end - piece.rect.row_begin) * row_bytes);
      continue;
    }
    for (int64_t row = piece.rect.row_begin; row < piece.rect.row_end; ++row) {
      const uint64_t from = (part.element_offset + static_cast<uint64_t>(row - part.row_begin) * part.columns +
                             static_cast<uint64_t>(piece.rect.column_begin - part.column_begin)) * size;
      const uint64_t to = static_cast<uint64_t>(row - assembly.row_begin) * row_bytes +
                          static_cast<uint64_t>(piece.rect.column_begin) * size;
      std::memcpy(rows + to, source + from, width);
    }
  }
}

}  // namespace

std::vector<Rect> Rect::minus(const Rect& cut) const {
  Rect inner = intersect(cut);
  if (inner.empty()) return {*this};
  std::vector<Rect> left;
  auto keep = [&](Rect r) {
    if (!r.empty()) left.push_back(r);
  };
  keep({row_begin, inner.row_begin, column_begin, column_end});
  keep({inner.row_end, row_end, column_begin, column_end});
  keep({inner.row_begin, inner.row_end, column_begin, inner.column_begin});
  keep({inner.row_begin, inner.row_end, inner.column_end, column_end});
  return left;
}

std::string Rect::text() const {
  return "rows " + std::to_string(row_begin) + "-" + std::to_string(row_end) + ", columns " +
         std::to_string(column_begin) + "-" + std::to_string(column_end);
}

std::string peer_text(const PeerManifest& manifest) {
  return "peer " + manifest.address + " (tp rank " + std::to_string(manifest.parallel.tp_rank) + " of " +
         std::to_string(manifest.parallel.tp_size) + ", ep rank " + std::to_string(manifest.parallel.ep_rank) + " of " +
         std::to_string(manifest.parallel.ep_size) + ")";
}

void plan_needs(PullPlan& plan, const ModelLayout& layout, const std::string& uri) {
  for (size_t p = 0; p < layout.parameters().size(); ++p) {
    const Parameter& parameter = layout.parameters()[p];
    for (size_t k = 0; k < parameter.parts.size(); ++k) {
      const ParameterPart& part = parameter.parts[k];
      auto served = plan.tensors.find(part.tensor);
      WS_EXPECT(served != plan.tensors.end(), ErrorCode::kModel,
                "parameter " + parameter.name + " of " + layout.description() + " wants tensor " + part.tensor +
                    ", which the checkpoint served by " + uri + " does not have");
      // Checked here, before a byte is read: a served tensor of the same name but another
      // shape (another intermediate_size, head count or vocabulary) cannot fill this part.
      WS_EXPECT(served->second->shape == part.shape, ErrorCode::kModel,
                "parameter " + parameter.name + " of " + layout.description() + " wants tensor " + part.tensor +
                    " of shape " + shape_text(part.shape) + ", but the checkpoint served by " + uri + " holds it as " +
                    shape_text(served->second->shape));
      auto [at, inserted] = plan.needs.try_emplace(part.tensor);
      if (inserted) plan.order.push_back(part.tensor);
      at->second.push_back(Need{p, k, Rect::of(part)});
    }
  }
}

void plan_directs(PullPlan& plan, LoadSession& session, const std::vector<ServingPeer>& peers, bool gpu_direct) {
  const ModelLayout& layout = session.layout();
  for (size_t p = 0; p < layout.parameters().size(); ++p) {
    const Parameter& parameter = layout.parameters()[p];
    if (parameter.parts.empty() || parameter.processing != Processing::kNone || parameter.data == nullptr) continue;
    bool shared_tensor = false;
    for (const ParameterPart& part : parameter.parts) shared_tensor |= plan.needs.find(part.tensor)->second.size() != 1;
    if (shared_tensor) continue;
    for (size_t l = 0; l < peers.size(); ++l) {
      auto found = peers[l].by_name->find(parameter.name);
      if (found == peers[l].by_name->end()) continue;
      const PeerParameter& served = peers[l].manifest->parameters[found->second];
      if (!readable_in_place(parameter, served, session, gpu_direct)) continue;
      plan.directs.push_back(Direct{l, found->second, p});
      break;
    }
  }
}

void plan_assemblies(PullPlan& plan, const ModelLayout& layout, const std::vector<ServingPeer>& peers,
                     const std::string& uri) {
  std::set<std::string, std::less<>> direct_tensors;
  for (const Direct& direct : plan.directs) {
    for (const ParameterPart& part : layout.parameters()[direct.parameter].parts) direct_tensors.insert(part.tensor);
  }
  for (const std::string& name : plan.order) {
    if (direct_tensors.count(name) != 0) continue;
    plan.assemblies.push_back(cover(name, plan.needs.find(name)->second, layout, peers, uri));
  }
  // Whole layers together, in the order the layout first wants each: a batch that holds every
  // tensor of its layers lets a whole-layer commit write them at once, holding nothing back.
  std::map<int64_t, size_t> rank;  // layer -> the order of its first assembly
  for (const Assembly& assembly : plan.assemblies) rank.try_emplace(assembly.layer, rank.size());
  std::stable_sort(plan.assemblies.begin(), plan.assemblies.end(),
                   [&](const Assembly& a, const Assembly& b) { return rank[a.layer] < rank[b.layer]; });
}

void plan_batches(PullPlan& plan, const std::vector<ServingPeer>& peers, uint64_t memory_limit) {
  const BatchLayout layout(plan, peers);
  const std::vector<Assembly>& assemblies = plan.assemblies;
  // Layer groups of the assemblies: [layers[i], layers[i + 1]).
  std::vector<size_t> layers;
  for (size_t a = 0; a < assemblies.size(); ++a) {
    if (a == 0 || assemblies[a].layer != assemblies[a - 1].layer) layers.push_back(a);
  }
  layers.push_back(assemblies.size());
  // A batch holds kStagingSlotBytes, or the largest layer where the memory limit allows: a
  // layer split across batches is held in the session until its last batch (copied: the
  // staging is reused at once), an extra copy of it.
  uint64_t largest_layer = 0;
  for (size_t i = 0; i + 1 < layers.size(); ++i) {
    Batch alone;
    std::set<ServedKey> fresh;
    uint64_t bytes = 0;
    for (size_t a = layers[i]; a < layers[i + 1]; ++a) bytes += layout.cost(alone, assemblies[a], fresh);
    largest_layer = std::max(largest_layer, bytes);
  }
  const uint64_t slot_budget = std::max<uint64_t>(
      std::min<uint64_t>(std::max(kStagingSlotBytes, largest_layer), memory_limit / kStagingSlots), kStagingAlign);
  // A batch ends at a layer's end once the next layer would take it past the budget; a layer
  // larger than that is split (its earlier batches then wait in the session, copied, for the
  // rest: LayerCommit::kWholeLayer).
  Batch batch;
  auto close = [&] {
    if (batch.end > batch.first) plan.batches.push_back(std::move(batch));
    batch = Batch{};
    batch.first = batch.end = plan.batches.empty() ? 0 : plan.batches.back().end;
  };
  for (size_t i = 0, a = 0; i + 1 < layers.size(); ++i) {
    const size_t layer_end = layers[i + 1];
    std::set<ServedKey> fresh;
    uint64_t layer_bytes = 0;
    for (size_t k = a; k < layer_end; ++k) layer_bytes += layout.cost(batch, assemblies[k], fresh);
    if (batch.bytes + layer_bytes > slot_budget) close();  // the layer starts a batch of its own
    for (; a < layer_end; ++a) {
      std::set<ServedKey> one;
      if (batch.end > batch.first && batch.bytes + layout.cost(batch, assemblies[a], one) > slot_budget) close();
      layout.add(batch, a);
    }
  }
  close();
}

std::vector<TensorView> batch_views(const PullPlan& plan, const Batch& batch, std::byte* base) {
  std::vector<TensorView> views;
  for (size_t a = batch.first; a < batch.end; ++a) {
    const Assembly& assembly = plan.assemblies[a];
    const PeerTensor& tensor = *plan.tensors.find(assembly.tensor)->second;
    const int64_t columns = columns_of(plan, assembly);
    const uint64_t size = element_bytes(assembly.dtype);
    const uint64_t row_bytes = static_cast<uint64_t>(columns) * size;
    TensorView view{.name = assembly.tensor,
                    .dtype = assembly.dtype,
                    .shape = tensor.shape,
                    .device = Device{},
                    .offset = static_cast<uint64_t>(assembly.row_begin) * row_bytes,
                    .bytes = static_cast<uint64_t>(assembly.row_end - assembly.row_begin) * row_bytes};
    const uint64_t rows_at = batch.rows[a - batch.first];
    if (rows_at == kAsIs) {
      const Piece& piece = assembly.pieces.front();
      view.data = base + batch.reads.at({piece.link, piece.served}).offset +
                  (piece.part->element_offset + static_cast<uint64_t>(piece.rect.row_begin - piece.part->row_begin) *
                                                    static_cast<uint64_t>(columns)) * size;
    } else {
      assemble_rows(assembly, batch, base, columns, base + rows_at);
      view.data = base + rows_at;
    }
    views.push_back(view);
  }
  return views;
}

}  // namespace weightstream::transfer::pull

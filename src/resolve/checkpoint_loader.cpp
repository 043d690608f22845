// Feeds a Checkpoint's stream into a LoadSession: each rank reads only the byte ranges it
// needs, and the session receives the pieces as the reader pool completes them.
#include <algorithm>

#include "weightstream/error.hpp"
#include "weightstream/load.hpp"

namespace weightstream {
namespace {

/// Hands every piece of a stream to the session as a piece of its named tensor.
class SessionSink final : public TensorSink {
 public:
  SessionSink(const LoadPlan& plan, LoadSession& session) : plan_(plan), session_(session) {}

  void consume(TensorPiece&& piece) override {
    const CheckpointTensor& tensor = *piece.tensor;
    TensorView view{tensor.name,   tensor.dtype, tensor.shape, piece.bytes.data(), Device{},
                    plan_.reads[piece.request].range.offset + piece.offset, piece.bytes.size()};
    session_.load(view);
  }

 private:
  const LoadPlan& plan_;
  LoadSession& session_;
};

std::string join(const std::vector<std::string>& items, size_t limit) {
  std::string text;
  for (size_t i = 0; i < items.size() && i < limit; ++i) text += (i ? ", " : "") + items[i];
  if (items.size() > limit) text += ", and " + std::to_string(items.size() - limit) + " more";
  return text;
}

}  // namespace

std::vector<TensorRequest> LoadPlan::requests() const {
  std::vector<TensorRequest> result;
  result.reserve(reads.size());
  for (const PlannedTensor& read : reads) result.push_back({read.tensor, read.range});
  return result;
}

LoadPlan LoadPlan::subset(std::span<const size_t> indices) const {
  LoadPlan plan;
  for (size_t index : indices) {
    plan.reads.push_back(reads.at(index));
    plan.bytes_to_read += reads[index].range.length;
  }
  return plan;
}

LoadPlan plan_layout_load(const ModelLayout& layout, const Checkpoint& checkpoint) {
  LoadPlan plan;
  std::vector<std::string> unmatched, misfits;
  std::vector<bool> present(layout.parameters().size());
  for (size_t index = 0; index < checkpoint.tensors().size(); ++index) {
    const CheckpointTensor& tensor = checkpoint.tensors()[index];
    TensorRoute route = layout.route(tensor.name);
    if (route.kind == TensorRoute::Kind::kUnmatched) {
      unmatched.push_back(tensor.name + " (" + checkpoint.shard_uri(tensor.shard) + ")");
      continue;
    }
    if (route.kind != TensorRoute::Kind::kParameter) {
      plan.unused.push_back({index, route.reason});
      continue;
    }
    PlannedTensor read{index, {0, tensor.bytes}, false, route.targets};
    for (const auto& [parameter_index, part_index] : route.targets) {
      const Parameter& parameter = layout.parameters()[parameter_index];
      const ParameterPart& part = parameter.parts[part_index];
      if (tensor.shape != part.shape) {
        misfits.push_back(tensor.name + " has shape " + shape_text(tensor.shape) + " but parameter " + parameter.name +
                          " (part '" + part.id + "', rule " + part.rule + ") expects " + shape_text(part.shape));
      }
    }
    if (route.targets.size() == 1) {
      // A slice of whole rows is one contiguous byte range: read only that.
      const ParameterPart& part = layout.parameters()[route.targets[0].first].parts[route.targets[0].second];
      if (part.contiguous() && tensor.shape == part.shape) {
        uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * (dtype_bits(tensor.dtype) / 8);
        ByteRange slice{static_cast<uint64_t>(part.row_begin) * row_bytes, static_cast<uint64_t>(part.rows) * row_bytes};
        if (slice.length == 0) {
          plan.unused.push_back({index, "no rows on this rank"});
          continue;
        }
        read.slice = slice.length < tensor.bytes;
        read.range = slice;
      }
    }
    if (read.range.length == 0) continue;  // an empty tensor: nothing to read
    plan.bytes_to_read += read.range.length;
    plan.reads.push_back(std::move(read));
  }
  WS_EXPECT(unmatched.empty(), ErrorCode::kModel,
            std::to_string(unmatched.size()) + " tensors of " + checkpoint.uri() + " match no parameter of " +
                layout.description() + " and no ignore rule: " + join(unmatched, 20));
  WS_EXPECT(misfits.empty(), ErrorCode::kModel,
            "tensors of " + checkpoint.uri() + " do not fit " + layout.description() + ": " + join(misfits, 20));
  for (const std::string& name : layout.wanted_tensors()) {
    if (!checkpoint.find(name)) plan.missing.push_back(name);
  }
  return plan;
}

StreamStats stream_into_session(const Checkpoint& checkpoint, const LoadPlan& plan, LoadSession& session,
                                const StreamOptions& options, const ProgressCallback& progress) {
  std::vector<TensorRequest> requests = plan.requests();
  SessionSink sink(plan, session);
  return stream_tensors(checkpoint, requests, sink, options, progress);
}

LayoutLoad load_layout(ModelLayout& layout, const Checkpoint& checkpoint, LoadMode mode, const StreamOptions& options,
                       const ProgressCallback& progress) {
  LoadPlan plan = plan_layout_load(layout, checkpoint);
  LoadSession session(layout);
  session.begin(mode);
  LayoutLoad result;
  result.stream = stream_into_session(checkpoint, plan, session, options, progress);
  session.finish();
  result.counters = session.counters();
  return result;
}

ModelConfig checkpoint_model_config(const Checkpoint& checkpoint) {
  WS_EXPECT(checkpoint.config_json().has_value(), ErrorCode::kNotFound,
            checkpoint.uri() + " has no config.json beside its shards: it is needed to build the model layout "
                               "(use --raw for a plain tensor load)");
  return parse_model_config(checkpoint.uri() + "/config.json", *checkpoint.config_json());
}

}  // namespace weightstream

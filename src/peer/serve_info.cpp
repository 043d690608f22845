// What a PeerServer publishes besides its layout (weightstream/peer.hpp): the checkpoint's
// config.json and tensors, its content digest and its quantization. The quantization of a
// block-scaled checkpoint is the model layer's rule (fp8_block_quantized), applied here
// rather than in the server, which knows layouts only.
#include <string>
#include <utility>
#include <vector>

#include "weightstream/architectures.hpp"
#include "weightstream/error.hpp"
#include "weightstream/load.hpp"
#include "weightstream/peer.hpp"

namespace weightstream {
namespace {

PeerServeInfo serve_info(std::string config_json, std::vector<PeerTensor> tensors, std::string content_digest,
                         const Parallelism& parallel, Processing quantize, const std::string& object) {
  PeerServeInfo info;
  info.content_digest = std::move(content_digest);
  const ModelConfig config = parse_model_config(object, config_json);
  info.quantization = quantize != Processing::kNone ? "fp8" : fp8_block_quantized(config) ? "fp8-block" : "none";
  info.config_json = std::move(config_json);
  info.tensors = std::move(tensors);
  info.parallel = parallel;
  return info;
}

}  // namespace

PeerServeInfo peer_serve_info(const Checkpoint& checkpoint, const Parallelism& parallel, Processing quantize,
                              const StreamOptions& options) {
  const auto& config_json = checkpoint.config_json();
  WS_EXPECT(config_json.has_value(), ErrorCode::kNotFound,
            "cannot serve " + checkpoint.uri() + ": it has no config.json beside its shards (pullers build their layout from it)");
  std::vector<PeerTensor> tensors;
  for (const CheckpointTensor& tensor : checkpoint.tensors()) {
    tensors.push_back({tensor.name, tensor.dtype, tensor.shape, checkpoint.shards()[tensor.shard].name});
  }
  return serve_info(*config_json, std::move(tensors), checkpoint_content_digest(checkpoint, options), parallel, quantize,
                    checkpoint.uri() + "/config.json");
}

PeerServeInfo peer_serve_info(const PeerSource& source, const Parallelism& parallel, Processing quantize) {
  return serve_info(source.config_json(), source.tensors(), source.content_digest(), parallel, quantize,
                    source.uri() + " (config.json published by the peer)");
}

}  // namespace weightstream

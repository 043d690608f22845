// weightstream inspect URI [--json] [--content]
#include <cstdio>
#include <iostream>

#include "cli/command.hpp"
#include "weightstream/load.hpp"
#include "weightstream/stream.hpp"

namespace weightstream::cli {

namespace {
struct InspectFlags {
  std::string uri;
  bool json = false;
  bool content = false;
};
}  // namespace

void add_inspect_command(CLI::App& app) {
  auto flags = std::make_shared<InspectFlags>();
  auto* command = app.add_subcommand("inspect", "List a checkpoint's tensors: dtype, shape, bytes and shard; totals; metadata");
  command->add_option("uri", flags->uri, "Checkpoint: a .safetensors file, a directory, file://, s3://, gs:// or az://")->required();
  command->add_flag("--json", flags->json, "Print JSON");
  command->add_flag("--content", flags->content,
                    "Also print the content digest (what `serve` publishes and --expect-digest takes): reads every "
                    "byte of the checkpoint once, where inspect otherwise reads only its headers");
  command->callback([flags] {
    const Options options = environment_options();
    auto checkpoint = Checkpoint::open(flags->uri, options);
    std::string content;
    if (flags->content) {
      ProgressLine progress(progress_enabled(StreamFlags{}, options));
      content = checkpoint_content_digest(checkpoint, options.stream, nullptr,
                                          [&progress](uint64_t done, uint64_t total) { progress.update(done, total); });
    }
    const auto& shards = checkpoint.shards();
    if (flags->json) {
      nlohmann::json tensors = nlohmann::json::array();
      for (const auto& tensor : checkpoint.tensors()) {
        tensors.push_back({{"name", tensor.name},
                           {"dtype", dtype_name(tensor.dtype)},
                           {"shape", tensor.shape},
                           {"bytes", tensor.bytes},
                           {"shard", shards[tensor.shard].name},
                           {"offset", tensor.offset}});
      }
      nlohmann::json shard_list = nlohmann::json::array();
      nlohmann::json metadata = nlohmann::json::object();
      for (const auto& shard : shards) {
        shard_list.push_back({{"name", shard.name}, {"bytes", shard.size}, {"tensors", shard.header.tensors.size()}});
        for (const auto& [key, value] : shard.header.metadata) metadata[key] = value;
      }
      nlohmann::json result = {{"uri", checkpoint.uri()},
                               {"tensors", tensors},
                               {"shards", shard_list},
                               {"tensor_count", checkpoint.tensors().size()},
                               {"bytes", checkpoint.tensor_bytes()},
                               {"metadata", metadata},
                               {"has_index", checkpoint.index().has_value()},
                               {"has_config", checkpoint.config_json().has_value()}};
      if (flags->content) result["content_digest"] = content;
      print_json(result);
      return;
    }
    // Columns by display width: a name of wide characters (CJK, emoji) takes two columns
    // a character, more than its bytes suggest.
    size_t name_width = 4;
    size_t shape_width = 5;
    for (const auto& tensor : checkpoint.tensors()) {
      name_width = std::max(name_width, display_width(tensor.name));
      shape_width = std::max(shape_width, shape_text(tensor.shape).size());
    }
    std::printf("%s  %-8s  %-*s  %12s  %s\n", pad_to("name", name_width).c_str(), "dtype", static_cast<int>(shape_width),
                "shape", "bytes", "shard");
    for (const auto& tensor : checkpoint.tensors()) {
      std::printf("%s  %-8s  %-*s  %12llu  %s\n", pad_to(tensor.name, name_width).c_str(),
                  std::string(dtype_name(tensor.dtype)).c_str(), static_cast<int>(shape_width),
                  shape_text(tensor.shape).c_str(), static_cast<unsigned long long>(tensor.bytes),
                  shards[tensor.shard].name.c_str());
    }
    std::printf("\n%s, %s (%llu bytes) in %s\n", counted(checkpoint.tensors().size(), "tensor").c_str(),
                format_size(checkpoint.tensor_bytes()).c_str(), static_cast<unsigned long long>(checkpoint.tensor_bytes()),
                counted(shards.size(), "shard").c_str());
    for (const auto& shard : shards) {
      for (const auto& [key, value] : shard.header.metadata) std::printf("metadata %s: %s = %s\n", shard.name.c_str(), key.c_str(), value.c_str());
    }
    if (flags->content) {
      std::printf("content digest %s (xxh64 over every tensor's name, dtype, shape and xxh64, in name order)\n",
                  content.c_str());
    }
  });
}

}  // namespace weightstream::cli

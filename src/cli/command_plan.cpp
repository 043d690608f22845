// weightstream plan URI [--tp-size T] [--tp-rank R] [--ep-size E] [--ep-rank R] [--json]
// A dry run: each parameter, the checkpoint tensors, shards and byte ranges that fill it,
// and the checkpoint tensors this rank will not read.
#include <cstdio>
#include <map>

#include "cli/layout_flags.hpp"

namespace weightstream::cli {
namespace {

struct PlanFlags {
  std::string uri;
  LayoutFlags layout;
  bool json = false;
};

nlohmann::json plan_json(const Checkpoint& checkpoint, const ModelLayout& layout, const LoadPlan& plan) {
  std::map<std::pair<size_t, size_t>, const PlannedTensor*> reads;  // by the (parameter, part) it fills
  for (const PlannedTensor& read : plan.reads) {
    for (const auto& target : read.targets) reads.emplace(target, &read);
  }
  nlohmann::json parameters = nlohmann::json::array();
  for (size_t parameter_index = 0; parameter_index < layout.parameters().size(); ++parameter_index) {
    const Parameter& parameter = layout.parameters()[parameter_index];
    nlohmann::json parts = nlohmann::json::array();
    for (size_t part_index = 0; part_index < parameter.parts.size(); ++part_index) {
      const ParameterPart& part = parameter.parts[part_index];
      nlohmann::json entry = {{"id", part.id},
                              {"tensor", part.tensor},
                              {"rule", part.rule},
                              {"rows", {part.row_begin, part.rows}},
                              {"columns", {part.column_begin, part.columns}}};
      if (auto it = reads.find({parameter_index, part_index}); it != reads.end()) {
        const PlannedTensor& read = *it->second;
        const CheckpointTensor& tensor = checkpoint.tensors()[read.tensor];
        entry["shard"] = checkpoint.shards()[tensor.shard].name;
        entry["file_offset"] = tensor.offset + read.range.offset;
        entry["bytes"] = read.request().run_bytes();
        if (read.runs > 1) {
          entry["runs"] = read.runs;
          entry["run_bytes"] = read.range.length;
          entry["stride"] = read.stride;
        }
        entry["read"] = read.runs > 1 ? "column window, a run per row" : read.slice ? "slice" : "whole";
      } else {
        entry["read"] = part.elements() == 0 ? "nothing (no rows on this rank)" : "missing from the checkpoint";
      }
      parts.push_back(std::move(entry));
    }
    nlohmann::json entry = {{"name", parameter.name},
                            {"dtype", dtype_name(parameter.dtype)},
                            {"shape", parameter.shape},
                            {"layer", parameter.layer},
                            {"parts", std::move(parts)}};
    if (parameter.processing == Processing::kFp8PerTensor) {
      entry["processing"] = "fp8_e4m3_per_tensor";
      entry["load_dtype"] = dtype_name(parameter.load_dtype);
      entry["scale"] = parameter.scale;
    }
    if (parameter.parts.empty()) entry["derived"] = true;
    parameters.push_back(std::move(entry));
  }
  nlohmann::json unused = nlohmann::json::array();
  for (const UnusedTensor& item : plan.unused) {
    const CheckpointTensor& tensor = checkpoint.tensors()[item.tensor];
    unused.push_back({{"tensor", tensor.name}, {"shard", checkpoint.shards()[tensor.shard].name}, {"reason", item.reason}});
  }
  return {{"uri", checkpoint.uri()},
          {"layout", layout.description()},
          {"checkpoint_bytes", checkpoint.tensor_bytes()},
          {"bytes_to_read", plan.bytes_to_read},
          {"tensors_read", plan.reads.size()},
          {"parameters", std::move(parameters)},
          {"unused", std::move(unused)},
          {"missing", plan.missing}};
}

void print_plan(const Checkpoint& checkpoint, const ModelLayout& layout, const LoadPlan& plan) {
  nlohmann::json json = plan_json(checkpoint, layout, plan);
  for (const auto& parameter : json["parameters"]) {
    std::printf("%s %s %s\n", parameter["name"].get<std::string>().c_str(), parameter["dtype"].get<std::string>().c_str(),
                shape_text(parameter["shape"].get<std::vector<int64_t>>()).c_str());
    for (const auto& part : parameter["parts"]) {
      std::string where = part.contains("shard") ? part["shard"].get<std::string>() + " @" +
                                                        std::to_string(part["file_offset"].get<uint64_t>()) + "+" +
                                                        std::to_string(part["bytes"].get<uint64_t>())
                                                  : std::string();
      std::printf("  <- %s%s %s (%s)\n", part["tensor"].get<std::string>().c_str(),
                  part["id"].get<std::string>().empty() ? "" : ("[" + part["id"].get<std::string>() + "]").c_str(),
                  where.c_str(), part["read"].get<std::string>().c_str());
    }
  }
  for (const auto& item : json["unused"]) {
    std::printf("not read: %s (%s)\n", item["tensor"].get<std::string>().c_str(), item["reason"].get<std::string>().c_str());
  }
  for (const auto& name : plan.missing) std::printf("missing: %s\n", name.c_str());
  std::printf("%s: %zu parameters, reads %s of %s in %zu tensors\n", layout.description().c_str(),
              layout.parameters().size(), format_size(plan.bytes_to_read).c_str(),
              format_size(checkpoint.tensor_bytes()).c_str(), plan.reads.size());
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto flags = std::make_shared<PlanFlags>();
  auto* command = app.add_subcommand(
      "plan", "Dry run: which checkpoint tensors, shards and byte ranges fill each parameter of this rank");
  command->add_option("uri", flags->uri, "Checkpoint with config.json: a directory, file://, s3://, gs:// or az://")->required();
  add_layout_flags(*command, flags->layout);
  command->add_flag("--json", flags->json, "Print JSON: parameters with their parts and byte ranges, unused, missing, the engine's model hooks");
  command->callback([flags] {
    Options options = environment_options();
    EngineLayoutOptions layout_options;
    layout_options.layout = layout_options_from_flags(flags->layout);  // a bad rank before any read
    Checkpoint checkpoint = Checkpoint::open(flags->uri, options);
    // Storage is not needed for a plan: the layout is built without allocating, and the
    // hooks an engine_layout with storage registers are named, not attached.
    ModelConfig config = checkpoint_layout_config(checkpoint);
    std::vector<std::string_view> names;
    for (const CheckpointTensor& tensor : checkpoint.tensors()) names.push_back(tensor.name);
    ModelLayout layout = engine_layout(config, checkpoint.uri() + "/config.json", names, layout_options);
    LoadPlan plan = plan_layout_load(layout, checkpoint);
    if (flags->json) {
      nlohmann::json json = plan_json(checkpoint, layout, plan);
      json["hooks"] = nlohmann::json::array();
      for (const auto& hook : engine_hooks(layout, config)) json["hooks"].push_back(hook->name());
      print_json(json);
    } else {
      print_plan(checkpoint, layout, plan);
    }
  });
}

}  // namespace weightstream::cli

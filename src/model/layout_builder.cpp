// The one builder that turns a family's mapping table, a config and this rank's place
// (tensor- and expert-parallel) into a ModelLayout: which slice of each checkpoint tensor a
// rank takes, where it lands in its (fused, stacked) parameter, FP8 block scales beside
// block-quantized weights. It knows no family: their rules are data (src/model/families/).
#include <algorithm>
#include <numeric>

#include "model/layer_scopes.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {
namespace {

using Dimensions = std::map<std::string, int64_t, std::less<>>;
using model::block_scale_name;
using model::ceil_div;
using model::LayerScopes;
using model::left_unquantized;
using model::routed_experts;
using model::scale_name;

/// The slice of one tensor a rank takes, and the rows it occupies in its parameter (more
/// than the slice's rows for vocabulary padding).
struct Slice {
  int64_t row_begin = 0, rows = 0, column_begin = 0, columns = 0, slot_rows = 0;
};

int64_t divide_exactly(int64_t extent, int64_t parts, const std::string& what) {
  WS_EXPECT(parts > 0 && extent % parts == 0, ErrorCode::kModel,
            what + ": extent " + std::to_string(extent) + " does not divide among " + std::to_string(parts) +
                " tensor-parallel ranks");
  return extent / parts;
}
Slice slice_for_rank(const MappingRule& rule, Split split, const std::vector<int64_t>& shape,
                     const Dimensions& dimensions, const Parallelism& parallel, const std::string& tensor) {
  int64_t rows = shape.empty() ? 1 : shape[0];
  int64_t columns = 1;
  for (size_t i = 1; i < shape.size(); ++i) columns *= shape[i];
  Slice slice{0, rows, 0, columns, rows};
  int64_t size = parallel.tp_size, rank = parallel.tp_rank;
  std::string what = "tensor " + tensor + " (rule " + rule.tensor + ", " + std::string(split_name(split)) + " split)";
  switch (split) {
    case Split::kReplicated: break;
    case Split::kColumn: {
      int64_t share = divide_exactly(rows, size, what);
      slice = {rank * share, share, 0, columns, share};
      break;
    }
    case Split::kRow: {
      WS_EXPECT(shape.size() >= 2, ErrorCode::kModel, what + ": a row split needs two dimensions");
      int64_t share = divide_exactly(columns, size, what);
      slice = {0, rows, rank * share, share, rows};
      break;
    }
    case Split::kVocab: {
      int64_t padded = (rows + kVocabPadding - 1) / kVocabPadding * kVocabPadding;
      int64_t share = divide_exactly(padded, size, what + " padded to a multiple of 64");
      int64_t begin = std::min(rank * share, rows);
      int64_t end = std::min((rank + 1) * share, rows);
      slice = {begin, end - begin, 0, columns, share};
      break;
    }
    case Split::kKvHeads: {
      int64_t heads = dimensions.at("kv_heads");
      int64_t head_dim = dimensions.at("head_dim");
      WS_EXPECT(rows == heads * head_dim, ErrorCode::kModel,
                what + ": " + std::to_string(rows) + " rows are not " + std::to_string(heads) + " K/V heads of " +
                    std::to_string(head_dim));
      if (size <= heads) {
        int64_t share = divide_exactly(heads, size, what + " (K/V heads)") * head_dim;
        slice = {rank * share, share, 0, columns, share};
      } else {
        // More ranks than K/V heads: each head is replicated on tp_size / heads ranks.
        WS_EXPECT(size % heads == 0, ErrorCode::kModel,
                  what + ": tp_size " + std::to_string(size) + " is not a multiple of the " + std::to_string(heads) +
                      " K/V heads");
        int64_t head = rank / (size / heads);
        slice = {head * head_dim, head_dim, 0, columns, head_dim};
      }
      break;
    }
    case Split::kColumnSections:
      WS_FAIL(ErrorCode::kModel, what + ": a sectioned tensor takes one slice per section (section_slices)");
  }
  return slice;
}

/// The slices of a Split::kColumnSections tensor a rank takes, one per section in order,
/// each with its part id: the rank's share of every section (vLLM's
/// mamba_v2_sharded_weight_loader, without its duplicated groups, which Qwen3-Next does not use).
std::vector<std::pair<std::string, Slice>> section_slices(const MappingRule& rule, const std::vector<int64_t>& shape,
                                                          const Dimensions& dimensions, const Parallelism& parallel,
                                                          const std::string& tensor) {
  int64_t rows = shape.empty() ? 1 : shape[0];
  int64_t columns = 1;
  for (size_t i = 1; i < shape.size(); ++i) columns *= shape[i];
  std::string what = "tensor " + tensor + " (rule " + rule.tensor + ", column_sections split)";
  WS_EXPECT(!rule.sections.empty(), ErrorCode::kModel, what + ": the rule names no sections");
  std::vector<std::pair<std::string, Slice>> slices;
  int64_t begin = 0;
  for (const RowSection& section : rule.sections) {
    auto it = dimensions.find(section.rows);
    WS_EXPECT(it != dimensions.end() && it->second > 0, ErrorCode::kModel,
              what + ": section '" + section.part + "' has dimension '" + section.rows +
                  "', which is missing or zero in config.json");
    int64_t extent = it->second;
    WS_EXPECT(extent <= rows - begin, ErrorCode::kModel,
              what + ": section '" + section.part + "' (" + section.rows + " = " + std::to_string(extent) +
                  " rows from row " + std::to_string(begin) + ") runs past the tensor's " + std::to_string(rows) +
                  " rows");
    int64_t share = divide_exactly(extent, parallel.tp_size, what + " section '" + section.part + "' (" + section.rows + ")");
    slices.emplace_back(section.part, Slice{begin + parallel.tp_rank * share, share, 0, columns, share});
    begin += extent;
  }
  WS_EXPECT(begin == rows, ErrorCode::kModel,
            what + ": its sections cover " + std::to_string(begin) + " of the tensor's " + std::to_string(rows) + " rows");
  return slices;
}

/// A parameter being assembled from its parts.
struct PendingParameter {
  Parameter parameter;
  bool stacked = false;
  bool linear = false;
  /// FP8 block quantization: the parts are F8_E4M3 codes with block scales (null: not quantized).
  std::optional<bool> block_quantized;
  std::map<int64_t, int64_t> next_row;  ///< per stack index (local expert), rows filled so far
  std::vector<std::pair<int64_t, int64_t>> placement;  ///< per part: stack index, first row
  int64_t columns = -1;
  int64_t rank = 0;  ///< dimensions of the checkpoint tensors
  /// The checkpoint tensors' dimensions after the first ([1, kernel] for conv1d): kept in
  /// the parameter's shape when its parts take whole rows, as vLLM's conv1d [rows, 1, kernel].
  std::vector<int64_t> trailing;
};

class LayoutBuilder {
 public:
  LayoutBuilder(const Architecture& architecture, const ModelConfig& config, const LayoutOptions& options)
      : config_(config),
        options_(options),
        scopes_(architecture, config),
        dimensions_(model_dimensions(config)) {
    const Parallelism& parallel = options.parallel;
    WS_EXPECT(parallel.tp_size >= 1 && parallel.tp_rank >= 0 && parallel.tp_rank < parallel.tp_size,
              ErrorCode::kModel,
              "tp_rank " + std::to_string(parallel.tp_rank) + " is outside tp_size " + std::to_string(parallel.tp_size));
    WS_EXPECT(parallel.ep_size >= 1 && parallel.ep_rank >= 0 && parallel.ep_rank < parallel.ep_size,
              ErrorCode::kModel,
              "ep_rank " + std::to_string(parallel.ep_rank) + " is outside ep_size " + std::to_string(parallel.ep_size));
    WS_EXPECT(config.num_attention_heads % parallel.tp_size == 0, ErrorCode::kModel,
              config.model_type + ": " + std::to_string(config.num_attention_heads) +
                  " attention heads do not divide among tp_size " + std::to_string(parallel.tp_size));
    dtype_ = options.dtype.value_or(config.torch_dtype == "float16"   ? Dtype::kF16
                                    : config.torch_dtype == "float32" ? Dtype::kF32
                                                                      : Dtype::kBF16);
    block_quantized_ = fp8_block_quantized(config);
    if (block_quantized_) {
      WS_EXPECT(options.quantize == Processing::kNone, ErrorCode::kModel,
                config.model_type + ": the checkpoint's weights are FP8 block-quantized already " +
                    "(quantization_config); online quantization (fp8, per tensor) does not apply to them");
      block_n_ = config.quantization.weight_block_size[0];
      block_k_ = config.quantization.weight_block_size[1];
    }
    experts_ = routed_experts(config);
    if (experts_ > 0 && parallel.ep_size > 1) {
      WS_EXPECT(experts_ % parallel.ep_size == 0, ErrorCode::kModel,
                config.model_type + ": " + std::to_string(experts_) + " routed experts do not divide among ep_size " +
                    std::to_string(parallel.ep_size));
      experts_per_rank_ = experts_ / parallel.ep_size;
      first_expert_ = parallel.ep_rank * experts_per_rank_;
    } else {
      experts_per_rank_ = experts_;
    }
    if (architecture.linear_attention && !config.layer_types.empty()) {
      WS_EXPECT(static_cast<int64_t>(config.layer_types.size()) == config.num_hidden_layers, ErrorCode::kModel,
                config.model_type + ": layer_types has " + std::to_string(config.layer_types.size()) +
                    " entries for num_hidden_layers = " + std::to_string(config.num_hidden_layers));
      for (size_t layer = 0; layer < config.layer_types.size(); ++layer) {
        const std::string& type = config.layer_types[layer];
        WS_EXPECT(type == "full_attention" || type == "linear_attention", ErrorCode::kModel,
                  config.model_type + ": layer_types[" + std::to_string(layer) + "] = '" + type +
                      "': expected full_attention or linear_attention");
      }
    }
    layout_.set_description(describe());
  }

  ModelLayout build(const std::vector<MappingRule>& rules) {
    expect_bounded_size(rules, scopes_.total_layers());
    expect_linear_attention_heads_divide();
    for (int64_t layer = 0; layer < scopes_.total_layers(); ++layer) {
      layout_.set_layer_kind(layer, scopes_.mtp(layer) ? LayerKind::kMtp : LayerKind::kDecoder);
    }
    scopes_.for_each(rules, experts_, [this](const MappingRule& rule, int64_t layer, int64_t expert) {
      apply(rule, layer, expert);
    });
    for (PendingParameter& pending : pending_) finish(pending);
    if (config_.tie_word_embeddings && layout_.find("model.embed_tokens.weight")) add_tied_lm_head();
    for (const std::string& rule : ignore_rules(config_)) layout_.add_ignore_rule(rule);
    return std::move(layout_);
  }

 private:
  /// config.json is untrusted: refuses, before building, a config whose layers, experts
  /// and rules would map more tensors than allowed (every parameter part costs memory).
  void expect_bounded_size(const std::vector<MappingRule>& rules, int64_t total_layers) const {
    long double global = 0, per_layer = 0, per_expert = 0;
    for (const MappingRule& rule : rules) {
      long double parts = static_cast<long double>(std::max<size_t>(rule.sections.size(), 1));
      if (rule.scope == LayerScope::kGlobal) global += parts;
      else if (rule.scope == LayerScope::kExpert) per_expert += parts;
      else per_layer += parts;
    }
    long double bound = global + static_cast<long double>(std::max<int64_t>(total_layers, 0)) *
                                     (per_layer + static_cast<long double>(std::max<int64_t>(experts_, 0)) * per_expert);
    if (block_quantized_) bound *= 2;  // a scale per quantized weight
    uint64_t limit = options_.max_tensors > 0 ? options_.max_tensors : kMaxLayoutTensors;
    if (bound <= static_cast<long double>(limit)) return;
    WS_FAIL(ErrorCode::kModel,
            config_.model_type + ": config.json describes up to " + std::to_string(static_cast<uint64_t>(std::min<long double>(bound, 1e19L))) +
                " tensors (num_hidden_layers = " + std::to_string(config_.num_hidden_layers) +
                ", MTP layers = " + std::to_string(mtp_layer_count(config_)) + ", routed experts = " +
                std::to_string(experts_) + "), more than " +
                (options_.max_tensors > 0 ? std::to_string(limit) + " that the checkpoint's tensors allow"
                                          : std::to_string(limit) + ", the most any model may map") +
                ": the layout is not built");
  }

  std::string describe() const {
    const Parallelism& parallel = options_.parallel;
    std::string text = config_.model_type + " tp " + std::to_string(parallel.tp_size) + " rank " +
                       std::to_string(parallel.tp_rank);
    if (parallel.ep_size > 1) {
      text += " ep " + std::to_string(parallel.ep_size) + " rank " + std::to_string(parallel.ep_rank);
    }
    if (options_.modules == LayoutModules::kDraft) text += " (draft)";
    return text;
  }

  std::string rank_text() const {
    return "tp " + std::to_string(options_.parallel.tp_size) + " rank " + std::to_string(options_.parallel.tp_rank);
  }

  /// vLLM gives each rank whole key heads of a Gated DeltaNet layer (in_proj_qkvz and
  /// in_proj_ba by key-head group, conv1d's q and k sections) and whole value heads (conv1d's
  /// v section, A_log, dt_bias, out_proj's columns); it floors a share that does not divide,
  /// so such a tp_size is refused here.
  void expect_linear_attention_heads_divide() const {
    int64_t size = options_.parallel.tp_size;
    if (size == 1 || options_.modules == LayoutModules::kDraft) return;
    for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
      if (scopes_.has_full_attention(layer)) continue;
      int64_t keys = config_.linear_num_key_heads, values = config_.linear_num_value_heads;
      WS_EXPECT(keys % size == 0 && values % size == 0, ErrorCode::kModel,
                config_.model_type + " tp " + std::to_string(size) + ": the Gated DeltaNet layers (layer " +
                    std::to_string(layer) + " first) have " + std::to_string(keys) +
                    " key heads (linear_num_key_heads) and " + std::to_string(values) +
                    " value heads (linear_num_value_heads), which do not both divide among tp_size " +
                    std::to_string(size) + ": each rank holds whole key and value heads of linear_attn.in_proj_qkvz, "
                    "in_proj_ba, conv1d, A_log, dt_bias and out_proj; use a tp_size that divides " +
                    std::to_string(std::gcd(keys, values)));
      return;
    }
  }

  bool module_wants(int64_t layer) const {
    bool mtp = scopes_.mtp(layer);
    return options_.modules == LayoutModules::kDraft ? layer >= 0 && mtp : !mtp;
  }

  void apply(const MappingRule& rule, int64_t layer, int64_t expert) {
    std::string tensor = scopes_.expand_name(rule.tensor, layer, expert);
    bool quantized = block_quantized_ && rule.linear && !left_unquantized(config_, tensor);
    auto skip = [&](const std::string& reason) {
      layout_.add_skipped_tensor(tensor, reason);
      if (quantized) layout_.add_skipped_tensor(block_scale_name(tensor), reason);
    };
    if (!module_wants(layer)) {
      skip(options_.modules == LayoutModules::kDraft ? "the target module (this layout is the draft)"
                                                     : "the draft module (MTP layer " + std::to_string(layer) + ")");
      return;
    }
    int64_t local_expert = 0;
    Split split = rule.split;
    if (expert >= 0 && options_.parallel.ep_size > 1) {
      if (expert < first_expert_ || expert >= first_expert_ + experts_per_rank_) {
        skip("expert " + std::to_string(expert) + " of expert-parallel rank " + std::to_string(expert / experts_per_rank_));
        return;
      }
      // Expert parallelism keeps each expert whole on its rank.
      split = Split::kReplicated;
      local_expert = expert - first_expert_;
    } else if (expert >= 0) {
      local_expert = expert;
    }
    std::vector<int64_t> shape;
    for (const std::string& dimension : rule.shape) {
      auto it = dimensions_.find(dimension);
      WS_EXPECT(it != dimensions_.end() && it->second > 0, ErrorCode::kModel,
                config_.model_type + " rule " + rule.tensor + ": dimension '" + dimension +
                    "' is missing or zero in config.json");
      shape.push_back(it->second);
    }
    std::vector<std::pair<std::string, Slice>> slices = split == Split::kColumnSections
        ? section_slices(rule, shape, dimensions_, options_.parallel, tensor)
        : std::vector<std::pair<std::string, Slice>>{{rule.part, slice_for_rank(rule, split, shape, dimensions_,
                                                                                  options_.parallel, tensor)}};

    std::string name = scopes_.expand_name(rule.parameter, layer, expert);
    auto [it, inserted] = pending_index_.try_emplace(name, pending_.size());
    if (inserted) {
      PendingParameter pending;
      pending.parameter.name = name;
      pending.parameter.dtype = rule.dtype.value_or(dtype_);
      pending.parameter.load_dtype = pending.parameter.dtype;
      pending.parameter.layer = layer;
      pending.stacked = expert >= 0;
      pending.linear = rule.linear;
      pending.rank = static_cast<int64_t>(shape.size());
      if (shape.size() > 1) pending.trailing.assign(shape.begin() + 1, shape.end());
      pending_.push_back(std::move(pending));
    }
    PendingParameter& pending = pending_[it->second];
    for (const auto& [id, slice] : slices) {
      WS_EXPECT(pending.columns < 0 || pending.columns == slice.columns, ErrorCode::kModel,
                "parameter " + name + ": part '" + id + "' from " + tensor + " has " + std::to_string(slice.columns) +
                    " columns per rank, earlier parts " + std::to_string(pending.columns));
      // vLLM refuses a fused layer whose shards are quantized in part ("Detected some but not
      // all shards of ... are quantized"): one scale layout holds for a whole parameter.
      WS_EXPECT(!pending.block_quantized || *pending.block_quantized == quantized, ErrorCode::kModel,
                "parameter " + name + ": part '" + id + "' from " + tensor + " is " +
                    (quantized ? "FP8 block-quantized" : "left unquantized (modules_to_not_convert)") +
                    " but earlier parts are not: a fused parameter is quantized whole or not at all");
      pending.block_quantized = quantized;
      pending.columns = slice.columns;
      int64_t& row = pending.next_row[local_expert];
      ParameterPart part;
      part.tensor = tensor;
      part.id = id;
      part.shape = shape;
      part.row_begin = slice.row_begin;
      part.rows = slice.rows;
      part.column_begin = slice.column_begin;
      part.columns = slice.columns;
      part.rule = rule.tensor + " -> " + rule.parameter + (id.empty() ? "" : "[" + id + "]") + ", " +
                  std::string(split_name(split));
      pending.placement.emplace_back(local_expert, row);
      pending.parameter.parts.push_back(std::move(part));
      row += slice.slot_rows;
    }
  }

  /// The F32 block scales of a block-quantized parameter, as vLLM's Fp8LinearMethod and
  /// FusedMoE hold them for weight_block_size [block_n, block_k]: each part's rank slice
  /// in blocks, parts' block-rows concatenated in part order (per expert when stacked).
  /// A slice that does not start on a block boundary, or whose extent is not whole blocks
  /// (except the last part of a parameter that takes the tensor's full rows, whose last
  /// block may be partial), is refused as vLLM's validate_fp8_block_shape refuses it.
  Parameter block_scale(const PendingParameter& pending) const {
    const Parameter& weight = pending.parameter;
    Parameter scale;
    scale.name = block_scale_name(weight.name);
    scale.dtype = Dtype::kF32;
    scale.load_dtype = Dtype::kF32;
    scale.layer = weight.layer;
    std::string block = "[" + std::to_string(block_n_) + ", " + std::to_string(block_k_) + "]";
    auto refuse = [&](const ParameterPart& part, const std::string& what) {
      WS_FAIL(ErrorCode::kModel,
              "parameter " + weight.name + " on " + rank_text() + ": part " +
                  (part.id.empty() ? std::string() : "'" + part.id + "' ") + "from " + part.tensor + " takes " + what +
                  ", which does not fall on the weight_block_size " + block +
                  " boundaries of its FP8 block scales (vLLM refuses this split too); use a tp size that divides " +
                  "the tensor in whole blocks");
    };
    // The last part of each stack (expert) may end in a partial block.
    std::map<int64_t, size_t> last_part;
    for (size_t i = 0; i < weight.parts.size(); ++i) last_part[pending.placement[i].first] = i;
    std::map<int64_t, int64_t> next_block_row;
    std::vector<std::pair<int64_t, int64_t>> placement;
    int64_t block_columns = -1;
    for (size_t i = 0; i < weight.parts.size(); ++i) {
      const ParameterPart& part = weight.parts[i];
      int64_t tensor_rows = part.tensor_rows(), tensor_columns = part.tensor_columns();
      bool whole_rows = part.row_begin == 0 && part.rows == tensor_rows;
      bool partial_rows_allowed = whole_rows && last_part[pending.placement[i].first] == i;
      if (part.row_begin % block_n_ != 0 || (part.rows % block_n_ != 0 && !partial_rows_allowed)) {
        refuse(part, "rows " + std::to_string(part.row_begin) + "+" + std::to_string(part.rows) + " of " +
                         std::to_string(tensor_rows));
      }
      bool whole_columns = part.column_begin == 0 && part.columns == tensor_columns;
      if (part.column_begin % block_k_ != 0 || (part.columns % block_k_ != 0 && !whole_columns)) {
        refuse(part, "columns " + std::to_string(part.column_begin) + "+" + std::to_string(part.columns) + " of " +
                         std::to_string(tensor_columns));
      }
      ParameterPart blocks;
      blocks.tensor = block_scale_name(part.tensor);
      blocks.id = part.id;
      blocks.shape = {ceil_div(tensor_rows, block_n_), ceil_div(tensor_columns, block_k_)};
      blocks.row_begin = part.row_begin / block_n_;
      blocks.rows = ceil_div(part.rows, block_n_);
      blocks.column_begin = part.column_begin / block_k_;
      blocks.columns = ceil_div(part.columns, block_k_);
      blocks.rule = part.rule + ", " + block + " block scales";
      block_columns = blocks.columns;
      int64_t stack = pending.placement[i].first;
      int64_t& row = next_block_row[stack];
      placement.emplace_back(stack, row);
      row += blocks.rows;
      scale.parts.push_back(std::move(blocks));
    }
    int64_t block_rows = 0;
    for (const auto& [stack, rows] : next_block_row) block_rows = std::max(block_rows, rows);
    scale.shape = pending.stacked ? std::vector<int64_t>{experts_per_rank_, block_rows, block_columns}
                                  : std::vector<int64_t>{block_rows, block_columns};
    for (size_t i = 0; i < scale.parts.size(); ++i) {
      auto [stack, row] = placement[i];
      scale.parts[i].element_offset =
          static_cast<uint64_t>(stack * block_rows + row) * static_cast<uint64_t>(block_columns);
    }
    return scale;
  }

  void finish(PendingParameter& pending) {
    Parameter& parameter = pending.parameter;
    int64_t block_rows = 0;
    for (const auto& [expert, rows] : pending.next_row) block_rows = std::max(block_rows, rows);
    int64_t columns = pending.columns;
    if (pending.stacked) {
      parameter.shape = {experts_per_rank_, block_rows, columns};
    } else if (pending.rank <= 1) {
      parameter.shape = {block_rows};
    } else if (pending.rank > 2 && columns == std::accumulate(pending.trailing.begin(), pending.trailing.end(),
                                                               int64_t{1}, std::multiplies<>())) {
      parameter.shape = {block_rows};
      parameter.shape.insert(parameter.shape.end(), pending.trailing.begin(), pending.trailing.end());
    } else {
      parameter.shape = {block_rows, columns};
    }
    for (size_t i = 0; i < parameter.parts.size(); ++i) {
      auto [stack, row] = pending.placement[i];
      parameter.parts[i].element_offset =
          static_cast<uint64_t>(stack * block_rows + row) * static_cast<uint64_t>(columns);
    }
    if (pending.block_quantized.value_or(false)) {
      // Held as the checkpoint ships it: E4M3 codes, and the block scales beside them.
      Parameter scale = block_scale(pending);
      parameter.dtype = Dtype::kF8E4M3;
      parameter.load_dtype = Dtype::kF8E4M3;
      parameter.block_scale = scale.name;
      parameter.scale_block = {block_n_, block_k_};
      layout_.add_parameter(std::move(parameter));
      layout_.add_parameter(std::move(scale));
      return;
    }
    bool quantize = pending.linear && options_.quantize == Processing::kFp8PerTensor;
    if (quantize) {
      parameter.processing = Processing::kFp8PerTensor;
      parameter.load_dtype = parameter.dtype;
      parameter.dtype = Dtype::kF8E4M3;
      parameter.scale = scale_name(parameter.name);
    }
    int64_t layer = parameter.layer;
    std::string scale = parameter.scale;
    layout_.add_parameter(std::move(parameter));
    if (quantize) {
      Parameter scale_parameter;
      scale_parameter.name = scale;
      scale_parameter.dtype = Dtype::kF32;
      scale_parameter.load_dtype = Dtype::kF32;
      scale_parameter.shape = {1};
      scale_parameter.layer = layer;
      layout_.add_parameter(std::move(scale_parameter));
    }
  }

  void add_tied_lm_head() {
    const Parameter& embedding = layout_.parameter("model.embed_tokens.weight");
    Parameter lm_head;
    lm_head.name = "lm_head.weight";
    lm_head.dtype = embedding.dtype;
    lm_head.load_dtype = embedding.dtype;
    lm_head.shape = embedding.shape;
    lm_head.layer = -1;
    layout_.add_parameter(std::move(lm_head));
    // Tied checkpoints may still carry a copy; the hook derives it from the embedding.
    layout_.add_ignore_rule("lm_head.weight");
  }

  const ModelConfig& config_;
  const LayoutOptions& options_;
  LayerScopes scopes_;
  Dimensions dimensions_;
  Dtype dtype_ = Dtype::kBF16;
  bool block_quantized_ = false;
  int64_t block_n_ = 0, block_k_ = 0;
  int64_t experts_ = 0;
  int64_t experts_per_rank_ = 0;
  int64_t first_expert_ = 0;
  ModelLayout layout_;
  std::vector<PendingParameter> pending_;
  std::map<std::string, size_t, std::less<>> pending_index_;
};

}  // namespace

ModelLayout build_model_layout(const ModelConfig& config, const LayoutOptions& options) {
  const Architecture& architecture = architecture_of(config);
  std::vector<MappingRule> rules = architecture.rules(config);
  return LayoutBuilder(architecture, config, options).build(rules);
}

}  // namespace weightstream

// The model hooks weightstream ships: a tied lm_head refreshed from the embedding, and a
// fused K/V buffer derived from every layer's K and V rows. Both write in place.
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {
namespace {

class TiedLmHeadHook final : public ModelHook {
 public:
  TiedLmHeadHook(std::string embedding, std::string lm_head)
      : embedding_name_(std::move(embedding)), lm_head_name_(std::move(lm_head)) {}

  std::string name() const override { return "tied_lm_head"; }

  void attach(ModelLayout& layout) override {
    auto embedding = layout.find(embedding_name_);
    auto lm_head = layout.find(lm_head_name_);
    WS_EXPECT(embedding && lm_head, ErrorCode::kModel,
              "model hook tied_lm_head: " + layout.description() + " lacks parameter " +
                  (embedding ? lm_head_name_ : embedding_name_));
    const Parameter& from = layout.parameters()[*embedding];
    const Parameter& to = layout.parameters()[*lm_head];
    WS_EXPECT(from.dtype == to.dtype && from.shape == to.shape, ErrorCode::kModel,
              "model hook tied_lm_head: " + embedding_name_ + " is " + std::string(dtype_name(from.dtype)) + " " +
                  shape_text(from.shape) + " but " + lm_head_name_ + " is " + std::string(dtype_name(to.dtype)) + " " +
                  shape_text(to.shape));
    WS_EXPECT(to.parts.empty(), ErrorCode::kModel,
              "model hook tied_lm_head: " + lm_head_name_ + " is filled from the checkpoint; the hook would overwrite it");
    embedding_ = *embedding;
    lm_head_ = *lm_head;
  }

  void run(ModelLayout& layout) override {
    const Parameter& from = layout.parameters()[embedding_];
    const Parameter& to = layout.parameters()[lm_head_];
    copy_bytes(to.data, to.device, from.data, from.device, from.bytes());
  }

 private:
  std::string embedding_name_, lm_head_name_;
  size_t embedding_ = 0, lm_head_ = 0;
};

class FusedKvHook final : public ModelHook {
 public:
  FusedKvHook(std::string pattern, std::vector<std::string> part_ids)
      : pattern_(std::move(pattern)), part_ids_(std::move(part_ids)) {}

  std::string name() const override { return "fused_kv"; }

  void attach(ModelLayout& layout) override {
    uint64_t total = 0;
    for (int64_t layer : layout.layers()) {
      if (layer < 0) continue;
      std::string name = pattern_;
      if (auto at = name.find("{layer}"); at != std::string::npos) name.replace(at, 7, std::to_string(layer));
      auto index = layout.find(name);
      if (!index) continue;
      const Parameter& parameter = layout.parameters()[*index];
      uint64_t element = dtype_bits(parameter.dtype) / 8;
      std::vector<Copy> copies;
      for (const std::string& id : part_ids_) {
        for (const ParameterPart& part : parameter.parts) {
          if (part.id != id) continue;
          copies.push_back({*index, part.element_offset * element, part.elements() * element, total});
          total += part.elements() * element;
        }
      }
      if (copies.size() != part_ids_.size()) {
        total = copies.empty() ? total : copies.front().buffer_offset;
        continue;
      }
      copies_.insert(copies_.end(), copies.begin(), copies.end());
    }
    WS_EXPECT(!copies_.empty(), ErrorCode::kModel,
              "model hook fused_kv: no parameter of " + layout.description() + " matching " + pattern_ +
                  " has parts '" + join_ids() + "'");
    bytes_ = total;
    device_ = layout.device();
    buffer_ = layout.allocate_derived(total);
  }

  void run(ModelLayout& layout) override {
    for (const Copy& copy : copies_) {
      const Parameter& parameter = layout.parameters()[copy.parameter];
      copy_bytes(buffer_ + copy.buffer_offset, device_, parameter.data + copy.offset, parameter.device, copy.bytes);
    }
  }

  std::vector<DerivedBuffer> derived_buffers() const override { return {{"fused_kv_buffer", buffer_, device_, bytes_}}; }

 private:
  /// One part's rows, copied to `buffer_offset` of the buffer.
  struct Copy {
    size_t parameter;
    uint64_t offset, bytes;
    uint64_t buffer_offset;
  };
  std::string join_ids() const {
    std::string text;
    for (const std::string& id : part_ids_) text += (text.empty() ? "" : "' and '") + id;
    return text;
  }
  std::string pattern_;
  std::vector<std::string> part_ids_;
  std::vector<Copy> copies_;
  std::byte* buffer_ = nullptr;
  Device device_;
  uint64_t bytes_ = 0;
};

class FunctionHook final : public ModelHook {
 public:
  FunctionHook(std::string name, std::function<void(ModelLayout&)> run, bool rerunnable)
      : name_(std::move(name)), run_(std::move(run)), rerunnable_(rerunnable) {}
  std::string name() const override { return name_; }
  bool rerunnable() const override { return rerunnable_; }
  void run(ModelLayout& layout) override { run_(layout); }

 private:
  std::string name_;
  std::function<void(ModelLayout&)> run_;
  bool rerunnable_;
};

}  // namespace

std::unique_ptr<ModelHook> make_tied_lm_head_hook(std::string embedding, std::string lm_head) {
  return std::make_unique<TiedLmHeadHook>(std::move(embedding), std::move(lm_head));
}

std::unique_ptr<ModelHook> make_fused_kv_hook(std::string qkv_pattern, std::vector<std::string> part_ids) {
  return std::make_unique<FusedKvHook>(std::move(qkv_pattern), std::move(part_ids));
}

std::unique_ptr<ModelHook> make_model_hook(std::string name, std::function<void(ModelLayout&)> run, bool rerunnable) {
  return std::make_unique<FunctionHook>(std::move(name), std::move(run), rerunnable);
}

}  // namespace weightstream

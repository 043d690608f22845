// The Qwen3-Next draft: the MTP module its checkpoint ships under mtp.* (mtp.fc,
// mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.{i}.*, mtp.norm, as vLLM's
// qwen3_next_mtp.py loads them) is a layout of its own, with the Gated DeltaNet and MoE
// rules of the target. Its loads (draft-only, combined, a missing MTP layer) are tested with
// DeepSeek-V3's in test_source_resolution.cpp (DraftLoad).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "resolve/draft_fixtures.hpp"
#include "weightstream/error.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::error_of;

std::set<std::string> wanted(const ModelLayout& layout) {
  std::vector<std::string> names = layout.wanted_tensors();
  return {names.begin(), names.end()};
}

class Qwen3NextDraft : public ::testing::Test, protected testing::SnapshotFixture {
 protected:
  void SetUp() override { make_checkpoint(testing::qwen3_next_options()); }
};

TEST_F(Qwen3NextDraft, TheDraftIsTheMtpModuleUnderItsCheckpointNames) {
  ModelLayout draft = build_module_layout(config(), ModuleRole::kDraft);
  ModelLayout target = build_module_layout(config(), ModuleRole::kTarget);
  Checkpoint checkpoint = Checkpoint::open(weights(), options_);
  std::set<std::string> mtp, others;
  for (const CheckpointTensor& tensor : checkpoint.tensors()) {
    (tensor.name.starts_with("mtp.") ? mtp : others).insert(tensor.name);
  }
  ASSERT_GT(mtp.size(), 10u);
  EXPECT_EQ(wanted(draft), mtp);
  EXPECT_EQ(wanted(target), others);

  for (const char* name : {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                           "mtp.norm.weight", "mtp.layers.0.input_layernorm.weight",
                           "mtp.layers.0.self_attn.qkv_proj.weight", "mtp.layers.0.self_attn.q_norm.weight",
                           "mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.experts.w13_weight",
                           "mtp.layers.0.mlp.shared_expert.gate_up_proj.weight",
                           "mtp.layers.0.mlp.shared_expert_gate.weight"}) {
    auto index = draft.find(name);
    ASSERT_TRUE(index.has_value()) << name;
    EXPECT_EQ(draft.layer_kind(draft.parameters()[*index].layer), LayerKind::kMtp) << name;
    EXPECT_FALSE(target.find(name).has_value()) << name;
  }
  // The gated query (query and output gate per head) is fused with K and V as vLLM's qkv_proj.
  const ModelConfig& c = config();
  EXPECT_EQ(draft.parameter("mtp.layers.0.self_attn.qkv_proj.weight").shape,
            (std::vector<int64_t>{(2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size}));
  EXPECT_EQ(draft.parameter("mtp.fc.weight").shape, (std::vector<int64_t>{c.hidden_size, 2 * c.hidden_size}));
  // No embedding or head of its own: it uses the target's, so there is nothing to share.
  EXPECT_FALSE(draft.find("model.embed_tokens.weight").has_value());
  EXPECT_FALSE(draft.find("lm_head.weight").has_value());
  EXPECT_TRUE(share_target_embeddings(draft, target).empty());

  // Both plans cover the whole checkpoint: no tensor is unmatched, none missing.
  LoadPlan draft_plan = plan_layout_load(draft, checkpoint);
  LoadPlan target_plan = plan_layout_load(target, checkpoint);
  EXPECT_EQ(draft_plan.reads.size(), mtp.size());
  EXPECT_EQ(target_plan.reads.size(), others.size());
  EXPECT_TRUE(draft_plan.missing.empty());
  EXPECT_TRUE(target_plan.missing.empty());
}

TEST_F(Qwen3NextDraft, LayerTypesAndDenseLayersFollowTheConfig) {
  ModelConfig c = config();
  c.layer_types = {"full_attention", "linear_attention", "linear_attention", "full_attention"};
  c.mlp_only_layers = {0};
  ModelLayout layout = build_model_layout(c);
  EXPECT_TRUE(layout.find("model.layers.0.self_attn.qkv_proj.weight").has_value());
  EXPECT_FALSE(layout.find("model.layers.0.linear_attn.in_proj_qkvz.weight").has_value());
  EXPECT_TRUE(layout.find("model.layers.1.linear_attn.in_proj_qkvz.weight").has_value());
  EXPECT_TRUE(layout.find("model.layers.1.linear_attn.A_log").has_value());
  EXPECT_FALSE(layout.find("model.layers.1.self_attn.qkv_proj.weight").has_value());
  EXPECT_TRUE(layout.find("model.layers.0.mlp.gate_up_proj.weight").has_value()) << "a dense layer";
  EXPECT_FALSE(layout.find("model.layers.0.mlp.experts.w13_weight").has_value());
  EXPECT_TRUE(layout.find("model.layers.1.mlp.experts.w13_weight").has_value());
  // vLLM numbers an MTP layer by its own index: mtp.layers.0 is dense like layer 0. MTP
  // layers are the draft's (issue 18): the target holds none.
  EXPECT_FALSE(layout.find("mtp.layers.0.self_attn.qkv_proj.weight").has_value());
  ModelLayout draft = build_module_layout(c, ModuleRole::kDraft);
  EXPECT_TRUE(draft.find("mtp.layers.0.mlp.gate_up_proj.weight").has_value());
  EXPECT_TRUE(draft.find("mtp.layers.0.self_attn.qkv_proj.weight").has_value()) << "MTP layers have full attention";

  c.layer_types[2] = "sliding_attention";
  EXPECT_THAT(error_of([&] { build_model_layout(c); }),
              HasSubstr("qwen3_next: layer_types[2] = 'sliding_attention': expected full_attention or linear_attention"));
  c.layer_types.pop_back();
  EXPECT_THAT(error_of([&] { build_model_layout(c); }),
              HasSubstr("qwen3_next: layer_types has 3 entries for num_hidden_layers = 4"));
}

TEST_F(Qwen3NextDraft, TargetAndDraftDivideAmongTensorParallelRanks) {
  LayoutOptions options;
  options.parallel = {2, 1, 1, 0};
  // The target's Gated DeltaNet layers divide as vLLM divides them: conv1d's q, k and v each.
  ModelLayout target = build_module_layout(config(), ModuleRole::kTarget, options);
  const Parameter& conv = target.parameter("model.layers.0.linear_attn.conv1d.weight");
  int64_t key_dim = config().linear_num_key_heads * config().linear_key_head_dim;
  int64_t value_dim = config().linear_num_value_heads * config().linear_value_head_dim;
  ASSERT_EQ(conv.parts.size(), 3u);
  EXPECT_EQ(conv.parts[0].row_begin, key_dim / 2);
  EXPECT_EQ(conv.parts[1].row_begin, key_dim + key_dim / 2);
  EXPECT_EQ(conv.parts[2].row_begin, 2 * key_dim + value_dim / 2);
  ModelLayout draft = build_module_layout(config(), ModuleRole::kDraft, options);
  EXPECT_EQ(draft.parameter("mtp.fc.weight").shape,
            (std::vector<int64_t>{config().hidden_size / 2, 2 * config().hidden_size}));
  // A tp size that cuts a linear-attention head is refused for the target, not for the
  // draft (its MTP layers have full attention).
  ModelConfig odd = config();
  odd.linear_num_key_heads = 3;
  odd.linear_num_value_heads = 6;
  EXPECT_THAT(error_of([&] { build_module_layout(odd, ModuleRole::kTarget, options); }),
              AllOf(HasSubstr("qwen3_next tp 2: the Gated DeltaNet layers (layer 0 first) have 3 key heads"),
                    HasSubstr("use a tp_size that divides 3")));
  EXPECT_NO_THROW(build_module_layout(odd, ModuleRole::kDraft, options));
}

TEST_F(Qwen3NextDraft, ADraftOfAConfigWithoutMtpLayersIsAnError) {
  ModelConfig c = config();
  c.num_nextn_predict_layers = 0;
  EXPECT_THAT(error_of([&] { build_module_layout(c, ModuleRole::kDraft); }),
              HasSubstr("the qwen3_next config declares no MTP layers (num_nextn_predict_layers is 0 or absent, "
                        "mtp_num_hidden_layers too)"));
}

}  // namespace
}  // namespace weightstream

// Source resolution and the strategy chain on local files: the order model_weights, model,
// checkpoint URI; the reason of every source passed over; one error that lists them all;
// draft-only loads that read only the MTP shards; combined loads that read the checkpoint
// once; storage that never moves; missing MTP layers; the WEIGHTSTREAM_MODEL_URI alias.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <utility>

#include "resolve/draft_fixtures.hpp"
#include "weightstream/error.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::TempDir;

/// The message of the Error that `action` throws; fails the test when it throws none.
template <typename Action>
std::string error_of(Action&& action, ErrorCode* code = nullptr) {
  try {
    action();
  } catch (const Error& error) {
    if (code) *code = error.code();
    return error.what();
  }
  ADD_FAILURE() << "no error thrown";
  return {};
}

class SourceResolutionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    checkpoint_ = testing::synth_checkpoint(testing::deepseek_options());
    snapshot_ = scratch_.path() / "glm-snapshot";
    testing::write_config_only_model(snapshot_, *checkpoint_);
  }
  std::string snapshot() const { return snapshot_.string(); }
  std::string weights() const { return checkpoint_->uri(); }

  std::unique_ptr<testing::SynthCheckpoint> checkpoint_;
  TempDir scratch_;
  std::filesystem::path snapshot_;
  Options options_;
};

TEST_F(SourceResolutionTest, ModelWeightsComeFirst) {
  auto other = testing::synth_checkpoint(testing::deepseek_options(1, 2, 9));
  auto module = testing::module_fixture(ModuleRole::kTarget, {other->uri(), weights()}, "", options_);
  ASSERT_TRUE(module.resolution.found());
  EXPECT_EQ(module.resolution.chosen().field, "model_weights");
  EXPECT_EQ(module.resolution.chosen().uri, weights());
  EXPECT_EQ(module.resolution.candidates.size(), 1u);
}

TEST_F(SourceResolutionTest, ModelWhenWeightsAreNotSet) {
  auto module = testing::module_fixture(ModuleRole::kTarget, {weights(), ""}, "", options_);
  ASSERT_TRUE(module.resolution.found());
  EXPECT_EQ(module.resolution.chosen().field, "model");
  ASSERT_EQ(module.resolution.candidates.size(), 2u);
  EXPECT_EQ(module.resolution.candidates[0].text(), "model_weights: not set");
}

TEST_F(SourceResolutionTest, CheckpointUriWhenModelHoldsOnlyConfig) {
  // The known failure: the draft's model is a local snapshot of config and tokenizer files,
  // its model_weights are empty, and only the checkpoint URI holds the MTP layers.
  auto module = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_);
  ASSERT_TRUE(module.resolution.found()) << module.resolution.error_text();
  EXPECT_EQ(module.resolution.chosen().field, "WEIGHTSTREAM_MODEL_URI");
  EXPECT_EQ(module.resolution.chosen().uri, weights());
  ASSERT_EQ(module.resolution.candidates.size(), 3u);
  EXPECT_EQ(module.resolution.candidates[0].text(), "model_weights: not set");
  EXPECT_EQ(module.resolution.candidates[1].text(), "model " + snapshot() + ": no *.safetensors files");
  // The chosen source names the shards that hold the draft's tensors, per the index.
  Checkpoint checkpoint = Checkpoint::open(weights(), options_);
  auto footprint = testing::mtp_footprint(checkpoint, checkpoint_model_config(checkpoint));
  std::vector<std::string> expected(footprint.shards.begin(), footprint.shards.end());
  EXPECT_EQ(module.resolution.chosen().shards, expected);
}

TEST_F(SourceResolutionTest, PassesOverASourceWithoutTheDraftsTensors) {
  // Weights of the same model without MTP layers: a checkpoint, but not one the draft can use.
  auto stripped = testing::synth_checkpoint(testing::deepseek_options(0));
  auto module = testing::module_fixture(ModuleRole::kDraft, {snapshot(), stripped->uri()}, weights(), options_);
  ASSERT_TRUE(module.resolution.found());
  EXPECT_EQ(module.resolution.candidates[0].text(),
            "model_weights " + stripped->uri() + ": no tensor the draft wants (per its index)");
  EXPECT_EQ(module.resolution.chosen().field, "WEIGHTSTREAM_MODEL_URI");
}

TEST_F(SourceResolutionTest, ASourceThatCannotBeOpenedIsPassedOverWithItsError) {
  std::string absent = (scratch_.path() / "absent").string();
  auto module = testing::module_fixture(ModuleRole::kTarget, {snapshot(), absent}, weights(), options_);
  ASSERT_TRUE(module.resolution.found());
  EXPECT_THAT(module.resolution.candidates[0].text(),
              AllOf(HasSubstr("model_weights " + absent + ": cannot open: "), HasSubstr("does not exist")));
}

TEST_F(SourceResolutionTest, OneErrorListsEverySourceWithItsReason) {
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, "", options_);
  ASSERT_FALSE(draft.resolution.found());
  std::string expected = "Cannot find any safetensors model weights for the draft (mtp): model_weights: not set; model " +
                         snapshot() + ": no *.safetensors files; WEIGHTSTREAM_MODEL_URI: not set";
  EXPECT_EQ(draft.resolution.error_text(), expected);
  // A load reports the same, before touching any parameter, and the target's failure with it.
  auto target = testing::module_fixture(ModuleRole::kTarget, {snapshot(), ""}, "", options_);
  std::vector<ModuleLoadRequest> requests = {target.request(), draft.request()};
  ErrorCode code{};
  std::string message = error_of([&] { load_modules(requests, LoadMode::kCold, options_); }, &code);
  EXPECT_EQ(code, ErrorCode::kNotFound);
  EXPECT_THAT(message, AllOf(HasSubstr("Cannot find any safetensors model weights for the target: "),
                             HasSubstr("for the draft (mtp): "), HasSubstr("model_weights: not set"),
                             HasSubstr("model " + snapshot() + ": no *.safetensors files"),
                             HasSubstr("WEIGHTSTREAM_MODEL_URI: not set")));
  EXPECT_EQ(target.layout.loads_finished(), 0u);
  EXPECT_EQ(draft.layout.loads_finished(), 0u);
}

TEST_F(SourceResolutionTest, ConfigComesFromTheModelDirectory) {
  ModelConfigSource config = find_model_config({snapshot(), ""}, "", options_);
  EXPECT_EQ(config.field, "model");
  EXPECT_EQ(config.config.num_nextn_predict_layers, 1);
  std::string message = error_of([&] { find_model_config({"", ""}, "", options_); });
  EXPECT_THAT(message, AllOf(HasSubstr("config.json"), HasSubstr("model: not set"), HasSubstr("model_weights: not set"),
                             HasSubstr("WEIGHTSTREAM_MODEL_URI: not set")));
}

TEST_F(SourceResolutionTest, DraftOfAModelWithoutMtpLayersIsAnError) {
  auto stripped = testing::synth_checkpoint(testing::deepseek_options(0));
  std::string message = error_of([&] {
    build_module_layout(find_model_config({stripped->uri(), ""}, "", options_).config, ModuleRole::kDraft);
  });
  EXPECT_THAT(message, AllOf(HasSubstr("mtp"), HasSubstr("num_nextn_predict_layers is 0")));
}

TEST(ModelUriAlias, MxModelUriIsAnAliasAndDisagreementIsAnError) {
  EXPECT_EQ(options_from_environment({{"MX_MODEL_URI", "s3://bucket/model"}}).model_uri, "s3://bucket/model");
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_MODEL_URI", "s3://bucket/model"}}).model_uri, "s3://bucket/model");
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_MODEL_URI", "s3://b/m"}, {"MX_MODEL_URI", "s3://b/m"}}).model_uri,
            "s3://b/m");
  ErrorCode code{};
  std::string message = error_of(
      [] { options_from_environment({{"WEIGHTSTREAM_MODEL_URI", "s3://bucket/a"}, {"MX_MODEL_URI", "s3://bucket/b"}}); },
      &code);
  EXPECT_EQ(code, ErrorCode::kConfig);
  EXPECT_THAT(message, AllOf(HasSubstr("WEIGHTSTREAM_MODEL_URI='s3://bucket/a'"), HasSubstr("MX_MODEL_URI='s3://bucket/b'"),
                             HasSubstr("disagree")));
}

// ---- loads ------------------------------------------------------------------------------

TEST_F(SourceResolutionTest, DraftOnlyLoadReadsOnlyTheShardsAndBytesOfTheDraft) {
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_);
  std::vector<ModuleLoadRequest> requests = {draft.request()};
  std::vector<StrategyLoad> loads = load_modules(requests, LoadMode::kCold, options_);

  Checkpoint checkpoint = Checkpoint::open(weights(), options_);
  auto footprint = testing::mtp_footprint(checkpoint, checkpoint_model_config(checkpoint));
  ASSERT_LT(footprint.shards.size(), checkpoint.shards().size()) << "the fixture must put MTP layers in some shards only";
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_EQ(loads[0].strategy, "local files");
  EXPECT_EQ(loads[0].stream.bytes_read, footprint.bytes);
  EXPECT_EQ(loads[0].stream.shards_read, footprint.shards.size());
  ASSERT_EQ(loads[0].modules.size(), 1u);
  const ModuleLoad& module = loads[0].modules[0];
  EXPECT_EQ(module.role, ModuleRole::kDraft);
  EXPECT_EQ(module.field, "WEIGHTSTREAM_MODEL_URI");
  EXPECT_EQ(module.tensors, footprint.tensors);
  EXPECT_EQ(module.bytes_read, footprint.bytes);
  EXPECT_EQ(module.shards_read, footprint.shards.size());
  // Not even the headers of the target's shards were read.
  EXPECT_EQ(module.shards_opened, footprint.shards.size());

  ModelLayout reference = testing::reference_layout(checkpoint, ModuleRole::kDraft);
  EXPECT_EQ(compare_layouts(draft.layout, reference).mismatched, 0u);
}

TEST_F(SourceResolutionTest, CombinedLoadReadsTheCheckpointOnceAndRoutesEachTensor) {
  auto target = testing::module_fixture(ModuleRole::kTarget, {snapshot(), weights()}, weights(), options_);
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_);
  std::vector<ModuleLoadRequest> requests = {target.request(), draft.request()};
  std::vector<StrategyLoad> loads = load_modules(requests, LoadMode::kCold, options_);

  Checkpoint checkpoint = Checkpoint::open(weights(), options_);
  auto footprint = testing::mtp_footprint(checkpoint, checkpoint_model_config(checkpoint));
  ASSERT_EQ(loads.size(), 1u) << "one source, one stream";
  EXPECT_EQ(loads[0].stream.bytes_read, checkpoint.tensor_bytes());
  EXPECT_EQ(loads[0].stream.tensors, checkpoint.tensors().size());
  ASSERT_EQ(loads[0].modules.size(), 2u);
  EXPECT_EQ(loads[0].modules[0].bytes_read + loads[0].modules[1].bytes_read, checkpoint.tensor_bytes());
  EXPECT_EQ(loads[0].modules[1].bytes_read, footprint.bytes);
  EXPECT_EQ(loads[0].modules[1].shards_read, footprint.shards.size());

  EXPECT_EQ(compare_layouts(target.layout, testing::reference_layout(checkpoint, ModuleRole::kTarget)).mismatched, 0u);
  EXPECT_EQ(compare_layouts(draft.layout, testing::reference_layout(checkpoint, ModuleRole::kDraft)).mismatched, 0u);
}

TEST_F(SourceResolutionTest, ReloadWritesInPlaceIntoTheSameStorage) {
  auto target = testing::module_fixture(ModuleRole::kTarget, {snapshot(), weights()}, weights(), options_);
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_);
  std::vector<ModuleLoadRequest> requests = {target.request(), draft.request()};
  load_modules(requests, LoadMode::kCold, options_);
  auto target_addresses = storage_addresses(target.layout);
  auto draft_addresses = storage_addresses(draft.layout);

  // New weights of the same model: the reload lands in the storage the engine already holds.
  auto updated = testing::synth_checkpoint(testing::deepseek_options(1, 4, 77));
  auto target_update = testing::module_fixture(ModuleRole::kTarget, {snapshot(), updated->uri()}, "", options_, false);
  auto draft_update = testing::module_fixture(ModuleRole::kDraft, {snapshot(), updated->uri()}, "", options_, false);
  std::vector<ModuleLoadRequest> reload = {{ModuleRole::kTarget, &target.layout, target_update.resolution},
                                           {ModuleRole::kDraft, &draft.layout, draft_update.resolution}};
  load_modules(reload, LoadMode::kReload, options_);
  EXPECT_EQ(storage_addresses(target.layout), target_addresses);
  EXPECT_EQ(storage_addresses(draft.layout), draft_addresses);
  EXPECT_EQ(draft.layout.loads_finished(), 2u);
  Checkpoint checkpoint = Checkpoint::open(updated->uri(), options_);
  EXPECT_EQ(compare_layouts(target.layout, testing::reference_layout(checkpoint, ModuleRole::kTarget)).mismatched, 0u);
  EXPECT_EQ(compare_layouts(draft.layout, testing::reference_layout(checkpoint, ModuleRole::kDraft)).mismatched, 0u);
}

TEST_F(SourceResolutionTest, MissingMtpLayerFailsAColdLoadNamingItAndIsAllowedInAnUpdate) {
  // The model declares two MTP layers; these weights hold only the first.
  auto two = testing::synth_checkpoint(testing::deepseek_options(2));
  auto one = testing::synth_checkpoint(testing::deepseek_options(1, 4, 8));
  std::filesystem::path model = scratch_.path() / "two-mtp";
  testing::write_config_only_model(model, *two);
  auto draft = testing::module_fixture(ModuleRole::kDraft, {model.string(), one->uri()}, "", options_);
  ASSERT_TRUE(draft.resolution.found());
  std::vector<ModuleLoadRequest> requests = {draft.request()};
  auto before = parameter_bytes(draft.layout.parameter("model.layers.2.eh_proj.weight"));
  std::string message = error_of([&] { load_modules(requests, LoadMode::kCold, options_); });
  EXPECT_THAT(message, AllOf(HasSubstr("cold load of the draft (mtp)"), HasSubstr("MTP layer 3 is missing from"),
                             HasSubstr("model.layers.3."), Not(HasSubstr("MTP layer 2 is missing"))));
  // Checked before any byte was written.
  EXPECT_EQ(parameter_bytes(draft.layout.parameter("model.layers.2.eh_proj.weight")), before);
  EXPECT_EQ(draft.layout.loads_finished(), 0u);

  // After a complete cold load, an update may carry the first MTP layer only.
  auto complete = testing::module_fixture(ModuleRole::kDraft, {model.string(), two->uri()}, "", options_, false);
  std::vector<ModuleLoadRequest> cold = {{ModuleRole::kDraft, &draft.layout, complete.resolution}};
  load_modules(cold, LoadMode::kCold, options_);
  auto layer3 = parameter_bytes(draft.layout.parameter("model.layers.3.eh_proj.weight"));
  load_modules(requests, LoadMode::kUpdate, options_);
  EXPECT_EQ(parameter_bytes(draft.layout.parameter("model.layers.3.eh_proj.weight")), layer3);
  Checkpoint partial = Checkpoint::open(one->uri(), options_);
  const CheckpointTensor& eh_proj = partial.tensors()[*partial.find("model.layers.2.eh_proj.weight")];
  std::string file = testing::read_file(one->directory.path() / partial.shards()[eh_proj.shard].name);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(
                            parameter_bytes(draft.layout.parameter("model.layers.2.eh_proj.weight")).data()),
                        eh_proj.bytes),
            file.substr(eh_proj.offset, eh_proj.bytes));
}

TEST_F(SourceResolutionTest, DraftSharesTheTargetsEmbeddingAndHeadByReference) {
  auto target = testing::module_fixture(ModuleRole::kTarget, {snapshot(), weights()}, weights(), options_);
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_, false);
  std::vector<std::string> shared = share_target_embeddings(draft.layout, target.layout);
  EXPECT_THAT(shared, ElementsAre("model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"));
  draft.layout.allocate(Device{});
  EXPECT_EQ(draft.layout.parameter("model.layers.2.embed_tokens.weight").data,
            target.layout.parameter("model.embed_tokens.weight").data);
  EXPECT_EQ(draft.layout.parameter("model.layers.2.shared_head.head.weight").data,
            target.layout.parameter("lm_head.weight").data);

  std::vector<ModuleLoadRequest> requests = {target.request(), draft.request()};
  std::vector<StrategyLoad> loads = load_modules(requests, LoadMode::kCold, options_);
  Checkpoint checkpoint = Checkpoint::open(weights(), options_);
  uint64_t copies = 0;  // the checkpoint's copies in the MTP layer, which the draft no longer reads
  for (const char* name : {"model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}) {
    copies += checkpoint.tensors()[*checkpoint.find(name)].bytes;
  }
  EXPECT_EQ(loads[0].stream.bytes_read, checkpoint.tensor_bytes() - copies);
  EXPECT_EQ(compare_layouts(target.layout, testing::reference_layout(checkpoint, ModuleRole::kTarget)).mismatched, 0u);
}

TEST_F(SourceResolutionTest, AFailureAfterTheFirstWriteNamesTheParametersWritten) {
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_);
  Checkpoint checkpoint = Checkpoint::open(weights(), options_);
  auto footprint = testing::mtp_footprint(checkpoint, checkpoint_model_config(checkpoint));
  ASSERT_GE(footprint.shards.size(), 2u);
  std::filesystem::path last = checkpoint_->directory.path() / *footprint.shards.rbegin();
  std::string contents = testing::read_file(last);
  // One reader in file order: the first MTP shard's bytes land, then the last shard is cut
  // short under the open checkpoint, so its reads fail midway through the load.
  Options options = options_;
  options.stream.concurrency = 1;
  options.stream.chunk_bytes = 4096;
  options.stream.memory_limit = 64 * 1024;
  bool cut = false;
  auto cut_last_shard = [&](uint64_t, uint64_t) {
    if (!std::exchange(cut, true)) std::filesystem::resize_file(last, 16);
  };
  std::vector<ModuleLoadRequest> requests = {draft.request()};
  std::string message =
      error_of([&] { load_modules(requests, LoadMode::kCold, options, StrategyChain::standard(), cut_last_shard); });
  testing::write_file(last, contents);
  RecordProperty("error", message);
  EXPECT_TRUE(cut);
  EXPECT_THAT(message, AllOf(HasSubstr("local files: "), HasSubstr(last.filename().string()),
                             HasSubstr("parameters written before the failure, to reload: draft ("),
                             HasSubstr("model.layers.2.")));
  EXPECT_EQ(draft.layout.loads_finished(), 0u);
}

/// A strategy that is always available and always fails, to show the chain keeps going and
/// the error keeps every cause.
class FailingStrategy final : public LoadStrategy {
 public:
  std::string name() const override { return "live peer"; }
  StrategyAvailability available(const LoadContext&) const override { return {true, {}}; }
  StrategyLoad load(LoadContext&) override { WS_FAIL(ErrorCode::kNetwork, "peer 10.0.0.7:5555 refused the connection"); }
};

TEST_F(SourceResolutionTest, ChainFallsThroughAFailedStrategy) {
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_);
  StrategyChain chain = StrategyChain::standard();
  chain.insert_front(std::make_unique<FailingStrategy>());
  std::vector<ModuleLoadRequest> requests = {draft.request()};
  std::vector<StrategyLoad> loads = load_modules(requests, LoadMode::kCold, options_, chain);
  EXPECT_EQ(loads[0].strategy, "local files");
}

TEST_F(SourceResolutionTest, WhenEveryStrategyFailsOneErrorListsEachWithItsReason) {
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_);
  StrategyChain chain;
  chain.add(std::make_unique<FailingStrategy>());
  chain.add(make_object_storage_strategy());
  std::vector<ModuleLoadRequest> requests = {draft.request()};
  ErrorCode code{};
  std::string message = error_of([&] { load_modules(requests, LoadMode::kCold, options_, chain); }, &code);
  EXPECT_EQ(code, ErrorCode::kNetwork);
  EXPECT_THAT(message,
              AllOf(HasSubstr("Cannot load the draft (mtp) from " + weights()),
                    HasSubstr("model_weights: not set"), HasSubstr("model " + snapshot() + ": no *.safetensors files"),
                    HasSubstr("WEIGHTSTREAM_MODEL_URI " + weights() + ": chosen"),
                    HasSubstr("live peer: peer 10.0.0.7:5555 refused the connection"),
                    HasSubstr("object storage: " + weights() + " is not an s3:// or http(s):// URI")));
}

TEST_F(SourceResolutionTest, AShardBrokenAfterResolutionFailsBeforeAnyWrite) {
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_);
  // The last MTP shard is truncated between resolution and load.
  Checkpoint checkpoint = Checkpoint::open(weights(), options_);
  auto footprint = testing::mtp_footprint(checkpoint, checkpoint_model_config(checkpoint));
  std::filesystem::path last = checkpoint_->directory.path() / *footprint.shards.rbegin();
  std::string contents = testing::read_file(last);
  std::filesystem::resize_file(last, contents.size() / 2);
  std::vector<ModuleLoadRequest> requests = {draft.request()};
  std::string message = error_of([&] { load_modules(requests, LoadMode::kCold, options_); });
  // The truncated shard fails when it is opened, before any session begins: nothing written.
  EXPECT_THAT(message, AllOf(HasSubstr("local files: "), HasSubstr(last.filename().string())));
  EXPECT_EQ(draft.layout.loads_finished(), 0u);
  testing::write_file(last, contents);
}

}  // namespace
}  // namespace weightstream

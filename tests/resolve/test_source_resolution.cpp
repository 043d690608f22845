// Source resolution and the strategy chain on local files: the order model_weights, model,
// checkpoint URI; the reason of every source passed over; one error that lists them all;
// draft-only loads that read only the MTP shards; combined loads that read the checkpoint
// once; storage that never moves; missing MTP layers; the WEIGHTSTREAM_MODEL_URI alias and
// the label of the checkpoint URI; shard headers of a source without an index read once.
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
using testing::error_of;
using testing::TempDir;

class SourceResolutionTest : public ::testing::Test, protected testing::SnapshotFixture {
 protected:
  void SetUp() override { make_checkpoint(testing::deepseek_options()); }
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
  ModelConfigSource config = find_model_config({snapshot(), ""}, options_);
  EXPECT_EQ(config.field, "model");
  EXPECT_EQ(config.config.num_nextn_predict_layers, 1);
  std::string message = error_of([&] { find_model_config({"", ""}, options_); });
  EXPECT_THAT(message, AllOf(HasSubstr("config.json"), HasSubstr("model: not set"), HasSubstr("model_weights: not set"),
                             HasSubstr("WEIGHTSTREAM_MODEL_URI: not set")));
}

TEST_F(SourceResolutionTest, DraftOfAModelWithoutMtpLayersIsAnError) {
  auto stripped = testing::synth_checkpoint(testing::deepseek_options(0));
  std::string message = error_of([&] {
    build_module_layout(find_model_config({stripped->uri(), ""}, options_).config, ModuleRole::kDraft);
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

TEST_F(SourceResolutionTest, TheCheckpointUriIsNamedWhereItCameFrom) {
  ModelConfigSource config = find_model_config({snapshot(), ""}, options_);
  ModelLayout layout = build_module_layout(config.config, ModuleRole::kDraft);
  // MX_MODEL_URI at a directory without weights: the error names MX_MODEL_URI, not its alias.
  Options mx = testing::with_checkpoint_uri(options_, snapshot(), "MX_MODEL_URI");
  SourceResolution failed = resolve_source({snapshot(), ""}, ModuleRole::kDraft, layout, mx, "mtp");
  ASSERT_FALSE(failed.found());
  EXPECT_EQ(failed.error_text(), "Cannot find any safetensors model weights for the draft (mtp): model_weights: not set; "
                                 "model " + snapshot() + ": no *.safetensors files; MX_MODEL_URI " + snapshot() +
                                     ": no *.safetensors files");
  std::vector<ModuleLoadRequest> requests = {{ModuleRole::kDraft, &layout, failed}};
  EXPECT_THAT(error_of([&] { load_modules(requests, LoadMode::kCold, mx); }),
              AllOf(HasSubstr("MX_MODEL_URI " + snapshot() + ": no *.safetensors files"),
                    Not(HasSubstr("WEIGHTSTREAM_MODEL_URI"))));

  // Chosen through the alias, the resolution and the load say so.
  layout.allocate(Device{});
  SourceResolution chosen = resolve_source({snapshot(), ""}, ModuleRole::kDraft, layout,
                                           testing::with_checkpoint_uri(options_, weights(), "MX_MODEL_URI"), "mtp");
  EXPECT_EQ(chosen.chosen().text(), "MX_MODEL_URI " + weights() + ": chosen");
  requests = {{ModuleRole::kDraft, &layout, chosen}};
  EXPECT_EQ(load_modules(requests, LoadMode::kCold, options_)[0].modules[0].field, "MX_MODEL_URI");

  // Set by the caller, it is the option; not set at all, the variable to set is named.
  Options option = options_;
  option.model_uri = weights();
  EXPECT_EQ(resolve_source({snapshot(), ""}, ModuleRole::kDraft, layout, option, "mtp").chosen().field,
            "model_uri option");
  EXPECT_EQ(resolve_source({snapshot(), ""}, ModuleRole::kDraft, layout, options_, "mtp").candidates.back().text(),
            "WEIGHTSTREAM_MODEL_URI: not set");
}

// ---- loads, for each architecture whose checkpoint ships MTP layers -----------------------

class DraftLoad : public ::testing::TestWithParam<testing::MtpArchitecture>, protected testing::SnapshotFixture {
 protected:
  void SetUp() override { make_checkpoint(GetParam().options(1, 4, 5)); }
};

TEST_P(DraftLoad, DraftOnlyLoadReadsOnlyTheShardsAndBytesOfTheDraft) {
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, weights(), options_);
  std::vector<ModuleLoadRequest> requests = {draft.request()};
  std::vector<StrategyLoad> loads = load_modules(requests, LoadMode::kCold, options_);

  Checkpoint checkpoint = Checkpoint::open(weights(), options_);
  auto footprint = testing::mtp_footprint(checkpoint, checkpoint_model_config(checkpoint));
  ASSERT_LT(footprint.shards.size(), checkpoint.shards().size()) << "the fixture must put MTP layers in some shards only";
  EXPECT_EQ(std::vector<std::string>(footprint.shards.begin(), footprint.shards.end()), draft.resolution.chosen().shards);
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

TEST_P(DraftLoad, CombinedLoadReadsTheCheckpointOnceAndRoutesEachTensor) {
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

TEST_P(DraftLoad, MissingMtpLayerFailsAColdLoadNamingItAndIsAllowedInAnUpdate) {
  // The model declares two MTP layers; these weights hold only the first.
  const testing::MtpArchitecture& arch = GetParam();
  auto two = testing::synth_checkpoint(arch.options(2, 4, 5));
  auto one = testing::synth_checkpoint(arch.options(1, 4, 8));
  std::filesystem::path model = scratch_.path() / "two-mtp";
  testing::write_config_only_model(model, *two);
  auto draft = testing::module_fixture(ModuleRole::kDraft, {model.string(), one->uri()}, "", options_);
  ASSERT_TRUE(draft.resolution.found());
  std::vector<ModuleLoadRequest> requests = {draft.request()};
  auto before = parameter_bytes(draft.layout.parameter(arch.first_layer_tensor));
  std::string message = error_of([&] { load_modules(requests, LoadMode::kCold, options_); });
  EXPECT_THAT(message, AllOf(HasSubstr("cold load of the draft (mtp)"),
                             HasSubstr(arch.second_layer_label + " is missing from"), HasSubstr(arch.second_layer_prefix),
                             Not(HasSubstr(arch.first_layer_label + " is missing"))));
  // Checked before any byte was written.
  EXPECT_EQ(parameter_bytes(draft.layout.parameter(arch.first_layer_tensor)), before);
  EXPECT_EQ(draft.layout.loads_finished(), 0u);

  // After a complete cold load, an update may carry the first MTP layer only.
  auto complete = testing::module_fixture(ModuleRole::kDraft, {model.string(), two->uri()}, "", options_, false);
  std::vector<ModuleLoadRequest> cold = {{ModuleRole::kDraft, &draft.layout, complete.resolution}};
  load_modules(cold, LoadMode::kCold, options_);
  auto second_layer = parameter_bytes(draft.layout.parameter(arch.second_layer_parameter));
  load_modules(requests, LoadMode::kUpdate, options_);
  EXPECT_EQ(parameter_bytes(draft.layout.parameter(arch.second_layer_parameter)), second_layer);
  Checkpoint partial = Checkpoint::open(one->uri(), options_);
  const CheckpointTensor& tensor = partial.tensors()[*partial.find(arch.first_layer_tensor)];
  std::string file = testing::read_file(one->directory.path() / partial.shards()[tensor.shard].name);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(
                            parameter_bytes(draft.layout.parameter(arch.first_layer_tensor)).data()),
                        tensor.bytes),
            file.substr(tensor.offset, tensor.bytes));
}

INSTANTIATE_TEST_SUITE_P(MtpArchitectures, DraftLoad, ::testing::ValuesIn(testing::mtp_architectures()),
                         [](const auto& info) { return info.param.name; });

// ---- loads ------------------------------------------------------------------------------

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

/// Makes every shard header of `directory` unparseable (the JSON replaced by '!'), keeping
/// its length and the tensor data where they were: a later Checkpoint::open fails on them.
void break_shard_headers(const std::filesystem::path& directory) {
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::string file = testing::read_file(entry.path());
    uint64_t length = 0;
    for (int byte = 7; byte >= 0; --byte) length = length << 8 | static_cast<unsigned char>(file[byte]);
    file.replace(8, length, length, '!');
    testing::write_file(entry.path(), file);
  }
}

TEST_F(SourceResolutionTest, ASourceWithoutAnIndexHasItsShardHeadersReadOnce) {
  std::filesystem::remove(checkpoint_->directory.path() / std::string(kIndexFileName));
  Checkpoint checkpoint = Checkpoint::open(weights(), options_);  // the reference, before the headers break
  ModelLayout target_reference = testing::reference_layout(checkpoint, ModuleRole::kTarget);
  ModelLayout draft_reference = testing::reference_layout(checkpoint, ModuleRole::kDraft);

  // Without an index only the headers say which tensors a shard holds: resolving the target
  // opens the checkpoint, and the draft's resolution takes that one instead of opening it again.
  Options options = testing::with_checkpoint_uri(options_, weights());
  ModelConfig config = find_model_config({snapshot(), ""}, options).config;
  ModelLayout target = build_module_layout(config, ModuleRole::kTarget);
  ModelLayout draft = build_module_layout(config, ModuleRole::kDraft);
  target.allocate(Device{});
  draft.allocate(Device{});
  SourceResolution target_source = resolve_source({snapshot(), ""}, ModuleRole::kTarget, target, options);
  SourceResolution draft_source = resolve_source({snapshot(), ""}, ModuleRole::kDraft, draft, options, "mtp", {target_source});
  ASSERT_TRUE(target_source.found() && draft_source.found());
  ASSERT_NE(target_source.chosen().checkpoint, nullptr);
  EXPECT_EQ(target_source.chosen().checkpoint->shards().size(), checkpoint.shards().size());
  EXPECT_EQ(draft_source.chosen().checkpoint, target_source.chosen().checkpoint) << "opened once for both modules";

  // The load takes the opened checkpoint: no header is read again, and none could be.
  break_shard_headers(checkpoint_->directory.path());
  EXPECT_THROW(Checkpoint::open(weights(), options_), Error);
  std::vector<ModuleLoadRequest> requests = {{ModuleRole::kTarget, &target, target_source},
                                             {ModuleRole::kDraft, &draft, draft_source}};
  std::vector<StrategyLoad> loads = load_modules(requests, LoadMode::kCold, options);
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_EQ(loads[0].modules[0].shards_opened, 0u);
  EXPECT_EQ(loads[0].modules[1].shards_opened, 0u);
  EXPECT_EQ(loads[0].stream.bytes_read, checkpoint.tensor_bytes()) << "and every tensor byte once";
  EXPECT_EQ(compare_layouts(target, target_reference).mismatched, 0u);
  EXPECT_EQ(compare_layouts(draft, draft_reference).mismatched, 0u);
}

TEST_F(SourceResolutionTest, ProbingByHeadersKeepsTheOpenedCheckpointOfAnIndexedSource) {
  Options options = testing::with_checkpoint_uri(options_, weights());
  ModelConfig config = find_model_config({snapshot(), ""}, options).config;
  ModelLayout target = build_module_layout(config, ModuleRole::kTarget);
  // By the index (the default) no shard header is read: nothing to hand to the load.
  SourceResolution by_index = resolve_source({snapshot(), ""}, ModuleRole::kTarget, target, options);
  ASSERT_TRUE(by_index.found()) << by_index.error_text();
  EXPECT_EQ(by_index.chosen().checkpoint, nullptr);
  // By the headers the checkpoint is opened once, for the load (an engine's loader), and
  // tells the same shards.
  SourceResolution by_headers =
      resolve_source({snapshot(), ""}, ModuleRole::kTarget, target, options, "", {}, SourceProbe::kHeaders);
  ASSERT_TRUE(by_headers.found()) << by_headers.error_text();
  ASSERT_NE(by_headers.chosen().checkpoint, nullptr);
  EXPECT_EQ(by_headers.chosen().shards, by_index.chosen().shards);
  Checkpoint reference = Checkpoint::open(weights(), options_);
  EXPECT_EQ(by_headers.chosen().checkpoint->tensors().size(), reference.tensors().size());
  EXPECT_TRUE(by_headers.chosen().checkpoint->index().has_value()) << "the index is read with the headers";
  EXPECT_EQ(by_headers.candidates[1].text(), "model " + snapshot() + ": no *.safetensors files");
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
                    HasSubstr("object storage: " + weights() + " is not an s3://, gs:// or az:// URI")));
}

TEST(ObjectStorageStrategy, RefusesHttpUrlsUpFrontNamingTheFix) {
  auto strategy = make_object_storage_strategy();
  LoadContext context;
  context.uri = "https://models.example.com/llama";
  StrategyAvailability availability = strategy->available(context);
  EXPECT_FALSE(availability.available);
  EXPECT_THAT(availability.reason, AllOf(HasSubstr("https://models.example.com/llama"),
                                         HasSubstr("http(s) checkpoints are not supported yet"),
                                         HasSubstr("use s3:// with an endpoint")));
  context.uri = "s3://bucket/llama";
  EXPECT_TRUE(strategy->available(context).available);
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

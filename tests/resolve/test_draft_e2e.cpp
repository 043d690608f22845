// The known failure, end to end against the S3 server of the test run (moto): an engine
// streams the target from s3://bucket/model (model_weights), and builds its MTP draft with
// model=<local snapshot of config and tokenizer files> and no model_weights. The draft must
// come from the checkpoint URI (WEIGHTSTREAM_MODEL_URI, or its alias MX_MODEL_URI), read
// only the shards that hold MTP layers, and load clean; without the checkpoint URI the
// command fails with one error naming every source it tried.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "resolve/draft_fixtures.hpp"
#include "storage/test_s3_fixture.hpp"
#include "weightstream/error.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::ScopedEnv;
using testing::TempDir;

class DraftEndToEnd : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    WS_REQUIRE_S3_SERVER();
    endpoint_ = *testing::s3_test_endpoint();
    s3_options_ = testing::s3_test_options(endpoint_);
    checkpoint_ = testing::synth_checkpoint(testing::deepseek_options());
    bucket_ = testing::unique_bucket("draft");
    s3::S3Client client(s3_options_);
    client.create_bucket(bucket_);
    for (const std::string& file : checkpoint_->result.files) {
      client.put_object(bucket_, "model/" + std::filesystem::path(file).filename().string(), testing::read_file(file));
    }
    uri_ = "s3://" + bucket_ + "/model";
    snapshot_ = scratch_.path() / "snapshot";
    testing::write_config_only_model(snapshot_, *checkpoint_);
    local_ = Checkpoint::open(checkpoint_->uri(), Options{});
    footprint_ = testing::mtp_footprint(*local_, checkpoint_model_config(*local_));
    ASSERT_LT(footprint_.shards.size(), local_->shards().size());
    // The command under test reaches the server through the ordinary AWS variables.
    environment_.push_back(std::make_unique<ScopedEnv>("AWS_ENDPOINT_URL_S3", endpoint_));
    environment_.push_back(std::make_unique<ScopedEnv>("AWS_ACCESS_KEY_ID", s3_options_.access_key_id));
    environment_.push_back(std::make_unique<ScopedEnv>("AWS_SECRET_ACCESS_KEY", s3_options_.secret_access_key));
    environment_.push_back(std::make_unique<ScopedEnv>("AWS_REGION", "us-east-1"));
    for (const char* name : {"WEIGHTSTREAM_MODEL_URI", "MX_MODEL_URI", "AWS_PROFILE", "AWS_SESSION_TOKEN"}) {
      environment_.push_back(std::make_unique<ScopedEnv>(name, std::nullopt));
    }
  }

  /// The checkpoint URI variable this run sets (WEIGHTSTREAM_MODEL_URI or its alias).
  std::unique_ptr<ScopedEnv> set_checkpoint_uri() { return std::make_unique<ScopedEnv>(GetParam(), uri_); }

  std::string snapshot() const { return snapshot_.string(); }

  std::string endpoint_;
  S3Options s3_options_;
  std::unique_ptr<testing::SynthCheckpoint> checkpoint_;
  std::string bucket_;
  std::string uri_;
  TempDir scratch_;
  std::filesystem::path snapshot_;
  std::optional<Checkpoint> local_;
  testing::MtpFootprint footprint_;
  std::vector<std::unique_ptr<ScopedEnv>> environment_;
};

TEST_P(DraftEndToEnd, TargetAndDraftLoadFromTheCheckpointUri) {
  auto variable = set_checkpoint_uri();
  auto result = testing::run_cli({"load", "--model", snapshot(), "--model-weights", uri_, "--speculative", "mtp",
                                  "--json", "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto report = nlohmann::json::parse(result.out);
  EXPECT_EQ(report["target"]["source"], uri_);
  EXPECT_EQ(report["target"]["field"], "model_weights");
  EXPECT_EQ(report["target"]["strategy"], "object storage");
  EXPECT_EQ(report["draft"]["source"], uri_);
  EXPECT_EQ(report["draft"]["field"], GetParam()) << "the variable that set the checkpoint URI";
  EXPECT_THAT(report["draft"]["passed_over"].get<std::vector<std::string>>(),
              ElementsAre("model_weights: not set", "model " + snapshot() + ": no *.safetensors files"));
  EXPECT_EQ(report["draft"]["tensors"], footprint_.tensors);
  EXPECT_EQ(report["draft"]["bytes_read"], footprint_.bytes);
  EXPECT_EQ(report["draft"]["shards_read"], footprint_.shards.size());
  // One source, one stream: the checkpoint is read once for both modules.
  EXPECT_EQ(report["streams"], 1);
  EXPECT_EQ(report["bytes_read"], local_->tensor_bytes());
  EXPECT_EQ(report["target"]["bytes_read"].get<uint64_t>() + report["draft"]["bytes_read"].get<uint64_t>(),
            local_->tensor_bytes());
}

TEST_P(DraftEndToEnd, DraftOnlyReadsOnlyTheShardsWithMtpLayers) {
  auto variable = set_checkpoint_uri();
  auto result = testing::run_cli({"load", "--model", snapshot(), "--speculative", "mtp", "--draft-only", "--json",
                                  "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto report = nlohmann::json::parse(result.out);
  EXPECT_FALSE(report.contains("target"));
  EXPECT_EQ(report["draft"]["source"], uri_);
  EXPECT_EQ(report["draft"]["shards_read"], footprint_.shards.size());
  EXPECT_EQ(report["draft"]["shards_opened"], footprint_.shards.size());
  EXPECT_EQ(report["draft"]["bytes_read"], footprint_.bytes);
  EXPECT_EQ(report["bytes_read"], footprint_.bytes);
  EXPECT_EQ(report["shards_read"], footprint_.shards.size());
}

TEST_P(DraftEndToEnd, ResolveExplainsBothModules) {
  auto variable = set_checkpoint_uri();
  auto result = testing::run_cli({"resolve", "--model", snapshot(), "--model-weights", uri_, "--speculative", "mtp",
                                  "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto report = nlohmann::json::parse(result.out);
  EXPECT_EQ(report["target"]["source"], uri_);
  EXPECT_EQ(report["target"]["field"], "model_weights");
  EXPECT_EQ(report["draft"]["source"], uri_);
  EXPECT_EQ(report["draft"]["field"], GetParam());
  EXPECT_EQ(report["draft"]["shards"].size(), footprint_.shards.size());
  EXPECT_THAT(report["draft"]["passed_over"].get<std::vector<std::string>>(),
              ElementsAre("model_weights: not set", "model " + snapshot() + ": no *.safetensors files"));

  auto text = testing::run_cli({"resolve", "--model", snapshot(), "--model-weights", uri_, "--speculative", "mtp"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_THAT(text.out, AllOf(HasSubstr("the target: " + uri_ + " (model_weights)"),
                              HasSubstr("the draft (mtp): " + uri_ + " (" + GetParam() + "); passed over: "
                                        "model_weights: not set; model " + snapshot() + ": no *.safetensors files")));
}

TEST_P(DraftEndToEnd, WithoutTheCheckpointUriTheErrorNamesEverySource) {
  std::string expected = "Cannot find any safetensors model weights for the draft (mtp): model_weights: not set; model " +
                         snapshot() + ": no *.safetensors files; WEIGHTSTREAM_MODEL_URI: not set";
  for (const std::vector<std::string>& arguments :
       {std::vector<std::string>{"load", "--model", snapshot(), "--model-weights", uri_, "--speculative", "mtp",
                                 "--no-progress"},
        std::vector<std::string>{"load", "--model", snapshot(), "--speculative", "mtp", "--draft-only", "--json"},
        std::vector<std::string>{"resolve", "--model", snapshot(), "--model-weights", uri_, "--speculative", "mtp"}}) {
    auto result = testing::run_cli(arguments);
    EXPECT_EQ(result.exit_code, 1) << arguments[0];
    EXPECT_THAT(result.err, HasSubstr("weightstream: error: " + expected)) << arguments[0];
    EXPECT_THAT(result.err, AllOf(HasSubstr("model_weights: not set"),
                                  HasSubstr("model " + snapshot() + ": no *.safetensors files"),
                                  HasSubstr("WEIGHTSTREAM_MODEL_URI: not set")));
  }
}

TEST_P(DraftEndToEnd, TheErrorNamesTheVariableThatSetTheCheckpointUri) {
  // The checkpoint URI points at the snapshot, which has no weights: the error says which
  // variable set it, MX_MODEL_URI included.
  ScopedEnv variable(GetParam(), snapshot());
  auto result = testing::run_cli({"load", "--model", snapshot(), "--model-weights", uri_, "--speculative", "mtp",
                                  "--no-progress"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, HasSubstr("weightstream: error: Cannot find any safetensors model weights for the draft (mtp): "
                                    "model_weights: not set; model " + snapshot() + ": no *.safetensors files; " +
                                    GetParam() + " " + snapshot() + ": no *.safetensors files"));
  if (GetParam() == "MX_MODEL_URI") EXPECT_THAT(result.err, Not(HasSubstr("WEIGHTSTREAM_MODEL_URI")));
}

TEST_P(DraftEndToEnd, AliasesThatDisagreeAreAnError) {
  auto variable = set_checkpoint_uri();
  ScopedEnv other(GetParam() == "MX_MODEL_URI" ? "WEIGHTSTREAM_MODEL_URI" : "MX_MODEL_URI", uri_ + "-other");
  auto result = testing::run_cli({"load", "--model", snapshot(), "--speculative", "mtp", "--draft-only"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, AllOf(HasSubstr("WEIGHTSTREAM_MODEL_URI="), HasSubstr("MX_MODEL_URI="), HasSubstr("disagree")));
}

TEST_P(DraftEndToEnd, AuditOfBothModulesIsClean) {
  // The library path an engine takes: storage allocated once, a cold load, a reload from the
  // same checkpoint URI, then a bit-for-bit comparison with a fresh cold load of each module.
  Options options;
  options.s3 = s3_options_;
  options.model_uri = uri_;
  auto target = testing::module_fixture(ModuleRole::kTarget, {snapshot(), uri_}, options.model_uri, options);
  auto draft = testing::module_fixture(ModuleRole::kDraft, {snapshot(), ""}, options.model_uri, options);
  ASSERT_EQ(draft.resolution.chosen().field, "WEIGHTSTREAM_MODEL_URI");
  std::vector<ModuleLoadRequest> requests = {target.request(), draft.request()};
  load_modules(requests, LoadMode::kCold, options);
  auto target_addresses = storage_addresses(target.layout);
  auto draft_addresses = storage_addresses(draft.layout);

  std::vector<StrategyLoad> reload = load_modules(requests, LoadMode::kReload, options);
  EXPECT_EQ(reload[0].stream.bytes_read, local_->tensor_bytes());
  uint64_t address_changes = 0;
  for (auto [layout, before] : {std::pair{&target.layout, &target_addresses}, std::pair{&draft.layout, &draft_addresses}}) {
    for (const auto& [name, address] : storage_addresses(*layout)) address_changes += before->at(name) != address;
  }
  EXPECT_EQ(address_changes, 0u);
  EXPECT_EQ(target.layout.loads_finished(), 2u);
  EXPECT_EQ(draft.layout.loads_finished(), 2u);
  LayoutComparison target_audit = compare_layouts(target.layout, testing::reference_layout(*local_, ModuleRole::kTarget));
  LayoutComparison draft_audit = compare_layouts(draft.layout, testing::reference_layout(*local_, ModuleRole::kDraft));
  EXPECT_GT(target_audit.compared, 0u);
  EXPECT_EQ(target_audit.mismatched, 0u);
  EXPECT_GT(draft_audit.compared, 0u);
  EXPECT_EQ(draft_audit.mismatched, 0u);
}

INSTANTIATE_TEST_SUITE_P(CheckpointUriVariable, DraftEndToEnd, ::testing::Values("WEIGHTSTREAM_MODEL_URI", "MX_MODEL_URI"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace weightstream

// The model-layer commands end to end: plan, load --tp-size/--tp-rank, export, audit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "support/test_support.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"
#include "weightstream/format.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::run_cli;
using testing::TempDir;

std::string synth(const TempDir& directory, const std::string& name, const std::string& arch, uint64_t seed) {
  SynthOptions options;
  options.arch = arch;
  options.layers = 2;
  options.hidden = 256;
  options.seed = seed;
  options.vocab = 1000;
  synthesize_checkpoint(directory / name, options);
  return (directory / name).string();
}

class AuditCommand : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(AuditCommand, ReloadsAreBitExactInPlaceWithOneHookRunPerLoad) {
  auto [arch, tp_size] = GetParam();
  TempDir directory;
  std::string first = synth(directory, "a", arch, 1);
  std::string second = synth(directory, "b", arch, 2);
  int rank = tp_size - 1;
  auto result = run_cli({"audit", first, "--reload", second, "--tp-size", std::to_string(tp_size), "--tp-rank",
                         std::to_string(rank), "--batches", "3", "--order", "shuffled", "--repeat", "2", "--json",
                         "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err << result.out;
  auto json = nlohmann::json::parse(result.out);
  EXPECT_GT(json["compared"].get<uint64_t>(), 10u);
  EXPECT_EQ(json["mismatched"], 0);
  EXPECT_EQ(json["address_changes"], 0);
  EXPECT_EQ(json["model_hook_runs_per_load"], 1);
  EXPECT_EQ(json["memory_growth_bytes"], 0);
}

INSTANTIATE_TEST_SUITE_P(Architectures, AuditCommand,
                         ::testing::Combine(::testing::Values("llama", "qwen3", "deepseek_v3"), ::testing::Values(1, 2, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_tp" + std::to_string(std::get<1>(info.param));
                         });

TEST(AuditCommand, ABf16ReloadOfAnFp8ModelIsQuantizedInPlaceAndComparedWithTheSameLayout) {
  TempDir directory;
  const std::string fp8 = (directory.path() / "fp8").string(), bf16 = (directory.path() / "bf16").string();
  for (const auto& [path, flags] : {std::pair{fp8, std::vector<std::string>{"--quantize", "fp8-block", "--seed", "1"}},
                                    std::pair{bf16, std::vector<std::string>{"--block-aligned", "--seed", "2"}}}) {
    std::vector<std::string> command = {"synth", path, "--arch", "qwen3_moe", "--hidden", "512", "--layers", "2"};
    command.insert(command.end(), flags.begin(), flags.end());
    auto written = run_cli(command);
    ASSERT_EQ(written.exit_code, 0) << written.err;
  }
  auto result = run_cli({"audit", fp8, "--reload", bf16, "--tp-size", "2", "--tp-rank", "1", "--ep-size", "2",
                         "--ep-rank", "1", "--batches", "3", "--json", "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err << result.out;
  auto json = nlohmann::json::parse(result.out);
  EXPECT_GT(json["compared"].get<uint64_t>(), 10u);
  EXPECT_EQ(json["mismatched"], 0);
  EXPECT_EQ(json["address_changes"], 0);
  EXPECT_EQ(json["model_hook_runs_per_load"], 1);
}

TEST(AuditCommand, AReloadInAnotherDtypeIsComparedInTheAuditedLayoutsDtypes) {
  TempDir directory;
  std::string bf16 = synth(directory, "bf16", "llama", 1);
  std::string f16 = (directory / "f16").string();
  auto written = run_cli({"synth", f16, "--arch", "llama", "--layers", "2", "--hidden", "256", "--vocab", "1000",
                          "--seed", "2", "--dtype", "f16"});
  ASSERT_EQ(written.exit_code, 0) << written.err;
  auto result = run_cli({"audit", bf16, "--reload", f16, "--batches", "3", "--json", "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.out << result.err;
  auto json = nlohmann::json::parse(result.out);
  EXPECT_GT(json["compared"].get<uint64_t>(), 0u);
  EXPECT_EQ(json["mismatched"], 0);
}

TEST(AuditCommand, QuantizedLayoutAndReversedOrder) {
  TempDir directory;
  std::string first = synth(directory, "a", "llama", 1);
  auto result = run_cli({"audit", first, "--quantize", "fp8", "--batches", "5", "--order", "reversed", "--json",
                         "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto json = nlohmann::json::parse(result.out);
  EXPECT_EQ(json["mismatched"], 0);
  EXPECT_EQ(json["model_hook_runs_per_load"], 1);
}

// The audit of a target and its MTP draft, resolved and loaded as `load --speculative mtp`
// does: each module's audit fields are clean.
class DraftAuditCommand : public ::testing::TestWithParam<std::string> {};

void expect_clean_audit(const nlohmann::json& audit, const std::string& module) {
  SCOPED_TRACE(module + ": " + audit.dump());
  EXPECT_GT(audit["compared"].get<uint64_t>(), 3u);
  EXPECT_EQ(audit["mismatched"], 0);
  EXPECT_EQ(audit["address_changes"], 0);
  EXPECT_EQ(audit["memory_growth_bytes"], 0);
  EXPECT_LE(audit["model_hook_runs_per_load"], 1);
  EXPECT_EQ(audit["model_hook_runs_per_load"], audit["model_hook_runs_per_load_min"]);
  EXPECT_EQ(audit["clean"], true);
}

TEST_P(DraftAuditCommand, TargetAndDraftAuditsAreClean) {
  TempDir directory;
  std::string first = synth(directory, "a", GetParam(), 1);
  std::string second = synth(directory, "b", GetParam(), 2);
  auto result = run_cli({"audit", "--model", first, "--speculative", "mtp", "--reload", second, "--batches", "3",
                         "--order", "shuffled", "--repeat", "2", "--json", "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err << result.out;
  auto json = nlohmann::json::parse(result.out);
  expect_clean_audit(json["target"], "target");
  expect_clean_audit(json["draft"], "draft");
  EXPECT_EQ(json["target"]["model_hook_runs_per_load"], 1) << "the fused K/V hook, once per load";
  // Every layout is a target unless it is the draft (issue 18): only the draft says so.
  EXPECT_EQ(json["target"]["layout"], GetParam() + " tp 1 rank 0");
  EXPECT_EQ(json["draft"]["layout"], GetParam() + " tp 1 rank 0 (draft)");
  EXPECT_EQ(json["draft"]["source"], first);
  EXPECT_EQ(json["draft"]["reload_uri"], second);
  EXPECT_EQ(json["clean"], true);

  // The text form, one line per module.
  auto text = run_cli({"audit", first, "--speculative", "mtp", "--no-progress"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("the target (" + GetParam() + " tp 1 rank 0): compared "));
  EXPECT_THAT(text.out, HasSubstr("the draft (mtp) (" + GetParam() + " tp 1 rank 0 (draft)): compared "));
}

TEST_P(DraftAuditCommand, DraftOnlyAuditReadsOnlyTheDraftsBytes) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", GetParam(), 1);
  auto result = run_cli({"audit", "--model", checkpoint, "--speculative", "mtp", "--draft-only", "--json",
                         "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto json = nlohmann::json::parse(result.out);
  EXPECT_FALSE(json.contains("target"));
  expect_clean_audit(json["draft"], "draft");
  auto plain = nlohmann::json::parse(
      run_cli({"load", "--model", checkpoint, "--speculative", "mtp", "--draft-only", "--json", "--no-progress"}).out);
  EXPECT_EQ(json["cold_bytes_read"], plain["draft"]["bytes_read"]);
  EXPECT_EQ(json["reload_bytes"], plain["draft"]["bytes_read"]);
}

INSTANTIATE_TEST_SUITE_P(MtpArchitectures, DraftAuditCommand, ::testing::Values("deepseek_v3", "qwen3_next"),
                         [](const auto& info) { return info.param; });

TEST(DraftAuditCommand, RefusesFlagsThatDoNotCombine) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", "deepseek_v3", 1);
  // Flags that do not combine are usage errors (exit 2, as a malformed flag is).
  auto via = run_cli({"audit", checkpoint, "--speculative", "mtp", "--via", "tcp"});
  EXPECT_EQ(via.exit_code, 2);
  EXPECT_THAT(via.err, HasSubstr("--via pushes the reload into one layout"));
  auto disagree = run_cli({"audit", checkpoint, "--model", checkpoint + "-other", "--speculative", "mtp"});
  EXPECT_EQ(disagree.exit_code, 2);
  EXPECT_THAT(disagree.err, HasSubstr("audit: the URI '" + checkpoint + "' and --model"));
  auto missing = run_cli({"audit"});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_THAT(missing.err, HasSubstr("uri"));
}

TEST(PlanCommand, ListsPartsRangesAndUnusedTensors) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", "deepseek_v3", 1);
  auto result = run_cli({"plan", checkpoint, "--tp-size", "2", "--tp-rank", "1", "--ep-size", "2", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto json = nlohmann::json::parse(result.out);
  EXPECT_EQ(json["layout"], "deepseek_v3 tp 2 rank 1 ep 2 rank 0");
  EXPECT_LT(json["bytes_to_read"].get<uint64_t>(), json["checkpoint_bytes"].get<uint64_t>());
  bool found = false;
  for (const auto& parameter : json["parameters"]) {
    if (parameter["name"] != "model.layers.0.self_attn.q_b_proj.weight") continue;
    found = true;
    EXPECT_EQ(parameter["parts"][0]["read"], "slice");
    EXPECT_TRUE(parameter["parts"][0].contains("file_offset"));
    EXPECT_THAT(parameter["parts"][0]["shard"].get<std::string>(), HasSubstr(".safetensors"));
  }
  EXPECT_TRUE(found);
  ASSERT_FALSE(json["unused"].empty());
  EXPECT_THAT(json["unused"][0]["reason"].get<std::string>(), HasSubstr("expert-parallel rank 1"));
}

TEST(LoadCommand, TensorParallelLoadReadsOnlyTheRanksBytes) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", "qwen3", 1);
  auto result = run_cli({"load", checkpoint, "--tp-size", "4", "--tp-rank", "2", "--json", "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto json = nlohmann::json::parse(result.out);
  EXPECT_EQ(json["layout"], "qwen3 tp 4 rank 2");
  EXPECT_LT(json["bytes"].get<uint64_t>(), json["checkpoint_bytes"].get<uint64_t>());
  EXPECT_EQ(json["session"]["model_hook_runs"], 1);
  auto raw = run_cli({"load", checkpoint, "--raw", "--json", "--no-progress"});
  ASSERT_EQ(raw.exit_code, 0) << raw.err;
  EXPECT_FALSE(nlohmann::json::parse(raw.out).contains("layout"));
  // --raw with a layout flag would ignore it: refused, naming both.
  auto both = run_cli({"load", checkpoint, "--tp-size", "4", "--raw", "--json", "--no-progress"});
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_THAT(both.err, AllOf(HasSubstr("--tp-size"), HasSubstr("--raw")));
  auto bad = run_cli({"load", checkpoint, "--tp-size", "2", "--tp-rank", "2", "--no-progress"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("--tp-rank 2 must be below --tp-size 2"));
}

TEST(ExportCommand, WritesTheRanksParametersAsLoaded) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", "llama", 1);
  std::string output = (directory / "rank1.safetensors").string();
  auto result = run_cli({"export", checkpoint, output, "--tp-size", "2", "--tp-rank", "1", "--quantize", "fp8",
                         "--json", "--no-progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  std::string file = testing::read_file(output);
  auto header = parse_safetensors_bytes(output, std::span(reinterpret_cast<const std::byte*>(file.data()), file.size()));
  EXPECT_EQ(header.metadata["format"], "weightstream-engine");
  EXPECT_EQ(header.metadata["layout"], "llama tp 2 rank 1");
  bool quantized = false, scale = false;
  for (const TensorInfo& tensor : header.tensors) {
    if (tensor.name == "model.layers.0.self_attn.qkv_proj.weight") quantized = tensor.dtype == Dtype::kF8E4M3;
    if (tensor.name == "model.layers.0.self_attn.qkv_proj.weight_scale") scale = tensor.dtype == Dtype::kF32;
  }
  EXPECT_TRUE(quantized);
  EXPECT_TRUE(scale);
}

TEST(ExportCommand, RefusesAnOutputThatIsOrIsInsideTheCheckpointItReads) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", "llama", 1);
  std::filesystem::path shard;
  for (const auto& entry : std::filesystem::directory_iterator(checkpoint)) {
    if (entry.path().extension() == ".safetensors") shard = entry.path();
  }
  ASSERT_FALSE(shard.empty());
  std::string before = testing::read_file(shard.string());
  std::filesystem::create_directory_symlink(checkpoint, directory / "link");
  // A shard of the checkpoint, a new file inside it, the same through a symbolic link and
  // `..`, and a one-file checkpoint exported over itself.
  std::vector<std::pair<std::string, std::string>> cases = {
      {checkpoint, shard.string()},
      {checkpoint, checkpoint + "/rank0.safetensors"},
      {(directory / "link").string(), checkpoint + "/../a/" + shard.filename().string()},
      {"file://" + shard.string(), shard.string()},
  };
  for (const auto& [input, output] : cases) {
    auto result = run_cli({"export", input, output, "--no-progress"});
    EXPECT_EQ(result.exit_code, 2) << input << " -> " << output << ": " << result.err;
    EXPECT_THAT(result.err, AllOf(HasSubstr("export: the output " + output), HasSubstr("the checkpoint " + input),
                                  HasSubstr("that it reads"), HasSubstr("Write it elsewhere")));
  }
  EXPECT_EQ(testing::read_file(shard.string()), before);
  EXPECT_FALSE(std::filesystem::exists(checkpoint + "/rank0.safetensors"));
  // Beside the checkpoint is fine.
  auto beside = run_cli({"export", checkpoint, (directory / "a-rank0.safetensors").string(), "--no-progress"});
  EXPECT_EQ(beside.exit_code, 0) << beside.err;
}

}  // namespace
}  // namespace weightstream

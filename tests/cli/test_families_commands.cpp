// Issue 18 end to end: a target load reads no byte of an MTP layer, a checkpoint without MTP
// layers loads as a target and refuses a draft naming every source, FP8 block-scaled
// checkpoints from synth audit clean with weights and scales in different batches, and a
// tp size that cuts a block is refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/test_support.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::run_cli;
using testing::TempDir;

std::string synth(const TempDir& directory, const std::string& name, const std::string& arch,
                  SynthOptions::Quantization quantize = SynthOptions::Quantization::kNone, int64_t hidden = 256) {
  SynthOptions options;
  options.arch = arch;
  options.layers = 2;
  options.hidden = hidden;
  options.vocab = 1000;
  options.quantize = quantize;
  synthesize_checkpoint(directory / name, options);
  return (directory / name).string();
}

uint64_t tensor_bytes_with_prefix(const std::string& checkpoint, const std::string& prefix) {
  auto json = nlohmann::json::parse(run_cli({"inspect", checkpoint, "--json"}).out);
  uint64_t bytes = 0;
  for (const auto& tensor : json["tensors"]) {
    if (tensor["name"].get<std::string>().starts_with(prefix)) bytes += tensor["bytes"].get<uint64_t>();
  }
  return bytes;
}

TEST(FamiliesCommands, TargetLoadReadsNoByteOfAnMtpLayer) {
  for (const char* arch : {"deepseek_v3", "glm4_moe"}) {
    SCOPED_TRACE(arch);
    TempDir directory;
    std::string checkpoint = synth(directory, "m", arch);
    uint64_t mtp = tensor_bytes_with_prefix(checkpoint, "model.layers.2.");
    ASSERT_GT(mtp, 0u);
    auto target = run_cli({"load", checkpoint, "--tp-size", "1", "--json", "--no-progress"});
    ASSERT_EQ(target.exit_code, 0) << target.err;
    auto json = nlohmann::json::parse(target.out);
    EXPECT_EQ(json["bytes"].get<uint64_t>(), json["checkpoint_bytes"].get<uint64_t>() - mtp);
    EXPECT_LE(json["bytes_read"].get<uint64_t>(), json["checkpoint_bytes"].get<uint64_t>() - mtp);
  }
}

TEST(FamiliesCommands, CheckpointWithoutMtpLayersLoadsAsTargetAndRefusesTheDraftNamingEverySource) {
  TempDir directory;
  // What save_pretrained writes: the config counts an MTP layer, the checkpoint has none.
  SynthOptions options;
  options.arch = "deepseek_v3";
  options.layers = 2;
  options.vocab = 1000;
  options.mtp_layers = 0;
  options.hidden = 512;  // 8 heads: tp 8 divides them
  std::string checkpoint = (directory / "m").string();
  synthesize_checkpoint(checkpoint, options);
  auto config = nlohmann::json::parse(testing::read_file(directory / "m" / "config.json"));
  config["num_nextn_predict_layers"] = 1;
  testing::write_file(directory / "m" / "config.json", config.dump());
  for (const char* tp : {"1", "2", "8"}) {
    auto target = run_cli({"load", checkpoint, "--tp-size", tp, "--tp-rank", "0", "--json", "--no-progress"});
    EXPECT_EQ(target.exit_code, 0) << tp << target.err;
  }
  auto draft = run_cli({"load", checkpoint, "--speculative", "mtp", "--json", "--no-progress"});
  EXPECT_NE(draft.exit_code, 0);
  EXPECT_THAT(draft.err, HasSubstr("Cannot find any safetensors model weights for the draft (mtp): model_weights: not set; "));
  EXPECT_THAT(draft.err, HasSubstr("no tensor the draft wants"));
}

TEST(FamiliesCommands, SynthWritesEveryFamilyAndFp8BlockCheckpointsAuditClean) {
  TempDir directory;
  for (const char* arch : {"qwen3_moe", "mixtral", "glm4_moe", "kimi_k2"}) {
    std::string checkpoint = synth(directory, arch, arch);
    auto audit = run_cli({"audit", checkpoint, "--tp-size", "2", "--tp-rank", "1", "--ep-size", "2", "--batches", "4",
                          "--order", "shuffled", "--json", "--no-progress"});
    EXPECT_EQ(audit.exit_code, 0) << arch << audit.err;
  }
  auto cli = run_cli({"synth", (directory / "fp8").string(), "--arch", "deepseek_v3", "--hidden", "512",
                      "--quantize", "fp8-block", "--json"});
  ASSERT_EQ(cli.exit_code, 0) << cli.err;
  std::string fp8 = (directory / "fp8").string();
  auto config = nlohmann::json::parse(testing::read_file(directory / "fp8" / "config.json"));
  EXPECT_EQ(config["quantization_config"],
            nlohmann::json::parse(R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]})"));
  // Reversed order in 9 batches: every weight_scale_inv arrives in another batch than its weight.
  for (const char* tp : {"1", "2", "4"}) {
    auto audit = run_cli({"audit", fp8, "--tp-size", tp, "--batches", "9", "--order", "reversed", "--json",
                          "--no-progress"});
    ASSERT_EQ(audit.exit_code, 0) << audit.err;
    EXPECT_EQ(nlohmann::json::parse(audit.out)["clean"], true);
  }
  auto cut = run_cli({"export", fp8, (directory / "x.safetensors").string(), "--tp-size", "8", "--no-progress"});
  EXPECT_NE(cut.exit_code, 0);
  EXPECT_THAT(cut.err, HasSubstr("does not fall on the weight_block_size [128, 128] boundaries of its FP8 block scales"));
  auto online = run_cli({"load", fp8, "--tp-size", "1", "--quantize", "fp8", "--no-progress"});
  EXPECT_NE(online.exit_code, 0);
  EXPECT_THAT(online.err, HasSubstr("FP8 block-quantized already"));
  auto bad = run_cli({"synth", (directory / "bad").string(), "--quantize", "fp4"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("--quantize"));
}

}  // namespace
}  // namespace weightstream

// `weightstream audit --via`: the reload travels as buckets from a separate
// `weightstream send` process; the audit must stay clean and report update seconds and
// GB/s. The GPU transports run only where the machine has the GPUs, and say why not. Also
// `weightstream send` into a receiver whose model the checkpoint does not fit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <future>

#include "model/model_fixtures.hpp"
#include "support/test_support.hpp"
#include "weightstream/device.hpp"
#include "weightstream/error.hpp"
#include "weightstream/format.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::run_cli;
using testing::TempDir;

std::string synth(const TempDir& directory, const std::string& name, uint64_t seed) {
  SynthOptions options;
  options.arch = "llama";
  options.layers = 2;
  options.hidden = 256;
  options.vocab = 1000;
  options.seed = seed;
  synthesize_checkpoint(directory / name, options);
  return (directory / name).string();
}

nlohmann::json audit_via(const std::string& via, const std::string& device, std::string* err = nullptr) {
  TempDir directory;
  std::string first = synth(directory, "a", 1);
  std::string second = synth(directory, "b", 2);
  auto result = run_cli({"audit", first, "--reload", second, "--via", via, "--bucket-size", "64KiB", "--device", device,
                         "--repeat", "2", "--json", "--no-progress"});
  if (err != nullptr) *err = result.err;
  EXPECT_EQ(result.exit_code, 0) << result.err;
  if (result.exit_code != 0) return {};
  return nlohmann::json::parse(result.out);
}

void expect_clean(const nlohmann::json& report, const std::string& via) {
  ASSERT_FALSE(report.is_null());
  EXPECT_EQ(report["via"], via);
  EXPECT_GT(report["compared"].get<uint64_t>(), 10u);
  EXPECT_EQ(report["mismatched"], 0);
  EXPECT_EQ(report["address_changes"], 0);
  EXPECT_EQ(report["model_hook_runs_per_load"], 1);
  EXPECT_EQ(report["memory_growth_bytes"], 0);
  EXPECT_GT(report["update_seconds"].get<double>(), 0.0);
  EXPECT_GT(report["update_gbps"].get<double>(), 0.0);
  // Where the receiver's seconds went: every phase named, none negative, their sum within them.
  const nlohmann::json& phases = report["update_phases"];
  ASSERT_TRUE(phases.is_object());
  double counted = 0;
  for (const auto& [name, phase] : kUpdatePhases) {
    ASSERT_TRUE(phases.contains(name)) << name;
    EXPECT_GE(phases[name].get<double>(), 0.0) << name;
    if (std::string_view(name) != "first_bucket") counted += phases[name].get<double>();
  }
  EXPECT_GT(phases["waiting"].get<double>() + phases["checking"].get<double>(), 0.0);
  EXPECT_LE(counted, report["update_seconds"].get<double>() * 1.01 + 1e-3);
  // --repeat 2: two updates from one sender over one connection, each timed.
  const nlohmann::json& each = report["update_seconds_each"];
  ASSERT_EQ(each.size(), 2u);
  EXPECT_GT(each[0].get<double>(), 0.0);
  EXPECT_GT(each[1].get<double>(), 0.0);
  EXPECT_NEAR(each[0].get<double>() + each[1].get<double>(), report["update_seconds"].get<double>(), 1e-6);
  EXPECT_EQ(report["clean"], true);
}

TEST(AuditVia, ShmIsClean) { expect_clean(audit_via("shm", "cpu"), "shm"); }

TEST(AuditVia, TcpIsClean) { expect_clean(audit_via("tcp", "cpu"), "tcp"); }

TEST(AuditVia, CudaIpcIsClean) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "cuda-ipc needs a CUDA GPU; this machine has none";
  expect_clean(audit_via("cuda-ipc", "cuda:0"), "cuda-ipc");
}

TEST(AuditVia, NcclIsClean) {
  if (!transport_compiled(TransportKind::kNccl)) GTEST_SKIP() << "this build has no NCCL (WS_HAVE_NCCL off)";
  // NCCL refuses two ranks on one GPU: the sender takes the next GPU (issue 9's run).
  if (cuda_device_count() < 2) GTEST_SKIP() << "nccl needs two CUDA GPUs; this machine has " << cuda_device_count();
  expect_clean(audit_via("nccl", "cuda:0"), "nccl");
}

TEST(AuditVia, CudaIpcWithoutAGpuFailsInOneLine) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU: the clean run is tested instead";
  TempDir directory;
  std::string first = synth(directory, "a", 1);
  auto result = run_cli({"audit", first, "--via", "cuda-ipc", "--json", "--no-progress"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.err, HasSubstr("weightstream: error: "));
  EXPECT_THAT(result.err, ::testing::AnyOf(HasSubstr("no usable CUDA device"), HasSubstr("needs a build with CUDA"),
                                           HasSubstr("not compiled into this build")));
}

TEST(SendCommand, AReceiverWhoseModelDoesNotFitRefusesTheWholeCheckpointBeforeAByte) {
  // `send` declares every tensor of its checkpoint first: a checkpoint of another width is
  // refused whole, with the receiver's reasons, and the model keeps every byte.
  TempDir directory;
  SynthOptions options;
  options.arch = "llama";
  options.layers = 2;
  options.hidden = 128;
  options.seed = 2;
  synthesize_checkpoint(directory / "narrow", options);
  const testing::MemoryCheckpoint& loaded = testing::cached_checkpoint("llama", 1);
  ModelLayout layout = testing::cold_loaded_layout(loaded);
  ReceiverOptions receiver_options;
  receiver_options.open_without_token = true;  // run_cli passes no stdin for --token-stdin
  UpdateReceiver receiver(layout, receiver_options);
  auto received = std::async(std::launch::async, [&] {
    try {
      receiver.receive(std::chrono::seconds(30));
    } catch (const Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  });
  auto result = run_cli({"send", (directory / "narrow").string(), "--to", receiver.address(), "--via", "tcp"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.err, HasSubstr("weightstream: error: update receiver at " + receiver.address() +
                                    " refused the update: the update's manifest of "));
  EXPECT_THAT(result.err, HasSubstr("does not fit " + layout.description()));
  EXPECT_THAT(result.err, HasSubstr("tensor model.embed_tokens.weight has shape [4096, 128] but parameter "
                                    "model.embed_tokens.weight"));
  EXPECT_THAT(received.get(), HasSubstr("failed before any bucket arrived"));
  EXPECT_EQ(compare_layouts(layout, testing::cold_loaded_layout(loaded)).mismatched, 0u);
}

}  // namespace
}  // namespace weightstream

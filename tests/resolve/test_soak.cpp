// Soak (issue 7): one process loads the same checkpoint 100 times, then reloads it 100
// times through a load session, and its resident memory, open file descriptors and
// threads must stay flat. A loader lives inside a server for weeks; a leak of one fd or a
// few kilobytes per load is an outage there. ctest runs each test in its own process, so
// the figures are this test's alone. The first sample is taken after one warm-up load,
// when the allocator's per-thread arenas and the reader pool's stacks already exist.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "support/test_support.hpp"
#include "weightstream/load.hpp"
#include "weightstream/synth.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {
namespace {

using testing::TempDir;

/// Loads per test: 100, or WS_SOAK_ITERATIONS for a longer soak by hand.
int iterations() {
  const char* text = std::getenv("WS_SOAK_ITERATIONS");
  return text ? std::max(1, std::atoi(text)) : 100;
}
/// Growth of the resident set tolerated between the first and the last sample: the
/// allocator may keep a few freed chunks; a leak of one tensor per load (>= 128 KiB here)
/// times 100 loads is far beyond it.
constexpr long kRssSlackKib = 8 * 1024;

/// What the process holds at one moment, from /proc/self.
struct ProcessSample {
  long rss_kib = 0;  ///< VmRSS
  long threads = 0;  ///< Threads
  long fds = 0;      ///< entries of /proc/self/fd
};

long status_field(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  ADD_FAILURE() << field << " not found in /proc/self/status";
  return -1;
}

ProcessSample sample() {
  ProcessSample now;
  now.rss_kib = status_field("VmRSS");
  now.threads = status_field("Threads");
  // The directory iterator holds one fd of its own while it counts; both samples include it.
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++now.fds;
  return now;
}

/// Warm-up runs before the first sample. A reload commits whole layers by default, holding an
/// unfinished layer's pieces in malloc's memory taken by whichever reader thread delivers them;
/// each of glibc's per-thread arenas keeps what it once held for the next load, so resident
/// memory climbs over the first loads to a plateau (with MALLOC_ARENA_MAX=1 it stays flat).
/// The baseline is the most resident memory seen after any warm-up run.
constexpr int kWarmUps = 10;

/// Runs `once` iterations() times after kWarmUps warm-up runs; reports and checks the samples.
template <typename Step>
void expect_flat(const std::string& what, Step once) {
  ProcessSample first;
  for (int i = 0; i < kWarmUps; ++i) {
    once();
    ProcessSample now = sample();
    if (i == 0 || now.rss_kib > first.rss_kib) first = now;
  }
  const int count = iterations();
  for (int i = 0; i < count; ++i) once();
  ProcessSample last = sample();
  // The report (docs/RELIABILITY.md) quotes this line.
  std::cout << "soak: " << what << " x" << count << ": VmRSS " << first.rss_kib << " -> " << last.rss_kib
            << " KiB, fds " << first.fds << " -> " << last.fds << ", threads " << first.threads << " -> "
            << last.threads << std::endl;
  ::testing::Test::RecordProperty(what + "_rss_first_kib", std::to_string(first.rss_kib));
  ::testing::Test::RecordProperty(what + "_rss_last_kib", std::to_string(last.rss_kib));
  // ASan's quarantine keeps freed loads resident on purpose; its leak check covers memory there.
  if (!testing::sanitized_build()) {
    EXPECT_LE(last.rss_kib, first.rss_kib + kRssSlackKib) << what << ": resident memory grew";
  }
  EXPECT_LE(last.fds, first.fds) << what << ": file descriptors leaked";
  EXPECT_LE(last.threads, first.threads) << what << ": threads leaked";
}

/// A small sharded llama checkpoint (about 5 MB in 3 shards) read with several readers
/// and small chunks, so every load runs the reader pool and the staging pool.
class Soak : public ::testing::Test {
 protected:
  void SetUp() override {
    SynthOptions synth;
    synth.arch = "llama";
    synth.layers = 4;
    synth.hidden = 256;
    synth.shards = 3;
    synth.seed = 11;
    synthesize_checkpoint(directory_.path(), synth);
    checkpoint_ = Checkpoint::open(directory_.path().string(), Options{});
    options_.concurrency = 4;
    options_.chunk_bytes = 256 * 1024;
    options_.memory_limit = 2 * 1024 * 1024;
  }

  TempDir directory_;
  Checkpoint checkpoint_;
  StreamOptions options_;
};

TEST_F(Soak, LoadingTheSameCheckpointKeepsMemoryFdsAndThreadsFlat) {
  const Device cpu = parse_device("cpu");
  uint64_t expected = checkpoint_.tensor_bytes();
  expect_flat("load_checkpoint", [&] {
    LoadedCheckpoint loaded = load_checkpoint(checkpoint_, cpu, options_);
    ASSERT_EQ(loaded.stats.bytes, expected);
  });
}

TEST_F(Soak, OpeningAndLoadingAgainKeepsMemoryFdsAndThreadsFlat) {
  // Opening the checkpoint each time exercises the storage layer's files and the header
  // parser too, as a server that reloads by URI does.
  const Device cpu = parse_device("cpu");
  expect_flat("open_and_load", [&] {
    Checkpoint checkpoint = Checkpoint::open(directory_.path().string(), Options{});
    LoadedCheckpoint loaded = load_checkpoint(checkpoint, cpu, options_);
    ASSERT_EQ(loaded.tensors.size(), checkpoint.tensors().size());
  });
}

TEST_F(Soak, ReloadingThroughALoadSessionKeepsMemoryFdsAndThreadsFlat) {
  ModelLayout layout = build_model_layout(checkpoint_model_config(checkpoint_));
  layout.add_hook(make_fused_kv_hook());
  layout.allocate(parse_device("cpu"));
  load_layout(layout, checkpoint_, LoadMode::kCold, options_);
  auto addresses = storage_addresses(layout);
  uint64_t hook_runs = layout.model_hook_runs();
  expect_flat("load_session_reload", [&] {
    LayoutLoad reload = load_layout(layout, checkpoint_, LoadMode::kReload, options_);
    ASSERT_EQ(reload.counters.model_hook_runs, 1u);
  });
  // Storage never moves, and the hook ran once per reload: every reload (warm-ups too) after the cold load.
  EXPECT_EQ(storage_addresses(layout), addresses);
  EXPECT_EQ(layout.model_hook_runs(), hook_runs + static_cast<uint64_t>(iterations() + kWarmUps));
}

}  // namespace
}  // namespace weightstream

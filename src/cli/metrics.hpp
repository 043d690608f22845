#pragma once
// Prometheus metrics of the long-running commands (issue 47): `serve` and the update
// receiver of `audit --via` take --metrics-listen HOST:PORT and answer GET /metrics there,
// in Prometheus' text format, written by prometheus-cpp (an optional dependency:
// metrics_prometheus.cpp where it was found at build time, metrics_prometheus_fallback.cpp
// otherwise). Every series is listed in docs/METRICS.md.
//
// Values are read when a scrape comes: each part of a command publishes a function that
// returns its series (a Publication), and withdraws it, by destroying the Publication,
// before what that function reads goes away.

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "weightstream/peer.hpp"
#include "weightstream/storage.hpp"
#include "weightstream/stream.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream::cli {

/// --metrics-listen, --link-rate and --metrics-linger of one command.
struct MetricsFlags {
  std::string listen;        ///< empty: no metrics endpoint
  double link_rate_gbps = 0;  ///< --link-rate: the rate the load's link is stated to carry (0: none stated)
  double linger_seconds = 0;  ///< --metrics-linger: how long the endpoint outlives a load
  bool requested() const noexcept { return !listen.empty(); }
};

/// Adds --metrics-listen and --link-rate (which needs it) to `command`; returns the former.
CLI::Option* add_metrics_flags(CLI::App& command, MetricsFlags& flags);
/// Adds --metrics-linger (which needs --metrics-listen) to a command that ends after its
/// load (`load`, `export`).
void add_metrics_linger_flag(CLI::App& command, MetricsFlags& flags);

/// The HOST:PORT that --metrics-listen `text` names: "HOST:PORT", "[IPv6]:PORT", or a
/// bare "PORT" on loopback (127.0.0.1); port 0 picks a free one. Throws
/// Error(kInvalidArgument) naming the flag and the text for anything else.
std::pair<std::string, uint16_t> metrics_listen_address(const std::string& text);

enum class MetricType { kCounter, kGauge, kHistogram };

/// One sample of a series: its labels and its value (for a histogram: its buckets).
struct MetricSample {
  std::vector<std::pair<std::string, std::string>> labels;
  double value = 0;
  /// Histograms: (upper bound, observations at most that bound), ascending, without +Inf;
  /// `value` is the sum of the observations, `count` their number.
  std::vector<std::pair<double, uint64_t>> buckets;
  uint64_t count = 0;
};

/// A series as a scrape shows it: name, help text, type and samples.
struct MetricSeries {
  std::string name;
  std::string help;
  MetricType type = MetricType::kGauge;
  std::vector<MetricSample> samples;
};

using MetricsCollect = std::function<std::vector<MetricSeries>()>;

/// A function whose series every scrape shows, until withdrawn.
class PublishedSeries {
 public:
  explicit PublishedSeries(MetricsCollect collect) : collect_(std::move(collect)) {}
  /// The series now; none once withdrawn.
  std::vector<MetricSeries> collect() const;
  /// No scrape calls the function after this returns (it waits for one that is calling it).
  void withdraw();
  bool withdrawn() const;

 private:
  mutable std::mutex mutex_;
  MetricsCollect collect_;
};

/// Withdraws its series when destroyed: a command keeps it no longer than what the
/// function reads.
class Publication {
 public:
  Publication() = default;
  explicit Publication(std::shared_ptr<PublishedSeries> series) : series_(std::move(series)) {}
  ~Publication() {
    if (series_) series_->withdraw();
  }
  Publication(Publication&&) noexcept = default;
  Publication& operator=(Publication&& other) noexcept {
    if (series_) series_->withdraw();
    series_ = std::move(other.series_);
    return *this;
  }

 private:
  std::shared_ptr<PublishedSeries> series_;
};

/// An HTTP endpoint that answers GET /metrics with the series of every function published
/// on it. Owns its server threads; stops them when destroyed.
class MetricsEndpoint {
 public:
  /// Listens on `listen` (metrics_listen_address). Throws Error(kInvalidArgument) for a
  /// malformed address, Error(kNetwork) naming the address and the cause (a port in use)
  /// when it cannot listen, Error(kUnsupported) in a build without prometheus-cpp.
  explicit MetricsEndpoint(const std::string& listen);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  /// "HOST:PORT" it listens on (the port it was given, or the one picked for port 0).
  const std::string& address() const noexcept;

  /// While the returned Publication lives, every scrape calls `collect` (on a server
  /// thread: it must be safe against the threads that change what it reads) and shows its
  /// series.
  [[nodiscard]] Publication publish(MetricsCollect collect);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// publish() on `endpoint` where there is one; an empty Publication otherwise.
[[nodiscard]] Publication publish(MetricsEndpoint* endpoint, MetricsCollect collect);

/// Starts the endpoint of `flags` (none when not requested) and says where it is on stderr
/// ("weightstream: metrics at http://HOST:PORT/metrics").
std::unique_ptr<MetricsEndpoint> start_metrics(const MetricsFlags& flags);

/// What a load did (a plain `load`, or the cold load a command makes before it serves or
/// receives), as the series weightstream_load_* and weightstream_storage_* show it
/// (docs/METRICS.md).
struct LoadRecord {
  std::string source;  ///< the storage kind: file, s3, gs, az or peer
  uint64_t bytes_read = 0;  ///< from storage, or from peers
  double seconds = 0;
  /// Seconds the readers spent in each phase, summed over the reader threads (read,
  /// deliver, staging_wait: StreamStats); none for a pull from peers.
  std::vector<std::pair<std::string, double>> phases;
  StorageStats storage;  ///< the storage's requests (zero for local files and peers)
  /// Checksum mismatches of the storage's reads and digest mismatches of the peers' bytes.
  uint64_t digest_failures = 0;
  std::vector<PeerBytes> peers;  ///< bytes from each serving peer, a failed pull's included
  double link_rate_gbps = 0;     ///< --link-rate (0: none stated, no efficiency shown)
};
/// The storage kind of a checkpoint URI, as the `source` label shows it.
std::string storage_kind(const std::string& uri);
/// The record of a stream from `uri`, with the storage requests of the stream.
LoadRecord stream_load_record(const std::string& uri, const StreamStats& stream);
/// The record of a load of `checkpoint` by `stream`, with every request its storage sent
/// since it was opened (the headers, index and config read by Checkpoint::open included).
LoadRecord checkpoint_load_record(const Checkpoint& checkpoint, const StreamStats& stream);
std::vector<MetricSeries> load_series(const LoadRecord& load);
/// Publishes the series of `load` (on `endpoint`, where there is one), with the link rate
/// of `flags`.
[[nodiscard]] Publication publish_load(MetricsEndpoint* endpoint, LoadRecord load, const MetricsFlags& flags);

/// A load under way, as weightstream_load_progress_bytes and weightstream_load_planned_bytes
/// show it while it runs (and after, at their final values). Thread-safe: the loading thread
/// updates, a scrape reads.
class LoadProgress {
 public:
  /// A progress callback that records into this (it must outlive the load).
  ProgressCallback observer();
  std::vector<MetricSeries> series() const;

 private:
  std::atomic<uint64_t> done_{0};
  std::atomic<uint64_t> total_{0};
};

/// After a load: keeps `endpoint` (where there is one) up for flags.linger_seconds, or until
/// SIGINT or SIGTERM, saying so on stderr, so that a scraper sees the load's final values.
void linger_metrics(const MetricsEndpoint* endpoint, const MetricsFlags& flags);

/// The series of a peer server (weightstream_peer_*) from its stats.
std::vector<MetricSeries> peer_server_series(const PeerServeStats& stats);

/// The series of an update receiver's own counters (weightstream_update_*: senders,
/// refusals, updates started and failed, one under way) for `transport`.
std::vector<MetricSeries> update_receiver_series(const ReceiverStats& stats, const std::string& transport);

/// What an update receiver has applied, for weightstream_update_* (docs/METRICS.md).
/// Thread-safe: the receiving thread records, a scrape reads.
class UpdateMetrics {
 public:
  explicit UpdateMetrics(std::string transport);
  /// One update applied whole.
  void completed(const UpdateReport& report);
  std::vector<MetricSeries> series() const;

 private:
  mutable std::mutex mutex_;
  std::string transport_;
  uint64_t completed_ = 0;
  uint64_t bytes_ = 0;
  uint64_t tensors_ = 0;
  double seconds_sum_ = 0;
  std::vector<uint64_t> seconds_buckets_;  ///< observations at most each kUpdateSecondsBuckets bound
  UpdatePhases phases_;
  double last_completed_unix_seconds_ = 0;
};

}  // namespace weightstream::cli

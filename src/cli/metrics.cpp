// The parts of the metrics that need no Prometheus library: the flag, the series each part
// of a command publishes, and the publications (metrics.hpp). The HTTP endpoint itself is
// metrics_prometheus.cpp.
#include "cli/metrics.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream::cli {
namespace {

/// Upper bounds of the buckets of weightstream_update_duration_seconds: from a small
/// model's update over shm to a large one's across hosts.
constexpr double kUpdateSecondsBuckets[] = {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};

MetricSeries one_sample(std::string name, std::string help, MetricType type, double value,
                    std::vector<std::pair<std::string, std::string>> labels = {}) {
  MetricSeries result{std::move(name), std::move(help), type, {}};
  result.samples.push_back(MetricSample{std::move(labels), value, {}, 0});
  return result;
}

/// A check that a flag's value is a finite number of `unit` above 0 (or at least 0).
CLI::Validator positive_number(const std::string& unit, bool zero_allowed = false) {
  return CLI::Validator(
      [unit, zero_allowed](std::string& text) -> std::string {
        double value = 0;
        size_t used = 0;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        const bool good = used == text.size() && std::isfinite(value) && (zero_allowed ? value >= 0 : value > 0);
        if (good) return {};
        // CLI11 puts the flag's name before it: "--link-rate: '0' is not a number above 0 (GB/s)".
        return "'" + text + "' is not a number " + (zero_allowed ? "of at least 0" : "above 0") + " (" + unit + ")";
      },
      unit);
}

bool is_port_text(const std::string& text) {
  return !text.empty() && text.size() <= 5 && text.find_first_not_of("0123456789") == std::string::npos &&
         std::stoul(text) <= 65535;
}

/// The write end of the pipe StopSignals waits on: its signal handler writes the signal there.
std::atomic<int> stop_signal_pipe{-1};

extern "C" void note_stop_signal(int signal) {
  const char byte = static_cast<char>(signal);
  [[maybe_unused]] const ssize_t written = ::write(stop_signal_pipe.load(), &byte, 1);
}

/// SIGINT and SIGTERM, while it lives, end wait() instead of the process (whichever thread
/// they reach: a handler writes to a pipe, which wait() polls); the former handlers come back
/// when it goes.
class StopSignals {
 public:
  StopSignals() {
    WS_EXPECT(::pipe2(fds_, O_CLOEXEC | O_NONBLOCK) == 0, ErrorCode::kIo,
              std::string("cannot create the pipe that SIGINT and SIGTERM end --metrics-linger through: ") +
                  std::strerror(errno));
    stop_signal_pipe = fds_[1];
    struct sigaction action {};
    action.sa_handler = note_stop_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGINT, &action, &previous_int_);
    ::sigaction(SIGTERM, &action, &previous_term_);
  }
  ~StopSignals() {
    ::sigaction(SIGINT, &previous_int_, nullptr);
    ::sigaction(SIGTERM, &previous_term_, nullptr);
    stop_signal_pipe = -1;
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  /// The signal that came within `seconds`, or 0 when none did.
  int wait(double seconds) const {
    using Clock = std::chrono::steady_clock;
    // At most about 31 years: a longer wait would overflow the clock's count.
    const std::chrono::duration<double> wanted(std::min(seconds, 1e9));
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(wanted);
    for (auto now = Clock::now(); now < deadline; now = Clock::now()) {
      const double left_ms = std::chrono::duration<double, std::milli>(deadline - now).count();
      pollfd ready{fds_[0], POLLIN, 0};
      if (::poll(&ready, 1, static_cast<int>(std::clamp(std::ceil(left_ms), 1.0, 86'400'000.0))) <= 0) continue;
      char signal = 0;
      if (::read(fds_[0], &signal, 1) == 1) return signal;
    }
    return 0;
  }

 private:
  int fds_[2] = {-1, -1};
  struct sigaction previous_int_ {};
  struct sigaction previous_term_ {};
};

}  // namespace

CLI::Option* add_metrics_flags(CLI::App& command, MetricsFlags& flags) {
  CLI::Option* listen = command.add_option(
      "--metrics-listen", flags.listen,
      "Serve Prometheus metrics at http://HOST:PORT/metrics (a bare PORT listens on 127.0.0.1; port 0 "
      "picks a free one, printed on stderr); the series are in docs/METRICS.md");
  command
      .add_option("--link-rate", flags.link_rate_gbps,
                  "The rate in GB/s the load's link (NIC, disk, bucket) is stated to carry: the metrics show the "
                  "achieved rate against it (weightstream_load_link_efficiency)")
      ->check(positive_number("GB/s"))
      ->needs(listen);
  return listen;
}

void add_metrics_linger_flag(CLI::App& command, MetricsFlags& flags) {
  command
      .add_option("--metrics-linger", flags.linger_seconds,
                  "Seconds the metrics endpoint stays up after the load, so that a scraper sees its final values; "
                  "SIGINT or SIGTERM ends the wait (default 0)")
      ->check(positive_number("seconds", /*zero_allowed=*/true))
      ->needs(command.get_option("--metrics-listen"));
}

std::pair<std::string, uint16_t> metrics_listen_address(const std::string& text) {
  const std::string what = "--metrics-listen '" + text + "'";
  std::string host = "127.0.0.1";
  std::string port = text;
  if (text.starts_with('[')) {
    const size_t close = text.find(']');
    WS_EXPECT(close != std::string::npos && close > 1 && close + 1 < text.size() && text[close + 1] == ':',
              ErrorCode::kInvalidArgument, what + " is not [IPv6]:PORT");
    host = text.substr(0, close + 1);
    port = text.substr(close + 2);
  } else if (const size_t colon = text.rfind(':'); colon != std::string::npos) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    WS_EXPECT(!host.empty() && host.find(':') == std::string::npos, ErrorCode::kInvalidArgument,
              what + " is not HOST:PORT (an IPv6 host goes in brackets: [::1]:PORT)");
  }
  WS_EXPECT(is_port_text(port), ErrorCode::kInvalidArgument,
            what + " is not HOST:PORT or PORT with a port from 0 to 65535");
  return {host, static_cast<uint16_t>(std::stoul(port))};
}

std::vector<MetricSeries> PublishedSeries::collect() const {
  std::lock_guard lock(mutex_);
  return collect_ ? collect_() : std::vector<MetricSeries>{};
}

void PublishedSeries::withdraw() {
  std::lock_guard lock(mutex_);
  collect_ = nullptr;
}

bool PublishedSeries::withdrawn() const {
  std::lock_guard lock(mutex_);
  return !collect_;
}

Publication publish(MetricsEndpoint* endpoint, MetricsCollect collect) {
  return endpoint ? endpoint->publish(std::move(collect)) : Publication();
}

std::unique_ptr<MetricsEndpoint> start_metrics(const MetricsFlags& flags) {
  if (!flags.requested()) return nullptr;
  auto endpoint = std::make_unique<MetricsEndpoint>(flags.listen);
  std::fprintf(stderr, "weightstream: metrics at http://%s/metrics\n", endpoint->address().c_str());
  std::fflush(stderr);
  return endpoint;
}

std::string storage_kind(const std::string& uri) {
  for (const char* scheme : {"s3", "gs", "az", "peer"}) {
    if (uri.starts_with(std::string(scheme) + "://")) return scheme;
  }
  // https://ACCOUNT.blob.core.windows.net/… is Azure Blob too.
  try {
    if (parse_uri(uri).scheme == Uri::Scheme::kAzure) return "az";
  } catch (const Error&) {
  }
  return "file";
}

LoadRecord stream_load_record(const std::string& uri, const StreamStats& stream) {
  LoadRecord load;
  load.source = storage_kind(uri);
  load.bytes_read = stream.bytes_read;
  load.seconds = stream.seconds;
  load.phases = {{"read", stream.read_seconds},
                 {"deliver", stream.deliver_seconds},
                 {"staging_wait", stream.staging_wait_seconds}};
  load.storage = {stream.storage_requests, stream.storage_retries, stream.storage_checksum_failures};
  load.digest_failures = stream.storage_checksum_failures;
  return load;
}

LoadRecord checkpoint_load_record(const Checkpoint& checkpoint, const StreamStats& stream) {
  LoadRecord load = stream_load_record(checkpoint.uri(), stream);
  load.storage = checkpoint.storage().stats();
  load.digest_failures = load.storage.checksum_failures;
  return load;
}

std::vector<MetricSeries> load_series(const LoadRecord& load) {
  auto count = [](uint64_t value) { return static_cast<double>(value); };
  const std::vector<std::pair<std::string, std::string>> source = {{"source", load.source}};
  std::vector<MetricSeries> result = {
      one_sample("weightstream_load_read_bytes_total", "Bytes the load read from its source (storage or peers)",
                 MetricType::kCounter, count(load.bytes_read), source),
      one_sample("weightstream_load_duration_seconds", "Seconds the load took, from planning to the model hook",
                 MetricType::kGauge, load.seconds, source),
      one_sample("weightstream_storage_requests_total", "Requests the load sent to its object store",
                 MetricType::kCounter, count(load.storage.requests), source),
      one_sample("weightstream_storage_retries_total",
                 "Requests sent again after a retryable failure (5xx, 429, a reset, a stall)", MetricType::kCounter,
                 count(load.storage.retries), source),
      one_sample("weightstream_load_digest_failures_total",
                 "Bytes that did not match their digest or stored checksum (storage reads, peers' parameters)",
                 MetricType::kCounter, count(load.digest_failures), source),
  };
  MetricSeries phases{"weightstream_load_phase_seconds",
                      "Seconds the load's readers spent in each phase, summed over the reader threads",
                      MetricType::kGauge, {}};
  for (const auto& [phase, seconds] : load.phases) {
    phases.samples.push_back(MetricSample{{{"source", load.source}, {"phase", phase}}, seconds, {}, 0});
  }
  if (!phases.samples.empty()) result.push_back(std::move(phases));
  MetricSeries peers{"weightstream_load_peer_read_bytes_total", "Bytes the load read from each serving peer",
                     MetricType::kCounter, {}};
  for (const PeerBytes& peer : load.peers) {
    peers.samples.push_back(MetricSample{{{"peer", peer.address}, {"transport", peer.transports}}, count(peer.bytes), {}, 0});
  }
  if (!peers.samples.empty()) result.push_back(std::move(peers));
  if (load.link_rate_gbps > 0) {
    const double stated = load.link_rate_gbps * 1e9;
    const double achieved = load.seconds > 0 ? static_cast<double>(load.bytes_read) / load.seconds : 0;
    result.push_back(one_sample("weightstream_load_link_rate_bytes_per_second",
                                "The rate the load's link is stated to carry (--link-rate)", MetricType::kGauge,
                                stated, source));
    result.push_back(one_sample("weightstream_load_link_efficiency",
                                "The load's achieved rate (bytes read / seconds) against the stated link rate",
                                MetricType::kGauge, achieved / stated, source));
  }
  return result;
}

Publication publish_load(MetricsEndpoint* endpoint, LoadRecord load, const MetricsFlags& flags) {
  load.link_rate_gbps = flags.link_rate_gbps;
  return publish(endpoint, [load = std::move(load)] { return load_series(load); });
}

ProgressCallback LoadProgress::observer() {
  return [this](uint64_t done, uint64_t total) {
    total_ = total;
    done_ = done;
  };
}

std::vector<MetricSeries> LoadProgress::series() const {
  return {one_sample("weightstream_load_progress_bytes", "Bytes the load under way has delivered so far",
                     MetricType::kGauge, static_cast<double>(done_.load())),
          one_sample("weightstream_load_planned_bytes", "Bytes the load under way delivers in all", MetricType::kGauge,
                     static_cast<double>(total_.load()))};
}

void linger_metrics(const MetricsEndpoint* endpoint, const MetricsFlags& flags) {
  if (endpoint == nullptr || flags.linger_seconds <= 0) return;
  StopSignals signals;  // before the line below: a scraper that reads it may signal at once
  std::fflush(stdout);
  std::fprintf(stderr, "weightstream: metrics stay at http://%s/metrics for %g s (SIGINT or SIGTERM ends the wait)\n",
               endpoint->address().c_str(), flags.linger_seconds);
  std::fflush(stderr);
  if (const int received = signals.wait(flags.linger_seconds); received != 0) {
    std::fprintf(stderr, "weightstream: metrics endpoint closed by %s\n", received == SIGINT ? "SIGINT" : "SIGTERM");
  }
}

std::vector<MetricSeries> peer_server_series(const PeerServeStats& stats) {
  auto value = [](uint64_t count) { return static_cast<double>(count); };
  return {
      one_sample("weightstream_peer_pullers_connected", "Pullers past the handshake, connected now", MetricType::kGauge,
                 value(stats.pullers_connected)),
      one_sample("weightstream_peer_pullers_accepted_total", "Pullers that proved the token", MetricType::kCounter,
                 value(stats.pullers_accepted)),
      one_sample("weightstream_peer_manifests_sent_total", "Manifests sent to pullers (one per pull)",
                 MetricType::kCounter, value(stats.manifests_sent)),
      one_sample("weightstream_peer_pulls_completed_total",
                 "Pulls that read their bytes and asked at their end whether the version still holds",
                 MetricType::kCounter, value(stats.pulls_completed)),
      one_sample("weightstream_peer_connections_refused_total",
                 "Connections refused or dropped (each logged on stderr)", MetricType::kCounter,
                 value(stats.connections_refused)),
      one_sample("weightstream_peer_sent_bytes_total",
                 "Parameter bytes sent on pullers' requests (UCX rendezvous; one-sided RMA reads are not seen)",
                 MetricType::kCounter, value(stats.bytes_sent)),
      one_sample("weightstream_peer_served_parameters", "Parameters published", MetricType::kGauge,
                 value(stats.parameters)),
      one_sample("weightstream_peer_served_bytes", "Bytes of the parameters published", MetricType::kGauge,
                 value(stats.parameter_bytes)),
      one_sample("weightstream_peer_version", "Version of the parameters published (changes with every update)",
                 MetricType::kGauge, value(stats.version)),
      one_sample("weightstream_peer_updating", "1 while the published parameters are being updated", MetricType::kGauge,
                 stats.updating ? 1 : 0),
      one_sample("weightstream_peer_content_info", "1, labelled with the content digest published (empty: unknown)",
                 MetricType::kGauge, 1, {{"content_digest", stats.content_digest}}),
  };
}

std::vector<MetricSeries> update_receiver_series(const ReceiverStats& stats, const std::string& transport) {
  auto value = [](uint64_t count) { return static_cast<double>(count); };
  const std::vector<std::pair<std::string, std::string>> labels = {{"transport", transport}};
  return {
      one_sample("weightstream_update_senders_accepted_total", "Senders that proved the token and were welcomed",
                 MetricType::kCounter, value(stats.senders_accepted), labels),
      one_sample("weightstream_update_connections_refused_total",
                 "Peers refused or dropped before an update (each logged on stderr)", MetricType::kCounter,
                 value(stats.connections_refused), labels),
      one_sample("weightstream_updates_started_total", "Updates whose START arrived", MetricType::kCounter,
                 value(stats.updates_started), labels),
      one_sample("weightstream_updates_failed_total", "Updates started that failed, were cancelled or refused",
                 MetricType::kCounter, value(stats.updates_failed), labels),
      one_sample("weightstream_update_in_progress", "1 while an update is under way (START arrived, not ended)",
                 MetricType::kGauge, stats.updating ? 1 : 0, labels),
  };
}

UpdateMetrics::UpdateMetrics(std::string transport)
    : transport_(std::move(transport)), seconds_buckets_(std::size(kUpdateSecondsBuckets), 0) {}

void UpdateMetrics::completed(const UpdateReport& report) {
  std::lock_guard lock(mutex_);
  ++completed_;
  bytes_ += report.bytes + report.shared_bytes;
  tensors_ += report.tensors;
  seconds_sum_ += report.seconds;
  for (size_t i = 0; i < std::size(kUpdateSecondsBuckets); ++i) {
    if (report.seconds <= kUpdateSecondsBuckets[i]) ++seconds_buckets_[i];
  }
  for (const auto& [name, phase] : kUpdatePhases) phases_.*phase += report.phases.*phase;
  last_completed_unix_seconds_ =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::vector<MetricSeries> UpdateMetrics::series() const {
  std::lock_guard lock(mutex_);
  const std::vector<std::pair<std::string, std::string>> transport = {{"transport", transport_}};
  std::vector<MetricSeries> result = {
      one_sample("weightstream_updates_completed_total", "Pushed updates applied whole", MetricType::kCounter,
                 static_cast<double>(completed_), transport),
      one_sample("weightstream_update_received_bytes_total",
                 "Tensor bytes of the updates applied (through buckets and read in place)", MetricType::kCounter,
                 static_cast<double>(bytes_), transport),
      one_sample("weightstream_update_tensors_total", "Tensors of the updates applied", MetricType::kCounter,
                 static_cast<double>(tensors_), transport),
      one_sample("weightstream_update_last_completed_timestamp_seconds",
                 "Unix time the last update was applied (0: none yet)", MetricType::kGauge,
                 last_completed_unix_seconds_, transport),
  };
  MetricSeries duration{"weightstream_update_duration_seconds", "Seconds from an update's START to its end of finish()",
                        MetricType::kHistogram, {}};
  MetricSample histogram{transport, seconds_sum_, {}, completed_};
  for (size_t i = 0; i < std::size(kUpdateSecondsBuckets); ++i) {
    histogram.buckets.emplace_back(kUpdateSecondsBuckets[i], seconds_buckets_[i]);
  }
  duration.samples.push_back(std::move(histogram));
  result.push_back(std::move(duration));
  MetricSeries phases{"weightstream_update_phase_seconds_total",
                      "Seconds the updates applied spent in each phase (UpdatePhases)", MetricType::kCounter, {}};
  for (const auto& [name, phase] : kUpdatePhases) {
    phases.samples.push_back(MetricSample{{{"transport", transport_}, {"phase", name}}, phases_.*phase, {}, 0});
  }
  result.push_back(std::move(phases));
  return result;
}

}  // namespace weightstream::cli

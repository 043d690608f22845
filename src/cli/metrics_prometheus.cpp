// The /metrics endpoint through prometheus-cpp: its Exposer (an embedded civetweb server)
// answers each scrape with the families one Collectable builds from the publications,
// written in Prometheus' text format by prometheus-cpp's serializer.
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include "cli/metrics.hpp"
#include "weightstream/error.hpp"

namespace weightstream::cli {
namespace {

prometheus::MetricType prometheus_type(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return prometheus::MetricType::Counter;
    case MetricType::kHistogram:
      return prometheus::MetricType::Histogram;
    case MetricType::kGauge:
      break;
  }
  return prometheus::MetricType::Gauge;
}

prometheus::ClientMetric client_metric(const MetricSample& sample, MetricType type) {
  prometheus::ClientMetric metric;
  for (const auto& [name, value] : sample.labels) metric.label.push_back({name, value});
  switch (type) {
    case MetricType::kCounter:
      metric.counter.value = sample.value;
      break;
    case MetricType::kGauge:
      metric.gauge.value = sample.value;
      break;
    case MetricType::kHistogram:
      metric.histogram.sample_count = sample.count;
      metric.histogram.sample_sum = sample.value;
      for (const auto& [bound, count] : sample.buckets) metric.histogram.bucket.push_back({count, bound});
      metric.histogram.bucket.push_back({sample.count, std::numeric_limits<double>::infinity()});
      break;
  }
  return metric;
}

/// The series of every publication, as prometheus-cpp's families.
class ScrapedSeries final : public prometheus::Collectable {
 public:
  void add(std::shared_ptr<PublishedSeries> series) {
    std::lock_guard lock(mutex_);
    std::erase_if(published_, [](const auto& each) { return each->withdrawn(); });
    published_.push_back(std::move(series));
  }
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<std::shared_ptr<PublishedSeries>> published;
    {
      std::lock_guard lock(mutex_);
      published = published_;
    }
    std::vector<prometheus::MetricFamily> families;
    for (const auto& each : published) {
      for (const MetricSeries& series : each->collect()) {
        prometheus::MetricFamily family{series.name, series.help, prometheus_type(series.type), {}};
        for (const MetricSample& sample : series.samples) family.metric.push_back(client_metric(sample, series.type));
        families.push_back(std::move(family));
      }
    }
    return families;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<PublishedSeries>> published_;
};

/// Why nothing could listen on `host`:`port`: the errno of a bind of our own (civetweb says
/// only "possible problem binding to port").
std::string bind_failure(const std::string& host, uint16_t port) {
  std::string bare = host.starts_with('[') ? host.substr(1, host.size() - 2) : host;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int status = ::getaddrinfo(bare.c_str(), std::to_string(port).c_str(), &hints, &found); status != 0) {
    return ::gai_strerror(status);
  }
  // Our own bind worked: the address is one civetweb does not take (an IPv6 one, where it
  // was built without IPv6, as Debian 12's was).
  std::string reason = "prometheus-cpp's HTTP server (civetweb) refused the address";
  for (addrinfo* candidate = found; candidate != nullptr; candidate = candidate->ai_next) {
    int fd = ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC, candidate->ai_protocol);
    if (fd < 0) continue;
    const int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (::bind(fd, candidate->ai_addr, candidate->ai_addrlen) != 0) reason = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return reason;
}

}  // namespace

struct MetricsEndpoint::State {
  std::unique_ptr<prometheus::Exposer> exposer;
  std::shared_ptr<ScrapedSeries> scraped = std::make_shared<ScrapedSeries>();
  std::string address;
};

MetricsEndpoint::MetricsEndpoint(const std::string& listen) : state_(std::make_unique<State>()) {
  const auto [host, port] = metrics_listen_address(listen);
  const std::string requested = host + ":" + std::to_string(port);
  try {
    // Two threads: a scrape never waits behind another, and a stalled client holds one.
    state_->exposer = std::make_unique<prometheus::Exposer>(requested, 2);
  } catch (const std::exception& error) {
    WS_FAIL(ErrorCode::kNetwork,
            "cannot serve metrics on " + requested + " (--metrics-listen): " + bind_failure(host, port));
  }
  const std::vector<int> ports = state_->exposer->GetListeningPorts();
  WS_EXPECT(!ports.empty(), ErrorCode::kNetwork, "cannot serve metrics on " + requested + ": no port was bound");
  state_->address = host + ":" + std::to_string(ports.front());
  state_->exposer->RegisterCollectable(state_->scraped);
}

MetricsEndpoint::~MetricsEndpoint() = default;

const std::string& MetricsEndpoint::address() const noexcept { return state_->address; }

Publication MetricsEndpoint::publish(MetricsCollect collect) {
  auto series = std::make_shared<PublishedSeries>(std::move(collect));
  state_->scraped->add(series);
  return Publication(std::move(series));
}

}  // namespace weightstream::cli

// A build without prometheus-cpp: --metrics-listen is refused, saying why.
#include "cli/metrics.hpp"
#include "weightstream/error.hpp"

namespace weightstream::cli {

struct MetricsEndpoint::State {
  std::string address;
};

MetricsEndpoint::MetricsEndpoint(const std::string& listen) {
  metrics_listen_address(listen);  // a malformed address is the usage error it is anywhere
  WS_FAIL(ErrorCode::kUnsupported,
          "--metrics-listen " + listen +
              ": this weightstream was built without prometheus-cpp (install prometheus-cpp-dev and rebuild)");
}

MetricsEndpoint::~MetricsEndpoint() = default;

const std::string& MetricsEndpoint::address() const noexcept { return state_->address; }

Publication MetricsEndpoint::publish(MetricsCollect) { return Publication(); }

}  // namespace weightstream::cli

// stat_fields of a stream's counters (stream.hpp).
#include "weightstream/stream.hpp"

namespace weightstream {

std::vector<StatField> stat_fields(const StreamStats& stats) {
  return {{"tensors", stats.tensors},
          {"bytes", stats.bytes},
          {"bytes_read", stats.bytes_read},
          {"reads", stats.reads},
          {"shards_read", stats.shards_read},
          {"seconds", stats.seconds},
          {"gbps", stats.gbps()},
          {"peak_staging_bytes", stats.peak_staging_bytes},
          {"read_seconds", stats.read_seconds},
          {"deliver_seconds", stats.deliver_seconds},
          {"staging_wait_seconds", stats.staging_wait_seconds},
          {"storage_requests", stats.storage_requests},
          {"storage_retries", stats.storage_retries},
          {"storage_checksum_failures", stats.storage_checksum_failures}};
}

}  // namespace weightstream

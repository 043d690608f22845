// stat_fields of a load's counters (model.hpp).
#include "weightstream/model.hpp"

namespace weightstream {

std::vector<StatField> stat_fields(const LoadCounters& counters) {
  return {{"tensors_applied", counters.tensors_applied},
          {"bytes_applied", counters.bytes_applied},
          {"tensors_skipped", counters.tensors_skipped},
          {"parameters_completed", counters.parameters_completed},
          {"layer_processing_runs", counters.layer_processing_runs},
          {"model_hook_runs", counters.model_hook_runs},
          {"held_bytes_copied", counters.held_bytes_copied},
          {"held_bytes_on_device", counters.held_bytes_on_device}};
}

}  // namespace weightstream

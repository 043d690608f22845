// Fuzzes config.json parsing. An accepted config must hold the ranges the parser promises,
// since the model layer sizes allocations from them.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "weightstream/error.hpp"
#include "weightstream/format.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view json(reinterpret_cast<const char*>(data), size);
  weightstream::ModelConfig config;
  try {
    config = weightstream::parse_model_config("config.json", json);
  } catch (const weightstream::Error&) {
    return 0;
  }
  constexpr int64_t kMaxDimension = int64_t{1} << 20;
  constexpr int64_t kMaxCount = int64_t{1} << 16;
  auto in = [](int64_t value, int64_t low, int64_t high) { return value >= low && value <= high; };
  if (!in(config.hidden_size, 1, kMaxDimension) || !in(config.vocab_size, 1, kMaxDimension) ||
      !in(config.num_hidden_layers, 1, kMaxCount) || !in(config.num_attention_heads, 1, kMaxCount) ||
      !in(config.num_key_value_heads, 1, config.num_attention_heads) ||
      config.num_attention_heads % config.num_key_value_heads != 0 || config.head_dim < 1 ||
      !in(config.first_k_dense_replace, 0, config.num_hidden_layers)) {
    std::abort();
  }
  return 0;
}

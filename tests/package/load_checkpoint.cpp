// Loads a checkpoint through the installed weightstream package and checks every tensor it
// loaded against the same bytes read from storage by a plain ranged read. Prints one line:
// "loaded N tensors, B bytes from URI: every byte matches"; exits 1 on a mismatch and 2 on
// a weightstream::Error (its message on stderr).
#include <cstdio>
#include <cstring>
#include <vector>

#include <weightstream/device.hpp>
#include <weightstream/error.hpp>
#include <weightstream/load.hpp>
#include <weightstream/options.hpp>
#include <weightstream/stream.hpp>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT\n", argv[0]);
    return 2;
  }
  try {
    auto options = weightstream::options_from_environment(weightstream::process_environment());
    auto checkpoint = weightstream::Checkpoint::open(argv[1], options);
    auto loaded = weightstream::load_checkpoint(checkpoint, weightstream::parse_device("cpu"), options.stream);

    const auto& tensors = checkpoint.tensors();
    if (loaded.tensors.size() != tensors.size()) {
      std::fprintf(stderr, "loaded %zu tensors of %zu\n", loaded.tensors.size(), tensors.size());
      return 1;
    }
    uint64_t total = 0;
    std::vector<std::byte> expected;
    for (const auto& tensor : loaded.tensors) {
      const auto& info = tensors[tensor.tensor];
      expected.resize(info.bytes);
      checkpoint.storage().read(checkpoint.shards()[info.shard].name, info.offset, expected);
      if (tensor.bytes != info.bytes || std::memcmp(tensor.data, expected.data(), info.bytes) != 0) {
        std::fprintf(stderr, "tensor %s: loaded bytes differ from the file's\n", info.name.c_str());
        return 1;
      }
      total += tensor.bytes;
    }
    std::printf("loaded %zu tensors, %llu bytes from %s: every byte matches\n", loaded.tensors.size(),
                static_cast<unsigned long long>(total), checkpoint.uri().c_str());
    return 0;
  } catch (const weightstream::Error& error) {
    std::fprintf(stderr, "weightstream: %s\n", error.what());
    return 2;
  }
}

// Issue 19 probe: DMA straight from registered page-cache mappings of whole shards (what
// InstantTensor's binary does for some loads), against the same with registration in
// windows. One thread a shard maps it read-only, registers it (cudaHostRegisterReadOnly)
// whole or window by window, and copies each registered range to the device on its own
// stream, so registering the next window overlaps the copy of the last; then unregisters.
// Prints when the last copy finished and when everything was unregistered.
//
//   nvcc -O2 -std=c++17 -o /tmp/register_probe bench/register_probe.cu
//   /tmp/register_probe /tmp/ws-gpu-bench/*.safetensors     # files warm in the page cache
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using Clock = std::chrono::steady_clock;
static double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
#define CHECK(call)                                                                       \
  do {                                                                                    \
    cudaError_t status = (call);                                                          \
    if (status != cudaSuccess) {                                                          \
      std::printf("%s: %s\n", #call, cudaGetErrorString(status));                         \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

struct Shard {
  int fd;
  size_t size;
  char* map;
};

int main(int argc, char** argv) {
  std::vector<Shard> shards;
  size_t total = 0;
  for (int i = 1; i < argc; ++i) {
    int fd = open(argv[i], O_RDONLY);
    struct stat info {};
    if (fd < 0 || fstat(fd, &info) != 0) {
      std::printf("cannot open %s\n", argv[i]);
      return 1;
    }
    shards.push_back({fd, static_cast<size_t>(info.st_size), nullptr});
    total += info.st_size;
  }
  CHECK(cudaSetDevice(0));
  char* device = nullptr;
  CHECK(cudaMalloc(&device, total));
  const size_t windows[] = {0, 1ull << 30, 256ull << 20};  // 0: the whole shard at once
  for (int round = 0; round < 2; ++round) {
    for (size_t window : windows) {
      for (auto& shard : shards) shard.map = static_cast<char*>(mmap(nullptr, shard.size, PROT_READ, MAP_SHARED, shard.fd, 0));
      std::vector<double> registering(shards.size()), unregistering(shards.size()), copied_at(shards.size());
      auto start = Clock::now();
      std::vector<std::thread> threads;
      size_t offset = 0;
      for (size_t i = 0; i < shards.size(); ++i) {
        threads.emplace_back([&, i, offset] {
          cudaSetDevice(0);
          cudaStream_t stream;
          CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
          Shard& shard = shards[i];
          size_t step = window ? window : shard.size;
          std::vector<char*> registered;
          for (size_t at = 0; at < shard.size; at += step) {
            size_t bytes = std::min(step, shard.size - at);
            auto from = Clock::now();
            CHECK(cudaHostRegister(shard.map + at, bytes, cudaHostRegisterPortable | cudaHostRegisterReadOnly));
            registering[i] += since(from);
            registered.push_back(shard.map + at);
            CHECK(cudaMemcpyAsync(device + offset + at, shard.map + at, bytes, cudaMemcpyHostToDevice, stream));
          }
          CHECK(cudaStreamSynchronize(stream));
          copied_at[i] = since(start);
          auto from = Clock::now();
          for (char* range : registered) cudaHostUnregister(range);
          unregistering[i] = since(from);
          cudaStreamDestroy(stream);
        });
        offset += shards[i].size;
      }
      for (auto& thread : threads) thread.join();
      double all = since(start);
      double last_copy = *std::max_element(copied_at.begin(), copied_at.end());
      std::printf("window %s: copies done at %.3f s (%.1f GB/s), with unregister %.3f s (%.1f GB/s); "
                  "longest register %.3f s, unregister %.3f s\n",
                  window ? (std::to_string(window >> 20) + " MiB").c_str() : "whole shard", last_copy,
                  total / last_copy / 1e9, all, total / all / 1e9,
                  *std::max_element(registering.begin(), registering.end()),
                  *std::max_element(unregistering.begin(), unregistering.end()));
      for (auto& shard : shards) munmap(shard.map, shard.size);
    }
  }
  return 0;
}

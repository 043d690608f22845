// gather_probe: which shape of gather-copy kernel copies N tensors within one GPU fastest,
// against one cudaMemcpy of the same bytes in the same run. Decides the parameters of
// src/device/copy_kernels.cu (piece size, threads a block, loads in flight, grid size).
//
//   nvcc -O3 -std=c++17 -arch=native bench/gather_probe.cu -o gather_probe
//   ./gather_probe [GiB=16] [repeat=7]
//
// The kernel is the production one's structure (a block copies one piece with 16-byte
// loads, `Unroll` in flight a thread), written out here with its parameters as template
// arguments so that one build compares them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

struct Work {
  std::byte* destination;
  const std::byte* source;
  uint64_t bytes;
};

void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "gather_probe: %s: %s\n", what, cudaGetErrorString(error));
    std::exit(1);
  }
}

template <unsigned Threads, unsigned Unroll>
__global__ void __launch_bounds__(Threads) copy_pieces(const Work* items, size_t count) {
  for (size_t index = blockIdx.x; index < count; index += gridDim.x) {
    const Work item = items[index];
    const uint64_t words = item.bytes / 16;
    const auto* from = reinterpret_cast<const uint4*>(item.source);
    auto* to = reinterpret_cast<uint4*>(item.destination);
    uint64_t word = threadIdx.x;
    for (; word + (Unroll - 1) * Threads < words; word += Unroll * Threads) {
      uint4 values[Unroll];
#pragma unroll
      for (unsigned k = 0; k < Unroll; ++k) values[k] = from[word + k * Threads];
#pragma unroll
      for (unsigned k = 0; k < Unroll; ++k) to[word + k * Threads] = values[k];
    }
    for (; word < words; word += Threads) to[word] = from[word];
  }
}

struct Variant {
  std::string name;
  uint64_t piece_bytes;
  unsigned threads;
  unsigned unroll;
  unsigned blocks_per_sm;  // 0: one block a piece (up to 65535)
};

template <unsigned Threads, unsigned Unroll>
void launch(const Work* items, size_t count, unsigned grid) {
  copy_pieces<Threads, Unroll><<<grid, Threads>>>(items, count);
}

void launch_variant(const Variant& variant, const Work* items, size_t count, int sms) {
  unsigned grid = variant.blocks_per_sm == 0 ? static_cast<unsigned>(std::min<size_t>(count, 65535))
                                             : static_cast<unsigned>(sms) * variant.blocks_per_sm;
  if (variant.threads == 512 && variant.unroll == 4) return launch<512, 4>(items, count, grid);
  if (variant.threads == 512 && variant.unroll == 8) return launch<512, 8>(items, count, grid);
  if (variant.threads == 256 && variant.unroll == 8) return launch<256, 8>(items, count, grid);
  if (variant.threads == 1024 && variant.unroll == 4) return launch<1024, 4>(items, count, grid);
  if (variant.threads == 256 && variant.unroll == 4) return launch<256, 4>(items, count, grid);
  std::fprintf(stderr, "gather_probe: no instance for %u threads, unroll %u\n", variant.threads, variant.unroll);
  std::exit(1);
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t total = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 16) << 30;
  const int repeat = argc > 2 ? std::atoi(argv[2]) : 7;
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute");
  std::byte* source = nullptr;
  std::byte* destination = nullptr;
  check(cudaMalloc(&source, total), "cudaMalloc source");
  check(cudaMalloc(&destination, total), "cudaMalloc destination");
  check(cudaMemset(source, 0x5a, total), "memset");
  check(cudaMemset(destination, 0, total), "memset");
  cudaEvent_t begin, end;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  auto time_it = [&](auto&& body) {
    std::vector<double> runs;
    for (int run = 0; run < repeat; ++run) {
      cudaEventRecord(begin);
      body();
      cudaEventRecord(end);
      check(cudaEventSynchronize(end), "run");
      float ms = 0;
      cudaEventElapsedTime(&ms, begin, end);
      runs.push_back(ms / 1e3);
    }
    return median(runs);
  };
  const double whole = time_it([&] { cudaMemcpyAsync(destination, source, total, cudaMemcpyDeviceToDevice); });
  std::printf("gather_probe: %.1f GiB within one GPU (%d SMs), median of %d, cudaEvent timing\n\n",
              static_cast<double>(total) / (1ull << 30), sms, repeat);
  std::printf("| tensors | kernel (piece, threads, in flight, grid) | seconds | GB/s | vs one cudaMemcpy (%.4f s) |\n",
              whole);
  std::printf("| ---: | --- | ---: | ---: | ---: |\n");
  const std::vector<Variant> variants = {
      {"1 MiB, 512 x 4, a block a piece (production)", 1ull << 20, 512, 4, 0},
      {"256 KiB, 512 x 4, a block a piece", 256ull << 10, 512, 4, 0},
      {"4 MiB, 512 x 4, a block a piece", 4ull << 20, 512, 4, 0},
      {"1 MiB, 512 x 8, a block a piece", 1ull << 20, 512, 8, 0},
      {"1 MiB, 256 x 8, a block a piece", 1ull << 20, 256, 8, 0},
      {"1 MiB, 1024 x 4, a block a piece", 1ull << 20, 1024, 4, 0},
      {"256 KiB, 256 x 4, a block a piece", 256ull << 10, 256, 4, 0},
      {"1 MiB, 512 x 4, 4 blocks an SM", 1ull << 20, 512, 4, 4},
      {"256 KiB, 512 x 8, 2 blocks an SM", 256ull << 10, 512, 8, 2},
  };
  Work* items = nullptr;
  for (uint64_t tensors : {uint64_t{1000}, uint64_t{10000}}) {
    const uint64_t each = total / tensors / 256 * 256;
    for (const Variant& variant : variants) {
      std::vector<Work> work;
      for (uint64_t t = 0; t < tensors; ++t) {
        uint64_t offset = t * each;
        uint64_t bytes = t + 1 == tensors ? total - offset : each;
        for (uint64_t done = 0; done < bytes; done += variant.piece_bytes) {
          work.push_back({destination + offset + done, source + offset + done, std::min(variant.piece_bytes, bytes - done)});
        }
      }
      if (items != nullptr) cudaFree(items);
      check(cudaMalloc(&items, work.size() * sizeof(Work)), "cudaMalloc items");
      check(cudaMemcpy(items, work.data(), work.size() * sizeof(Work), cudaMemcpyHostToDevice), "upload");
      const double seconds = time_it([&] { launch_variant(variant, items, work.size(), sms); });
      check(cudaGetLastError(), "launch");
      std::printf("| %llu | %s | %.4f | %.0f | %.0f%% |\n", static_cast<unsigned long long>(tensors), variant.name.c_str(),
                  seconds, static_cast<double>(total) / seconds / 1e9, 100.0 * whole / seconds);
    }
    // A bucket at a time: 16 launches of 1/16 of the pieces each, as an update issues them.
    std::vector<Work> work;
    for (uint64_t t = 0; t < tensors; ++t) {
      uint64_t offset = t * each;
      uint64_t bytes = t + 1 == tensors ? total - offset : each;
      for (uint64_t done = 0; done < bytes; done += 1ull << 20) {
        work.push_back({destination + offset + done, source + offset + done, std::min<uint64_t>(1ull << 20, bytes - done)});
      }
    }
    cudaFree(items);
    check(cudaMalloc(&items, work.size() * sizeof(Work)), "cudaMalloc items");
    check(cudaMemcpy(items, work.data(), work.size() * sizeof(Work), cudaMemcpyHostToDevice), "upload");
    const double sliced = time_it([&] {
      size_t per_launch = (work.size() + 15) / 16;
      for (size_t first = 0; first < work.size(); first += per_launch) {
        launch<512, 4>(items + first, std::min(per_launch, work.size() - first),
                       static_cast<unsigned>(std::min<size_t>(per_launch, 65535)));
      }
    });
    std::printf("| %llu | 1 MiB, 512 x 4, in 16 launches (a bucket each) | %.4f | %.0f | %.0f%% |\n",
                static_cast<unsigned long long>(tensors), sliced, static_cast<double>(total) / sliced / 1e9,
                100.0 * whole / sliced);
    cudaFree(items);
    items = nullptr;
  }
  // Every byte landed (the last variant's copy).
  std::vector<unsigned char> probe(1 << 20);
  check(cudaMemcpy(probe.data(), destination + total - probe.size(), probe.size(), cudaMemcpyDeviceToHost), "check");
  bool right = std::all_of(probe.begin(), probe.end(), [](unsigned char value) { return value == 0x5a; });
  std::printf("\nlast MiB copied right: %s\n", right ? "yes" : "NO");
  return right ? 0 : 1;
}

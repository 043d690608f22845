// What a tensor-parallel rank's column window costs on the way to a GPU (issue 44): a rank
// that keeps `width` bytes of every `pitch`-byte row of a row-split tensor (o_proj, down_proj,
// experts' w2) out of the page cache, by each mechanism a loader could use, timed alone on
// the same warm file. Standalone CUDA (the library's device layer has no 2-D copy of its
// own to time):
//
//   nvcc -O2 -std=c++17 -o window_probe bench/window_probe.cu
//   window_probe [--file PATH] [--gib 2] [--threads 16]
//
// Writes PATH (pattern bytes) if it is missing or short, reads it once so the cache is warm,
// then prints one line per shape and mechanism, each rate in GB/s of the bytes the rank
// keeps (and the contiguous load of the same file, the raw rate, for the ratio):
//   register+2D   each thread registers a 64 MiB window of the mapping, copies its rows with
//                 cudaMemcpy2DAsync, unregisters it (registration of the whole extent included)
//   register+span the same, copying the whole window (the other ranks' columns cross too)
//   2D registered the whole file registered beforehand: the 2-D copy's rate alone
//   gather        each thread memcpys its rows out of the mapping into one of two pinned
//                 4 MiB buffers and copies the buffer to the device, double-buffered
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kWindow = 64 * kMiB;
constexpr size_t kGatherBuffer = 4 * kMiB;
using Clock = std::chrono::steady_clock;

void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "window_probe: %s: %s\n", what, cudaGetErrorString(error));
    std::exit(1);
  }
}

double parallel(unsigned threads, const std::function<void(unsigned)>& body) {
  auto start = Clock::now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& thread : pool) thread.join();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Shape {
  const char* name;
  size_t width, pitch;
};

}  // namespace

int main(int argc, char** argv) {
  std::string path = "/tmp/window-probe.bin";
  size_t bytes = 2048 * kMiB;
  unsigned threads = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--file") path = argv[i + 1];
    else if (flag == "--gib") bytes = static_cast<size_t>(std::stod(argv[i + 1]) * 1024) * kMiB;
    else if (flag == "--threads") threads = static_cast<unsigned>(std::stoul(argv[i + 1]));
  }
  struct stat status {};
  if (::stat(path.c_str(), &status) != 0 || static_cast<size_t>(status.st_size) < bytes) {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<char> pattern(64 * kMiB);
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>(i * 2654435761u >> 13);
    for (size_t at = 0; at < bytes; at += pattern.size())
      if (::pwrite(fd, pattern.data(), pattern.size(), static_cast<off_t>(at)) != static_cast<ssize_t>(pattern.size()))
        return std::perror("pwrite"), 1;
    ::close(fd);
  }
  int fd = ::open(path.c_str(), O_RDONLY);
  auto* map = static_cast<const char*>(::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0));
  if (map == MAP_FAILED) return std::perror("mmap"), 1;
  {
    std::vector<char> sink(64 * kMiB);
    for (size_t at = 0; at < bytes; at += sink.size()) (void)!::pread(fd, sink.data(), sink.size(), static_cast<off_t>(at));
  }
  check(cudaSetDevice(0), "cudaSetDevice");
  char* device = nullptr;
  check(cudaMalloc(&device, bytes), "cudaMalloc");
  const size_t windows = bytes / kWindow;

  // Each thread: its own stream; windows taken from a shared counter.
  auto register_and_copy = [&](const Shape& shape, bool span) {
    std::atomic<size_t> next{0};
    double seconds = parallel(threads, [&](unsigned) {
      cudaStream_t stream;
      check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
      for (size_t w; (w = next.fetch_add(1)) < windows;) {
        void* base = const_cast<char*>(map + w * kWindow);
        check(cudaHostRegister(base, kWindow, cudaHostRegisterReadOnly), "cudaHostRegister");
        const size_t rows = kWindow / shape.pitch;
        char* destination = device + w * kWindow / shape.pitch * shape.width;
        if (span || shape.width == shape.pitch) {
          check(cudaMemcpyAsync(device + w * kWindow, base, kWindow, cudaMemcpyHostToDevice, stream), "copy");
        } else {
          check(cudaMemcpy2DAsync(destination, shape.width, base, shape.pitch, shape.width, rows, cudaMemcpyHostToDevice,
                                  stream),
                "copy 2D");
        }
        check(cudaStreamSynchronize(stream), "sync");
        check(cudaHostUnregister(base), "cudaHostUnregister");
      }
      cudaStreamDestroy(stream);
    });
    return seconds;
  };
  auto gather = [&](const Shape& shape) {
    std::atomic<size_t> next{0};
    const size_t rows_per_buffer = kGatherBuffer / shape.width;
    const size_t total_rows = bytes / shape.pitch;
    const size_t batches = (total_rows + rows_per_buffer - 1) / rows_per_buffer;
    return parallel(threads, [&](unsigned) {
      cudaStream_t stream;
      check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
      char* pinned[2];
      cudaEvent_t done[2];
      for (int b = 0; b < 2; ++b) {
        check(cudaHostAlloc(reinterpret_cast<void**>(&pinned[b]), kGatherBuffer, cudaHostAllocDefault), "cudaHostAlloc");
        check(cudaEventCreateWithFlags(&done[b], cudaEventDisableTiming), "event");
        check(cudaEventRecord(done[b], stream), "record");
      }
      int turn = 0;
      for (size_t batch; (batch = next.fetch_add(1)) < batches;) {
        check(cudaEventSynchronize(done[turn]), "event sync");
        const size_t first = batch * rows_per_buffer, last = std::min(total_rows, first + rows_per_buffer);
        for (size_t row = first; row < last; ++row)
          std::memcpy(pinned[turn] + (row - first) * shape.width, map + row * shape.pitch, shape.width);
        check(cudaMemcpyAsync(device + first * shape.width, pinned[turn], (last - first) * shape.width,
                              cudaMemcpyHostToDevice, stream),
              "copy");
        check(cudaEventRecord(done[turn], stream), "record");
        turn ^= 1;
      }
      check(cudaStreamSynchronize(stream), "sync");
      for (int b = 0; b < 2; ++b) {
        cudaFreeHost(pinned[b]);
        cudaEventDestroy(done[b]);
      }
      cudaStreamDestroy(stream);
    });
  };
  auto report = [&](const Shape& shape, const char* mechanism, double seconds) {
    const double kept = static_cast<double>(bytes / shape.pitch * shape.width);
    std::printf("window_probe: %-18s %-14s width %6zu pitch %6zu  %.4f s  %6.2f GB/s kept\n", shape.name, mechanism,
                shape.width, shape.pitch, seconds, kept / seconds / 1e9);
    std::fflush(stdout);
  };

  const Shape shapes[] = {{"contiguous", 8192, 8192},       {"tp2 o_proj bf16", 4096, 8192},
                          {"tp2 down bf16", 14336, 28672},  {"tp8 o_proj bf16", 1024, 8192},
                          {"tp8 down bf16", 3584, 28672},   {"tp2 moe w2 fp8", 384, 768},
                          {"tp2 moe w2 bf16", 768, 1536}};
  register_and_copy(shapes[0], true);  // warm the driver's paths
  for (const Shape& shape : shapes) {
    report(shape, "register+2D", register_and_copy(shape, false));
    if (shape.width != shape.pitch) report(shape, "register+span", register_and_copy(shape, true));
    report(shape, "gather", gather(shape));
  }
  // The 2-D copy alone, out of memory registered beforehand (4 streams).
  {
    std::vector<void*> bases;
    for (size_t w = 0; w < windows; ++w) {
      bases.push_back(const_cast<char*>(map + w * kWindow));
      check(cudaHostRegister(bases.back(), kWindow, cudaHostRegisterReadOnly), "cudaHostRegister");
    }
    cudaStream_t streams[4];
    for (auto& stream : streams) check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    for (const Shape& shape : shapes) {
      auto start = Clock::now();
      for (size_t w = 0; w < windows; ++w) {
        const size_t rows = kWindow / shape.pitch;
        check(cudaMemcpy2DAsync(device + w * rows * shape.width, shape.width, bases[w], shape.pitch, shape.width, rows,
                                cudaMemcpyHostToDevice, streams[w % 4]),
              "copy 2D");
      }
      for (auto& stream : streams) check(cudaStreamSynchronize(stream), "sync");
      report(shape, "2D registered", std::chrono::duration<double>(Clock::now() - start).count());
    }
    for (void* base : bases) cudaHostUnregister(base);
  }
  cudaFree(device);
  return 0;
}

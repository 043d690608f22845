// A rank that takes a column window of a row-split tensor (o_proj, down_proj, w2 at tp 2)
// reads its window of each row, not the whole tensor: the plan asks for one run per row,
// storage reads them (a gap at most Storage::run_merge_gap() read with its runs, or none at
// all where runs are copied out of a mapping), and the session writes each run to its place.
// Each case checks the bytes read and the parameter against a hand-sliced reference.
#include <cstring>
#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/model_fixtures.hpp"
#include "weightstream/error.hpp"
#include "weightstream/load.hpp"

namespace weightstream {
namespace {

using testing::TempDir;

/// A tensor of `rows` x `columns` elements and the column window [column_begin,
/// column_begin + window) of every row that the rank takes.
struct WindowCase {
  std::string name;
  int64_t rows = 0;
  int64_t columns = 0;
  int64_t column_begin = 0;
  int64_t window = 0;
  Dtype dtype = Dtype::kBF16;

  uint64_t element() const { return dtype_bits(dtype) / 8; }
  uint64_t row_bytes() const { return static_cast<uint64_t>(columns) * element(); }
  uint64_t tensor_bytes() const { return static_cast<uint64_t>(rows) * row_bytes(); }
  uint64_t run_bytes() const { return static_cast<uint64_t>(window) * element(); }
  uint64_t share() const { return static_cast<uint64_t>(rows) * run_bytes(); }
  /// First to last byte of the window's runs: what a read that merges every gap reads.
  uint64_t extent() const { return static_cast<uint64_t>(rows - 1) * row_bytes() + run_bytes(); }
};

/// Deterministic bytes of tensor `tensor` at `offset` (distinct across rows and columns).
std::byte byte_at(size_t tensor, uint64_t offset) {
  return static_cast<std::byte>((tensor * 151 + offset * 13 + (offset >> 8) * 7) & 0xff);
}

std::vector<std::byte> tensor_bytes(size_t index, const WindowCase& c) {
  std::vector<std::byte> bytes(c.tensor_bytes());
  for (uint64_t i = 0; i < bytes.size(); ++i) bytes[i] = byte_at(index, i);
  return bytes;
}

/// The window of every row, compactly: what the parameter must hold.
std::vector<std::byte> hand_sliced(const std::vector<std::byte>& tensor, const WindowCase& c) {
  std::vector<std::byte> slice;
  for (int64_t row = 0; row < c.rows; ++row) {
    const std::byte* from = tensor.data() + static_cast<uint64_t>(row) * c.row_bytes() +
                            static_cast<uint64_t>(c.column_begin) * c.element();
    slice.insert(slice.end(), from, from + c.run_bytes());
  }
  return slice;
}

/// A checkpoint of the cases' tensors (one file, in order) and a layout of one parameter per
/// case, each filled by its tensor's window.
struct WindowCheckpoint {
  TempDir directory;
  std::vector<WindowCase> cases;
  std::vector<std::vector<std::byte>> tensors;

  explicit WindowCheckpoint(std::vector<WindowCase> window_cases) : cases(std::move(window_cases)) {
    SafetensorsWriter writer;
    for (size_t i = 0; i < cases.size(); ++i) {
      tensors.push_back(tensor_bytes(i, cases[i]));
      writer.add(cases[i].name, cases[i].dtype, {cases[i].rows, cases[i].columns}, tensors.back());
    }
    writer.write(directory.path() / "model.safetensors");
  }

  Checkpoint open(LocalIo io) const {
    Options options;
    options.stream.local_io = io;
    return Checkpoint::open(directory.path().string(), options);
  }

  /// The layout, on `device`; `parameter_dtype` converts on load when it differs from a
  /// case's dtype.
  ModelLayout layout(std::optional<Dtype> parameter_dtype = std::nullopt, const Device& device = Device{}) const {
    ModelLayout layout;
    layout.set_description("column windows");
    for (const WindowCase& c : cases) {
      Parameter parameter;
      parameter.name = c.name + ".parameter";
      parameter.dtype = parameter.load_dtype = parameter_dtype.value_or(c.dtype);
      parameter.shape = {c.rows, c.window};
      ParameterPart part;
      part.tensor = c.name;
      part.shape = {c.rows, c.columns};
      part.row_begin = 0;
      part.rows = c.rows;
      part.column_begin = c.column_begin;
      part.columns = c.window;
      part.rule = "test window";
      parameter.parts.push_back(std::move(part));
      layout.add_parameter(std::move(parameter));
    }
    layout.allocate(device);
    return layout;
  }

  uint64_t share() const {
    uint64_t bytes = 0;
    for (const WindowCase& c : cases) bytes += c.share();
    return bytes;
  }

  /// Checks every parameter (read back from its device) against its hand-sliced window.
  void expect_parameters_equal_hand_sliced(const ModelLayout& layout) const {
    for (size_t i = 0; i < cases.size(); ++i) {
      std::vector<std::byte> held = parameter_bytes(layout.parameter(cases[i].name + ".parameter"));
      std::vector<std::byte> expected = hand_sliced(tensors[i], cases[i]);
      ASSERT_EQ(held.size(), expected.size()) << cases[i].name;
      EXPECT_TRUE(held == expected) << cases[i].name;
    }
  }
};

/// o_proj and down_proj of a tp-2 rank: the second half of each row (a window at the end of
/// the row) and the first half; rows of 2 KiB, gaps of 1 KiB.
const std::vector<WindowCase> kProjections = {
    {"o_proj.rank1", 256, 1024, 512, 512, Dtype::kBF16},
    {"down_proj.rank0", 128, 1024, 0, 512, Dtype::kBF16},
};

TEST(StridedLoad, TheRankOfATp2ProjectionPlansOneRunPerRowOfItsWindow) {
  WindowCheckpoint disk(kProjections);
  Checkpoint checkpoint = disk.open(LocalIo::kAuto);
  ModelLayout layout = disk.layout();
  LoadPlan plan = plan_layout_load(layout, checkpoint);
  ASSERT_EQ(plan.reads.size(), 2u);
  const PlannedTensor& o_proj = plan.reads[0];
  EXPECT_TRUE(o_proj.slice);
  EXPECT_EQ(o_proj.runs, 256u);
  EXPECT_EQ(o_proj.stride, 2048u);
  EXPECT_EQ(o_proj.range.offset, 1024u);  // the window's first byte of row 0
  EXPECT_EQ(o_proj.range.length, 1024u);
  EXPECT_EQ(plan.reads[1].range.offset, 0u);
  EXPECT_EQ(plan.bytes_to_read, disk.share());
  EXPECT_EQ(plan.bytes_to_read, (256u * 2048 + 128u * 2048) / 2);
}

TEST(StridedLoad, ThroughTheMappingARankReadsExactlyItsShare) {
  // --io auto (the default) and mmap copy the runs out of the file's mapping: no gap is read.
  for (LocalIo io : {LocalIo::kAuto, LocalIo::kMmap}) {
    WindowCheckpoint disk(kProjections);
    Checkpoint checkpoint = disk.open(io);
    ModelLayout layout = disk.layout();
    LayoutLoad load = load_layout(layout, checkpoint, LoadMode::kCold, StreamOptions{});
    EXPECT_EQ(load.stream.bytes_read, disk.share()) << local_io_name(io);
    EXPECT_EQ(load.stream.bytes, disk.share());
    EXPECT_EQ(load.counters.bytes_applied, disk.share());
    disk.expect_parameters_equal_hand_sliced(layout);
  }
}

TEST(StridedLoad, ByPreadGapsUpToTheMergeGapAreReadWithTheirRuns) {
  // Gaps of 1 KiB are far below the 64 KiB merge gap: each tensor's runs are read with their
  // gaps, from the first run's start to the last run's end (the share plus the gaps between
  // runs), and both tensors' windows, packed, share one staged read (they fit one chunk).
  WindowCheckpoint disk(kProjections);
  Checkpoint checkpoint = disk.open(LocalIo::kPread);
  ASSERT_EQ(checkpoint.storage().run_merge_gap(), 64u * 1024);
  ModelLayout layout = disk.layout();
  LayoutLoad load = load_layout(layout, checkpoint, LoadMode::kCold, StreamOptions{});
  EXPECT_EQ(load.stream.bytes_read, kProjections[0].extent() + kProjections[1].extent());
  EXPECT_LE(load.stream.bytes_read - disk.share(), 2 * 64u * 1024 * 255);
  EXPECT_EQ(load.stream.bytes, disk.share());
  EXPECT_EQ(load.stream.reads, 1u);
  disk.expect_parameters_equal_hand_sliced(layout);
}

TEST(StridedLoad, GapsAboveTheMergeGapAreNeverRead) {
  // Rows of 192 KiB, a window of 64 KiB: gaps of 128 KiB, each run read alone.
  WindowCheckpoint disk({{"wide.rank0", 4, 98304, 0, 32768, Dtype::kBF16}});
  Checkpoint checkpoint = disk.open(LocalIo::kPread);
  ModelLayout layout = disk.layout();
  LayoutLoad load = load_layout(layout, checkpoint, LoadMode::kCold, StreamOptions{});
  EXPECT_EQ(load.stream.bytes_read, disk.share());
  disk.expect_parameters_equal_hand_sliced(layout);
}

TEST(StridedLoad, EdgeCasesLandWhereTheyBelong) {
  WindowCheckpoint disk({
      {"whole_row", 64, 256, 0, 256, Dtype::kBF16},       // the window is the whole row: one range
      {"single_row", 1, 4096, 1024, 1024, Dtype::kBF16},  // one row: one run
      {"tiny_rows", 200, 8, 4, 4, Dtype::kF32},           // 16-byte runs, 16-byte gaps
      {"row_end", 33, 96, 80, 16, Dtype::kBF16},          // the last columns of each row
      {"fp8_scales", 7, 12, 6, 6, Dtype::kF32},           // a block-scale tensor's half
  });
  for (LocalIo io : {LocalIo::kAuto, LocalIo::kPread}) {
    Checkpoint checkpoint = disk.open(io);
    ModelLayout layout = disk.layout();
    LoadPlan plan = plan_layout_load(layout, checkpoint);
    EXPECT_EQ(plan.reads[0].runs, 1u);
    EXPECT_FALSE(plan.reads[0].slice);
    EXPECT_EQ(plan.reads[0].range.length, disk.cases[0].tensor_bytes());
    EXPECT_EQ(plan.reads[1].runs, 1u);
    EXPECT_EQ(plan.reads[1].range.offset, 2048u);
    EXPECT_EQ(plan.reads[1].range.length, 2048u);
    // Small pieces: reads of a few runs each, a run split over reads, pieces crossing rows.
    StreamOptions options;
    options.chunk_bytes = 4096;
    options.memory_limit = 64 * 1024;
    LayoutLoad load = load_layout(layout, checkpoint, LoadMode::kCold, options);
    EXPECT_EQ(load.stream.bytes, disk.share()) << local_io_name(io);
    if (io == LocalIo::kAuto) {
      EXPECT_EQ(load.stream.bytes_read, disk.share());
    } else {
      // Windows of several tensors gathered into one read: at most every byte from the first
      // run to the last (the gaps within and between tensors).
      uint64_t span = 0;
      for (const WindowCase& c : disk.cases) span += c.tensor_bytes();
      EXPECT_GE(load.stream.bytes_read, disk.share());
      EXPECT_LE(load.stream.bytes_read, span);
    }
    disk.expect_parameters_equal_hand_sliced(layout);
  }
}

TEST(StridedLoad, AWindowConvertedOnLoadGathersOnlyItsColumns) {
  // F32 checkpoint tensors into BF16 parameters: the pieces gather (compactly, the window
  // only) and convert once their part is whole, as a BF16 piece quantized into FP8 does.
  WindowCheckpoint disk({{"f32.rank1", 40, 64, 32, 32, Dtype::kF32}, {"f32.rank0", 3, 200, 0, 100, Dtype::kF32}});
  Checkpoint checkpoint = disk.open(LocalIo::kAuto);
  ModelLayout layout = disk.layout(Dtype::kBF16);
  StreamOptions options;
  options.chunk_bytes = 4096;
  options.memory_limit = 64 * 1024;
  LayoutLoad load = load_layout(layout, checkpoint, LoadMode::kCold, options);
  EXPECT_EQ(load.stream.bytes_read, disk.share());
  for (size_t i = 0; i < disk.cases.size(); ++i) {
    const WindowCase& c = disk.cases[i];
    std::vector<std::byte> slice = hand_sliced(disk.tensors[i], c);
    std::vector<std::byte> expected(slice.size() / 2);
    convert_elements(expected.data(), Dtype::kBF16, slice.data(), Dtype::kF32, slice.size() / 4);
    const Parameter& parameter = layout.parameter(c.name + ".parameter");
    ASSERT_EQ(parameter.bytes(), expected.size());
    EXPECT_EQ(std::memcmp(parameter.data, expected.data(), expected.size()), 0) << c.name;
  }
}

TEST(StridedLoad, OntoAGpuEveryPathWritesEachRunToItsPlace) {
  if (cuda_device_count() == 0) {
    GTEST_SKIP() << (cuda_compiled() ? "no CUDA device on this machine" : "built without CUDA")
                 << ": the CUDA path is tested by scripts/gpu.sh on a GPU machine";
  }
  const Device cuda{Device::Kind::kCuda, 0};
  std::vector<WindowCase> cases = kProjections;
  cases.push_back({"tiny_rows", 200, 8, 4, 4, Dtype::kF32});
  cases.push_back({"row_end", 33, 96, 80, 16, Dtype::kBF16});
  cases.push_back({"single_row", 1, 4096, 1024, 1024, Dtype::kBF16});
  WindowCheckpoint disk(cases);
  Checkpoint checkpoint = disk.open(LocalIo::kAuto);
  for (GpuPath path : {GpuPath::kStaged, GpuPath::kMapped, GpuPath::kBoth, GpuPath::kAuto}) {
    StreamOptions options;
    options.gpu_path = path;
    options.chunk_bytes = 64 * 1024;  // a tensor's runs over several reads and windows
    options.memory_limit = 1024 * 1024;
    ModelLayout layout = disk.layout(std::nullopt, cuda);
    LayoutLoad load = load_layout(layout, checkpoint, LoadMode::kCold, options);
    if (path == GpuPath::kStaged) EXPECT_EQ(load.stream.bytes_read, disk.share());
    EXPECT_EQ(load.counters.bytes_applied, disk.share()) << gpu_path_name(path);
    disk.expect_parameters_equal_hand_sliced(layout);
  }
  // Converted on the way: gathered on the host, written once whole.
  WindowCheckpoint f32({{"f32.rank1", 40, 64, 32, 32, Dtype::kF32}});
  ModelLayout layout = f32.layout(Dtype::kBF16, cuda);
  load_layout(layout, f32.open(LocalIo::kAuto), LoadMode::kCold, StreamOptions{});
  std::vector<std::byte> slice = hand_sliced(f32.tensors[0], f32.cases[0]);
  std::vector<std::byte> expected(slice.size() / 2);
  convert_elements(expected.data(), Dtype::kBF16, slice.data(), Dtype::kF32, slice.size() / 4);
  EXPECT_TRUE(parameter_bytes(layout.parameter("f32.rank1.parameter")) == expected);
}

TEST(StridedLoad, AWholeTensorPieceStillFillsAWindow) {
  // A pushed update hands the whole tensor: the session takes the window's bytes of it.
  WindowCheckpoint disk(kProjections);
  ModelLayout layout = disk.layout();
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  for (size_t i = 0; i < disk.cases.size(); ++i) {
    const WindowCase& c = disk.cases[i];
    std::vector<int64_t> shape{c.rows, c.columns};
    TensorView view{.name = c.name, .dtype = c.dtype, .shape = shape, .data = disk.tensors[i].data(),
                    .bytes = c.tensor_bytes()};
    session.load(view);
  }
  session.finish();
  EXPECT_EQ(session.counters().bytes_applied, disk.share());
  EXPECT_EQ(session.counters().tensors_applied, 2u);
  disk.expect_parameters_equal_hand_sliced(layout);
}

TEST(StridedLoad, AWindowDeliveredTwiceIsRefused) {
  WindowCheckpoint disk({kProjections[0]});
  ModelLayout layout = disk.layout();
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  const WindowCase& c = disk.cases[0];
  std::vector<int64_t> shape{c.rows, c.columns};
  TensorView view{.name = c.name, .dtype = c.dtype, .shape = shape, .data = disk.tensors[0].data(),
                  .bytes = c.tensor_bytes()};
  session.load(view);
  EXPECT_THAT([&] { session.load(view); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("delivered twice")));
}

}  // namespace
}  // namespace weightstream

// LoadSession: cold loads for every architecture and tensor-parallel size, parts in any
// order and any pieces, updates that leave other layers alone, and every rejection.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "model/model_fixtures.hpp"
#include "weightstream/error.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::bytes_of;
using testing::cached_checkpoint;
using testing::cold_loaded_layout;
using testing::host_layout;
using testing::MemoryCheckpoint;
using testing::MemoryTensor;
using testing::run_load;
using testing::slice_of;

/// Checks every part of every parameter against the slice of its checkpoint tensor, and
/// that padding is zero: the layout's own bookkeeping, checked against the bytes.
void expect_parameters_match(const ModelLayout& layout, const MemoryCheckpoint& checkpoint) {
  for (const Parameter& parameter : layout.parameters()) {
    std::vector<std::byte> bytes = parameter_bytes(parameter);
    size_t element = dtype_bits(parameter.dtype) / 8;
    for (const ParameterPart& part : parameter.parts) {
      const auto& tensor = checkpoint.tensor(part.tensor);
      ASSERT_EQ(tensor.dtype, parameter.dtype) << "the test feeds tensors in the parameter dtype";
      std::vector<std::byte> expected = slice_of(tensor, part.row_begin, part.rows, part.column_begin, part.columns);
      auto begin = bytes.begin() + static_cast<ptrdiff_t>(part.element_offset * element);
      ASSERT_TRUE(std::equal(expected.begin(), expected.end(), begin)) << parameter.name << " part " << part.id;
    }
    for (const auto& [begin, end] : parameter.padding) {
      EXPECT_TRUE(std::all_of(bytes.begin() + static_cast<ptrdiff_t>(begin), bytes.begin() + static_cast<ptrdiff_t>(end),
                              [](std::byte b) { return b == std::byte{0}; }))
          << parameter.name << " padding";
    }
  }
}

class ColdLoad : public ::testing::TestWithParam<std::tuple<std::string, int64_t>> {};

TEST_P(ColdLoad, EveryRankHoldsItsSlices) {
  auto [arch, tp_size] = GetParam();
  const MemoryCheckpoint& checkpoint = cached_checkpoint(arch);
  for (int64_t rank = 0; rank < tp_size; ++rank) {
    ModelLayout layout = host_layout(checkpoint, tp_size, rank);
    LoadCounters counters = run_load(layout, LoadMode::kCold, {checkpoint.views()});
    expect_parameters_match(layout, checkpoint);
    EXPECT_EQ(counters.model_hook_runs, 0u);
    // The MTP layers are the draft's: handed in, skipped, never written (issue 18).
    std::string mtp = "model.layers." + std::to_string(checkpoint.config.num_hidden_layers) + ".";
    EXPECT_EQ(counters.tensors_skipped, checkpoint.views_matching(mtp).size());
    EXPECT_GT(counters.tensors_applied, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, ColdLoad,
                         ::testing::Combine(::testing::Values("llama", "qwen3", "deepseek_v3"),
                                            ::testing::Values(1, 2, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_tp" + std::to_string(std::get<1>(info.param));
                         });

TEST(LoadSession, RanksTogetherRebuildEveryShardedTensor) {
  // Independent of the layout's bookkeeping: column shards stacked across ranks give back
  // q_proj; row shards side by side give back o_proj; K/V heads replicate at tp 4 > 1 head.
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  const ModelConfig& config = checkpoint.config;
  ASSERT_EQ(config.num_key_value_heads, 1);
  int64_t tp = 4;
  int64_t hidden = config.hidden_size;
  int64_t q_rows = config.num_attention_heads * config.head_dim;
  std::vector<std::byte> q, k_seen;
  std::vector<std::vector<std::byte>> o_shards;
  for (int64_t rank = 0; rank < tp; ++rank) {
    ModelLayout layout = cold_loaded_layout(checkpoint, tp, rank);
    auto qkv = bytes_of(layout, "model.layers.1.self_attn.qkv_proj.weight");
    size_t q_bytes = static_cast<size_t>(q_rows / tp * hidden * 2);
    size_t k_bytes = static_cast<size_t>(config.head_dim * hidden * 2);
    q.insert(q.end(), qkv.begin(), qkv.begin() + static_cast<ptrdiff_t>(q_bytes));
    std::vector<std::byte> k(qkv.begin() + static_cast<ptrdiff_t>(q_bytes),
                             qkv.begin() + static_cast<ptrdiff_t>(q_bytes + k_bytes));
    EXPECT_EQ(k, checkpoint.tensor("model.layers.1.self_attn.k_proj.weight").bytes) << "rank " << rank;
    o_shards.push_back(bytes_of(layout, "model.layers.1.self_attn.o_proj.weight"));
  }
  EXPECT_EQ(q, checkpoint.tensor("model.layers.1.self_attn.q_proj.weight").bytes);
  std::vector<std::byte> o;
  size_t shard_row = static_cast<size_t>(q_rows / tp * 2);
  for (int64_t row = 0; row < hidden; ++row) {
    for (const auto& shard : o_shards) {
      auto begin = shard.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(row) * shard_row);
      o.insert(o.end(), begin, begin + static_cast<ptrdiff_t>(shard_row));
    }
  }
  EXPECT_EQ(o, checkpoint.tensor("model.layers.1.self_attn.o_proj.weight").bytes);
}

TEST(LoadSession, PackedColumnWindowsLandAsTheirSlicesAndBadOnesAreRefused) {
  // A rank's o_proj and down_proj arrive as a stream gathers them for it (TensorPiece::
  // packed): its columns of each row, back to back, in pieces of whole runs.
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  const int64_t tp = 2, rank = 1;
  ModelLayout layout = host_layout(checkpoint, tp, rank);
  std::vector<std::vector<std::byte>> packed;  // kept alive for the load
  std::vector<TensorView> batch;
  for (const MemoryTensor& tensor : checkpoint.tensors) {
    const bool row_split = tensor.name.find("o_proj") != std::string::npos || tensor.name.find("down_proj") != std::string::npos;
    if (!row_split) {
      batch.push_back(tensor.view());
      continue;
    }
    const int64_t rows = tensor.shape[0], columns = tensor.shape[1] / tp;
    const uint64_t element = dtype_bits(tensor.dtype) / 8, row_bytes = static_cast<uint64_t>(tensor.shape[1]) * element;
    const uint64_t run = static_cast<uint64_t>(columns) * element;
    const int64_t first_half = rows / 2;
    for (auto [begin, count] : {std::pair{int64_t{0}, first_half}, std::pair{first_half, rows - first_half}}) {
      packed.push_back(slice_of(tensor, begin, count, rank * columns, columns));
      TensorView view{tensor.name, tensor.dtype, tensor.shape, packed.back().data(), Device{},
                      static_cast<uint64_t>(begin) * row_bytes + static_cast<uint64_t>(rank) * run,
                      static_cast<uint64_t>(count - 1) * row_bytes + run};
      view.packed_run = run;
      view.packed_stride = row_bytes;
      batch.push_back(view);
    }
  }
  run_load(layout, LoadMode::kCold, {batch});
  expect_parameters_match(layout, checkpoint);

  // Runs that do not tile the piece's bytes are refused, naming the tensor.
  const MemoryTensor& o = checkpoint.tensor("model.layers.0.self_attn.o_proj.weight");
  TensorView bad = o.view();
  bad.bytes = 1000;
  bad.packed_run = 64;
  bad.packed_stride = 128;
  LoadSession session(layout);
  session.begin(LoadMode::kUpdate);
  try {
    session.load(bad);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kModel);
    EXPECT_THAT(error.what(), HasSubstr("tensor model.layers.0.self_attn.o_proj.weight: a packed piece of runs of 64 "
                                        "bytes every 128 bytes does not span 1000 bytes in whole runs"));
  }
}

TEST(LoadSession, QkvPartsInEveryOrderAcrossCalls) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout reference = cold_loaded_layout(checkpoint, 2, 1);
  const std::string name = "model.layers.0.self_attn.qkv_proj.weight";
  std::vector<std::string> parts = {"q_proj", "k_proj", "v_proj"};
  std::sort(parts.begin(), parts.end());
  do {
    ModelLayout layout = host_layout(checkpoint, 2, 1);
    LoadSession session(layout);
    session.begin(LoadMode::kCold);
    session.load(checkpoint.views_except("layers.0.self_attn."));
    for (const std::string& part : parts) {
      session.load(checkpoint.tensor("model.layers.0.self_attn." + part + ".weight").view());
      EXPECT_EQ(layout.model_hook_runs(), 0u);
    }
    session.load(checkpoint.tensor("model.layers.0.self_attn.o_proj.weight").view());
    session.finish();
    EXPECT_EQ(bytes_of(layout, name), bytes_of(reference, name)) << parts[0] << parts[1] << parts[2];
    EXPECT_EQ(compare_layouts(layout, reference).mismatched, 0u);
  } while (std::next_permutation(parts.begin(), parts.end()));
}

TEST(LoadSession, PiecesInAnyOrderAndSize) {
  // Odd piece sizes split elements and rows: contiguous slices land directly, strided and
  // converted ones are gathered first.
  const MemoryCheckpoint& checkpoint = cached_checkpoint("deepseek_v3");
  for (int64_t tp : {1, 2}) {
    ModelLayout reference = cold_loaded_layout(checkpoint, tp, tp - 1);
    std::vector<TensorView> pieces;
    for (const auto& tensor : checkpoint.tensors) {
      for (uint64_t offset = 0; offset < tensor.bytes.size(); offset += 997) {
        pieces.push_back(tensor.piece(offset, std::min<uint64_t>(997, tensor.bytes.size() - offset)));
      }
    }
    std::mt19937 random(7);
    std::shuffle(pieces.begin(), pieces.end(), random);
    ModelLayout layout = host_layout(checkpoint, tp, tp - 1);
    std::vector<std::vector<TensorView>> batches(5);
    for (size_t i = 0; i < pieces.size(); ++i) batches[i % 5].push_back(pieces[i]);
    run_load(layout, LoadMode::kCold, batches);
    LayoutComparison comparison = compare_layouts(layout, reference);
    EXPECT_EQ(comparison.mismatched, 0u) << (comparison.mismatches.empty() ? "" : comparison.mismatches[0]);
  }
}

TEST(LoadSession, ConvertsDtypesOnCopy) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("qwen3");
  // The same weights as F32: the BF16 parameters must come out bit-identical (BF16 -> F32
  // is exact and F32 -> BF16 rounds back to the same value).
  std::vector<testing::MemoryTensor> wide;
  for (const auto& tensor : checkpoint.tensors) {
    uint64_t count = tensor.bytes.size() / 2;
    testing::MemoryTensor copy{tensor.name, Dtype::kF32, tensor.shape, std::vector<std::byte>(count * 4)};
    convert_elements(copy.bytes.data(), Dtype::kF32, tensor.bytes.data(), tensor.dtype, count);
    wide.push_back(std::move(copy));
  }
  std::vector<TensorView> views;
  for (const auto& tensor : wide) views.push_back(tensor.view());
  ModelLayout reference = cold_loaded_layout(checkpoint, 2, 0);
  ModelLayout layout = host_layout(checkpoint, 2, 0);
  run_load(layout, LoadMode::kCold, {views});
  EXPECT_EQ(compare_layouts(layout, reference).mismatched, 0u);
}

TEST(LoadSession, PartialUpdateLeavesOtherLayersBitIdentical) {
  const MemoryCheckpoint& old_weights = cached_checkpoint("llama", 1);
  const MemoryCheckpoint& new_weights = cached_checkpoint("llama", 2);
  ModelLayout layout = cold_loaded_layout(old_weights, 2, 0);
  ModelLayout before = cold_loaded_layout(old_weights, 2, 0);
  auto addresses = storage_addresses(layout);

  LoadCounters counters = run_load(layout, LoadMode::kUpdate,
                                   {{new_weights.tensor("model.layers.1.self_attn.k_proj.weight").view()},
                                    {new_weights.tensor("model.layers.1.mlp.down_proj.weight").view()}});
  EXPECT_EQ(counters.tensors_applied, 2u);
  EXPECT_EQ(counters.model_hook_runs, 0u);
  EXPECT_EQ(storage_addresses(layout), addresses);
  for (const Parameter& parameter : layout.parameters()) {
    bool changed = parameter.name == "model.layers.1.self_attn.qkv_proj.weight" ||
                   parameter.name == "model.layers.1.mlp.down_proj.weight";
    if (!changed) EXPECT_EQ(parameter_bytes(parameter), bytes_of(before, parameter.name)) << parameter.name;
  }
  // Inside qkv_proj only the k rows changed.
  const Parameter& qkv = layout.parameter("model.layers.1.self_attn.qkv_proj.weight");
  auto now = parameter_bytes(qkv);
  auto then = bytes_of(before, qkv.name);
  const ParameterPart& k = qkv.parts[1];
  size_t k_begin = k.element_offset * 2, k_end = k_begin + k.elements() * 2;
  EXPECT_TRUE(std::equal(now.begin(), now.begin() + static_cast<ptrdiff_t>(k_begin), then.begin()));
  EXPECT_TRUE(std::equal(now.begin() + static_cast<ptrdiff_t>(k_end), now.end(),
                         then.begin() + static_cast<ptrdiff_t>(k_end)));
  auto expected_k = slice_of(new_weights.tensor(k.tensor), k.row_begin, k.rows, 0, k.columns);
  EXPECT_TRUE(std::equal(expected_k.begin(), expected_k.end(), now.begin() + static_cast<ptrdiff_t>(k_begin)));
}

TEST(LoadSession, WrongShapeOrDtypeIsRejectedBeforeAnyByteIsWritten) {
  const MemoryCheckpoint& old_weights = cached_checkpoint("llama", 1);
  const MemoryCheckpoint& new_weights = cached_checkpoint("llama", 2);
  ModelLayout layout = cold_loaded_layout(old_weights);
  auto before = bytes_of(layout, "model.norm.weight");

  const auto& q = new_weights.tensor("model.layers.0.self_attn.q_proj.weight");
  std::vector<int64_t> wrong_shape = {q.shape[0] / 2, q.shape[1]};
  TensorView bad{q.name, q.dtype, wrong_shape, q.bytes.data(), Device{}, 0, q.bytes.size() / 2};
  LoadSession session(layout);
  session.begin(LoadMode::kUpdate);
  std::vector<TensorView> batch = {new_weights.tensor("model.norm.weight").view(), bad};
  try {
    session.load(batch);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kModel);
    EXPECT_THAT(error.what(), HasSubstr("tensor model.layers.0.self_attn.q_proj.weight has shape " +
                                        shape_text(wrong_shape)));
    EXPECT_THAT(error.what(), HasSubstr("parameter model.layers.0.self_attn.qkv_proj.weight (part 'q', layer 0"));
    EXPECT_THAT(error.what(), HasSubstr("expects " + shape_text(q.shape)));
  }
  EXPECT_EQ(bytes_of(layout, "model.norm.weight"), before) << "the good tensor of the batch was written";
  EXPECT_THROW(session.finish(), Error);  // a session whose batch failed does not finish

  session.begin(LoadMode::kUpdate);
  TensorView wrong_dtype{q.name, Dtype::kI16, q.shape, q.bytes.data(), Device{}, 0, q.bytes.size()};
  try {
    session.load(wrong_dtype);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("tensor model.layers.0.self_attn.q_proj.weight has dtype I16"));
    EXPECT_THAT(error.what(), HasSubstr("qkv_proj.weight"));
    EXPECT_THAT(error.what(), HasSubstr("BF16"));
  }
  EXPECT_THROW(session.finish(), Error);
  EXPECT_EQ(bytes_of(layout, "model.norm.weight"), before);
}

TEST(LoadSession, UnknownTensorsAreErrorsUnlessIgnored) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = host_layout(checkpoint);
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  std::vector<std::byte> bytes(8);
  std::vector<int64_t> shape = {4};
  TensorView inv_freq{"model.layers.0.self_attn.rotary_emb.inv_freq", Dtype::kF16, shape, bytes.data(), Device{}, 0, 8};
  session.load(inv_freq);
  EXPECT_EQ(session.counters().tensors_skipped, 1u);
  TensorView stray{"model.layers.0.self_attn.q_bias", Dtype::kF16, shape, bytes.data(), Device{}, 0, 8};
  try {
    session.load(stray);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("tensor model.layers.0.self_attn.q_bias matches no parameter of llama tp 1 "
                                        "rank 0 and no ignore rule"));
  }
}

TEST(LoadSession, ColdLoadNamesEveryMissingParameter) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("deepseek_v3");
  int64_t mtp = checkpoint.config.num_hidden_layers;
  std::string prefix = "model.layers." + std::to_string(mtp) + ".";
  // The target holds no MTP layer (issue 18): a checkpoint without them loads as a target.
  ModelLayout target = host_layout(checkpoint);
  testing::run_load(target, LoadMode::kCold, {checkpoint.views_except(prefix)});
  EXPECT_EQ(target.loads_finished(), 1u);
  // The draft is what misses them, and names every one.
  LayoutOptions draft;
  draft.modules = LayoutModules::kDraft;
  ModelLayout layout = host_layout(checkpoint, 1, 0, draft);
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  session.load(checkpoint.views_except(prefix));
  try {
    session.finish();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    std::string text = error.what();
    EXPECT_THAT(text, HasSubstr("cold load of deepseek_v3 tp 1 rank 0 (draft) is incomplete"));
    EXPECT_THAT(text, HasSubstr("MTP layer " + std::to_string(mtp) + " weights missing: "));
    for (const std::string& name : {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.head.weight",
                                    "mlp.experts.w13_weight", "self_attn.fused_qkv_a_proj.weight"}) {
      EXPECT_THAT(text, HasSubstr(prefix + name));
    }
    EXPECT_THAT(text, Not(HasSubstr("layer 1 weights missing")));
  }
  EXPECT_EQ(layout.loads_finished(), 0u);
}

TEST(LoadSession, PartiallyArrivedParameterNamesTheMissingTensors) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = host_layout(checkpoint);
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  session.load(checkpoint.views_except("layers.1.self_attn.v_proj"));
  try {
    session.finish();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("layer 1 weights missing: model.layers.1.self_attn.qkv_proj.weight (missing "
                                        "model.layers.1.self_attn.v_proj.weight)"));
  }
}

TEST(LoadSession, DeliveringATensorTwiceIsAnError) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = host_layout(checkpoint);
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  session.load(checkpoint.tensor("model.norm.weight").view());
  try {
    session.load(checkpoint.tensor("model.norm.weight").view());
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("tensor model.norm.weight delivered twice in this cold load"));
  }
}

TEST(LoadSession, ReloadAndUpdateNeedAColdLoadFirst) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = host_layout(checkpoint);
  LoadSession session(layout);
  try {
    session.begin(LoadMode::kReload);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("the first load must be cold"));
  }
  ModelLayout unallocated = build_model_layout(checkpoint.config);
  LoadSession other(unallocated);
  EXPECT_THROW(other.begin(LoadMode::kCold), Error);
}

TEST(LoadSession, ReloadsInShuffledBatchesMatchAFreshColdLoad) {
  const MemoryCheckpoint& first = cached_checkpoint("deepseek_v3", 1);
  const MemoryCheckpoint& second = cached_checkpoint("deepseek_v3", 2);
  ModelLayout layout = cold_loaded_layout(first, 2, 1);
  auto addresses = storage_addresses(layout);
  uint64_t allocated = layout.allocated_bytes();
  std::mt19937 random(3);
  for (int repeat = 0; repeat < 3; ++repeat) {
    std::vector<TensorView> views = (repeat % 2 == 0 ? second : first).views();
    std::shuffle(views.begin(), views.end(), random);
    std::vector<std::vector<TensorView>> batches(4);
    for (size_t i = 0; i < views.size(); ++i) batches[i % 4].push_back(views[i]);
    run_load(layout, LoadMode::kReload, batches);
  }
  ModelLayout fresh = cold_loaded_layout(second, 2, 1);
  EXPECT_EQ(compare_layouts(layout, fresh).mismatched, 0u);
  EXPECT_EQ(storage_addresses(layout), addresses);
  EXPECT_EQ(layout.allocated_bytes(), allocated);
}

TEST(LoadSession, EngineFormatCopiesParametersInPlace) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("qwen3");
  ModelLayout source = cold_loaded_layout(checkpoint, 2, 1);
  std::vector<std::vector<std::byte>> copies;
  std::vector<TensorView> views;
  for (const Parameter& parameter : source.parameters()) copies.push_back(parameter_bytes(parameter));
  for (size_t i = 0; i < copies.size(); ++i) {
    const Parameter& parameter = source.parameters()[i];
    views.push_back({parameter.name, parameter.dtype, parameter.shape, copies[i].data(), Device{}, 0, copies[i].size()});
  }
  ModelLayout target = host_layout(checkpoint, 2, 1);
  LoadSession session(target);
  session.begin(LoadMode::kCold, TensorFormat::kEngine);
  session.load(views);
  session.finish();
  EXPECT_EQ(compare_layouts(source, target).mismatched, 0u);
}

TEST(LoadSession, CheckThrowsALoadsErrorsAndWritesNothing) {
  // A source that lands bytes in the parameters itself checks the batch first: the same
  // errors as load(), nothing counted or written, and the load goes on.
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = host_layout(checkpoint);
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  const auto& norm = checkpoint.tensor("model.norm.weight");
  std::vector<int64_t> wrong = {norm.shape[0] / 2};
  TensorView half{norm.name, norm.dtype, wrong, norm.bytes.data(), Device{}, 0, norm.bytes.size() / 2};
  std::vector<TensorView> batch = checkpoint.views();
  batch.push_back(half);
  try {
    session.check(batch);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kModel);
    EXPECT_THAT(error.what(), HasSubstr("tensor model.norm.weight has shape"));
  }
  session.check(checkpoint.views());  // twice: a check delivers nothing
  session.check(checkpoint.views());
  EXPECT_EQ(session.counters().bytes_applied, 0u);
  EXPECT_TRUE(session.touched_layers().empty());
  session.load(checkpoint.views());
  session.finish();
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(checkpoint)).mismatched, 0u);
  EXPECT_EQ(session.touched_layers(), session.completed_layers());
}

TEST(LoadSession, FinishAfterAFailedBatchRefusesWithTheFirstError) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = host_layout(checkpoint);
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  const auto& norm = checkpoint.tensor("model.norm.weight");
  std::vector<int64_t> wrong = {norm.shape[0] / 2};
  TensorView half{norm.name, norm.dtype, wrong, norm.bytes.data(), Device{}, 0, norm.bytes.size() / 2};
  EXPECT_THROW(session.load(half), Error);
  try {
    session.load(checkpoint.views());
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("cannot go on with the cold load of"));
    EXPECT_THAT(error.what(), HasSubstr("an earlier batch failed (tensor model.norm.weight has shape"));
  }
  try {
    session.finish();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kModel);
    EXPECT_THAT(error.what(), HasSubstr("cannot finish the cold load of"));
    EXPECT_THAT(error.what(), HasSubstr("a batch failed (tensor model.norm.weight has shape"));
  }
  // A new load begins afresh.
  session.begin(LoadMode::kCold);
  session.load(checkpoint.views());
  session.finish();
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(checkpoint)).mismatched, 0u);
}

TEST(LoadSession, WholeLayerCommitWritesALayerOnlyWhenAllOfItArrived) {
  const MemoryCheckpoint& first = cached_checkpoint("qwen3", 1);
  const MemoryCheckpoint& second = cached_checkpoint("qwen3", 2);
  for (int64_t tp : {1, 2}) {
    ModelLayout layout = cold_loaded_layout(first, tp, tp - 1);
    ModelLayout old_values = cold_loaded_layout(first, tp, tp - 1);
    ModelLayout new_values = cold_loaded_layout(second, tp, tp - 1);
    std::vector<TensorView> layer0 = second.views_matching("model.layers.0.");
    ASSERT_GT(layer0.size(), 2u);
    LoadSession session(layout);
    session.begin(LoadMode::kReload, TensorFormat::kCheckpoint, LayerCommit::kWholeLayer);
    // All of layer 0 but its last tensor, in pieces: nothing of the layer is written yet.
    for (size_t i = 0; i + 1 < layer0.size(); ++i) {
      const testing::MemoryTensor& tensor = second.tensor(layer0[i].name);
      uint64_t half = tensor.bytes.size() / 2;
      session.load(tensor.piece(0, half));
      session.load(tensor.piece(half, tensor.bytes.size() - half));
    }
    for (size_t index : layout.layer_parameters(0)) {
      const std::string& name = layout.parameters()[index].name;
      EXPECT_EQ(testing::bytes_of(layout, name), testing::bytes_of(old_values, name)) << name;
    }
    EXPECT_TRUE(session.completed_layers().empty());
    session.load(layer0.back());
    for (size_t index : layout.layer_parameters(0)) {
      const std::string& name = layout.parameters()[index].name;
      EXPECT_EQ(testing::bytes_of(layout, name), testing::bytes_of(new_values, name)) << name;
    }
    EXPECT_EQ(session.completed_layers(), std::vector<int64_t>{0});
    // Layer 1 in part, then a failure: layer 1 keeps its old values.
    std::vector<TensorView> layer1 = second.views_matching("model.layers.1.");
    session.load(layer1.front());
    std::vector<std::byte> junk(8);
    std::vector<int64_t> shape = {4};
    EXPECT_THROW(session.load(TensorView{"model.layers.1.not_a_weight", Dtype::kBF16, shape, junk.data(), Device{}, 0, 8}),
                 Error);
    try {
      session.finish();
      FAIL() << "expected an error";
    } catch (const Error& error) {
      EXPECT_THAT(error.what(), HasSubstr("layers not completed before the failure keep their old values"));
    }
    for (size_t index : layout.layer_parameters(1)) {
      const std::string& name = layout.parameters()[index].name;
      EXPECT_EQ(testing::bytes_of(layout, name), testing::bytes_of(old_values, name)) << name;
    }
  }
}

TEST(LoadSession, AReloadThatLeavesPartOfATensorOutIsRefused) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = cold_loaded_layout(checkpoint);
  const auto& tensor = checkpoint.tensor("model.layers.0.mlp.down_proj.weight");
  LoadSession session(layout);
  session.begin(LoadMode::kReload);
  session.load(tensor.piece(0, 1024));
  try {
    session.finish();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("reload load of"));
    EXPECT_THAT(error.what(), HasSubstr("1 tensor arrived in part (a load may leave out a tensor, not part of one): "
                                        "model.layers.0.mlp.down_proj.weight (1024 of the "));
  }
}

}  // namespace
}  // namespace weightstream

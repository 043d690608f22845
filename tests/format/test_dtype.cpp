#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "weightstream/format.hpp"

namespace weightstream {
namespace {

TEST(Dtype, NamesRoundTrip) {
  for (int i = 0; i <= static_cast<int>(Dtype::kF6E3M2); ++i) {
    auto dtype = static_cast<Dtype>(i);
    EXPECT_EQ(dtype_from_name(dtype_name(dtype)), dtype) << dtype_name(dtype);
  }
  EXPECT_EQ(dtype_from_name("bf16"), std::nullopt);  // names are case-sensitive, as in the format
  EXPECT_EQ(dtype_from_name(""), std::nullopt);
  EXPECT_EQ(dtype_name(Dtype::kF8E4M3Fnuz), "F8_E4M3FNUZ");
}

TEST(Dtype, Bits) {
  EXPECT_EQ(dtype_bits(Dtype::kBool), 8u);
  EXPECT_EQ(dtype_bits(Dtype::kBF16), 16u);
  EXPECT_EQ(dtype_bits(Dtype::kC64), 64u);
  EXPECT_EQ(dtype_bits(Dtype::kF8E8M0), 8u);
  EXPECT_EQ(dtype_bits(Dtype::kF4), 4u);
  EXPECT_EQ(dtype_bits(Dtype::kF6E2M3), 6u);
  EXPECT_EQ(dtype_bits(Dtype::kF6E3M2), 6u);
}

TEST(Dtype, TensorByteSize) {
  std::vector<int64_t> shape = {4096, 11008};
  EXPECT_EQ(tensor_byte_size(Dtype::kBF16, shape), 4096u * 11008u * 2u);
  EXPECT_EQ(tensor_byte_size(Dtype::kF32, {}), 4u);  // a scalar holds one element
  std::vector<int64_t> empty = {0, 7};
  EXPECT_EQ(tensor_byte_size(Dtype::kF64, empty), 0u);
  std::vector<int64_t> odd = {3};
  EXPECT_EQ(tensor_byte_size(Dtype::kF4, odd), std::nullopt);
  std::vector<int64_t> even = {6};
  EXPECT_EQ(tensor_byte_size(Dtype::kF4, even), 3u);
  std::vector<int64_t> four = {4};
  EXPECT_EQ(tensor_byte_size(Dtype::kF6E3M2, four), 3u);
  std::vector<int64_t> negative = {2, -1};
  EXPECT_EQ(tensor_byte_size(Dtype::kU8, negative), std::nullopt);
  std::vector<int64_t> huge = {int64_t{1} << 32, int64_t{1} << 32};
  EXPECT_EQ(tensor_byte_size(Dtype::kU8, huge), std::nullopt);
  std::vector<int64_t> bits_overflow = {int64_t{1} << 62};
  EXPECT_EQ(tensor_byte_size(Dtype::kU8, bits_overflow), std::nullopt);
  EXPECT_EQ(tensor_element_count(huge), std::nullopt);
  EXPECT_EQ(tensor_element_count(shape), 4096u * 11008u);
}

TEST(Dtype, ShapeText) {
  std::vector<int64_t> shape = {4096, 11008};
  EXPECT_EQ(shape_text(shape), "[4096, 11008]");
  EXPECT_EQ(shape_text({}), "[]");
}

}  // namespace
}  // namespace weightstream

#include "proto/chunk_frame.h"

#include <cstring>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/checksum.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/shard.pb.h"

namespace pshard {
namespace {

// `bytes` as a ByteBuffer cut into slices at the given lengths (the rest in
// one last slice), as gRPC may hand a message over. gRPC merges adjacent
// slices of up to 23 bytes, so the cuts that matter are longer.
grpc::ByteBuffer Cut(const std::string& bytes, const std::vector<size_t>& lengths) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t n : lengths) {
    n = std::min(n, bytes.size() - at);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Joined(const FrameData& data) {
  std::string out;
  for (std::span<const std::byte> p : data.pieces) out.append(reinterpret_cast<const char*>(p.data()), p.size());
  return out;
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

v1::PushChunk SamplePush(const std::string& data) {
  v1::PushChunk chunk;
  chunk.set_trainer_rank(3);
  chunk.set_step(1234567890123);
  chunk.set_unit(7);
  chunk.set_encoding(v1::ENCODING_BF16);
  chunk.set_chunk_index(2);
  chunk.set_offset(-5);  // negative varints take ten bytes
  chunk.set_data(data);
  chunk.set_slice_length(99);
  chunk.set_micro_batch(1);
  chunk.set_rank_count(2);
  return chunk;
}

TEST(ChunkFrameTest, AFrameIsTheMessageTheGeneratedClassesRead) {
  v1::FetchChunk header;
  header.set_offset(4096);
  header.set_slice_length(1 << 20);
  header.set_checksum(0xdeadbeef);
  header.set_version(12);
  auto owner = std::make_shared<const std::string>(std::string(5000, 'x') + "tail");
  grpc::ByteBuffer frame = MakeFrame(
      header, kFetchChunkDataField,
      SliceOver(std::as_bytes(std::span<const char>(owner->data(), owner->size())), owner));
  v1::FetchChunk parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(frame)));
  EXPECT_EQ(parsed.offset(), 4096);
  EXPECT_EQ(parsed.slice_length(), 1 << 20);
  EXPECT_EQ(parsed.checksum(), 0xdeadbeefu);
  EXPECT_EQ(parsed.version(), 12);
  EXPECT_EQ(parsed.data(), *owner);
}

TEST(ChunkFrameTest, ParsesAGeneratedMessageCutAnywhere) {
  std::string data;
  for (int i = 0; i < 300; ++i) data.push_back(static_cast<char>(i * 7));
  v1::PushChunk chunk = SamplePush(data);
  std::string wire = chunk.SerializeAsString();
  // An unknown field after the data (a newer sender) is kept apart from it.
  wire += std::string("\xf8\x01\x05", 3);  // field 31, varint 5
  for (const std::vector<size_t>& cuts :
       {std::vector<size_t>{}, {1}, {24, 25, 26, 27, 28, 29, 30}, {26, 24}, {27, 29, 31, 37, 41}}) {
    FrameData got;
    v1::PushChunk header;
    ASSERT_TRUE(ParseFrame(Cut(wire, cuts), kPushChunkDataField, &header, &got).ok());
    EXPECT_EQ(Joined(got), data);
    EXPECT_EQ(got.size, data.size());
    EXPECT_TRUE(header.data().empty());
    v1::PushChunk expected = chunk;
    expected.clear_data();
    EXPECT_EQ(header.SerializeAsString().substr(0, expected.ByteSizeLong()), expected.SerializeAsString());
    EXPECT_EQ(header.step(), 1234567890123);
    EXPECT_EQ(header.offset(), -5);
    EXPECT_EQ(header.rank_count(), 2);
  }
}

TEST(ChunkFrameTest, TheLastDataFieldWinsAsInProtobuf) {
  v1::FetchChunk first;
  first.set_data("first");
  v1::FetchChunk second;
  second.set_data("second");
  second.set_offset(9);
  const std::string wire = first.SerializeAsString() + second.SerializeAsString();
  v1::FetchChunk reference;
  ASSERT_TRUE(reference.ParseFromString(wire));
  FrameData got;
  v1::FetchChunk header;
  ASSERT_TRUE(ParseFrame(Cut(wire, {4}), kFetchChunkDataField, &header, &got).ok());
  EXPECT_EQ(Joined(got), reference.data());
  EXPECT_EQ(header.offset(), 9);
}

TEST(ChunkFrameTest, RefusesMalformedFrames) {
  const std::string wire = SamplePush(std::string(100, 'a')).SerializeAsString();
  FrameData got;
  v1::PushChunk header;
  // Cut short inside the data field, and inside a varint.
  for (size_t keep : {wire.size() - 1, size_t{20}, size_t{1}}) {
    absl::Status s = ParseFrame(Cut(wire.substr(0, keep), {3}), kPushChunkDataField, &header, &got);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << keep;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("malformed pshard.v1.PushChunk"));
  }
  // A group (wire type 3) and field number 0.
  for (const std::string& bad : {std::string("\x0b", 1), std::string("\x00\x01", 2)}) {
    EXPECT_EQ(ParseFrame(Cut(bad, {}), kPushChunkDataField, &header, &got).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(ChunkFrameTest, SliceOverKeepsItsOwnerUntilGrpcLetsGo) {
  auto owner = std::make_shared<const std::vector<float>>(1000, 2.5f);
  std::weak_ptr<const std::vector<float>> watch = owner;
  {
    grpc::ByteBuffer frame = MakeFrame(v1::FetchChunk(), kFetchChunkDataField,
                                       SliceOver(std::as_bytes(std::span<const float>(*owner)), owner));
    owner.reset();
    grpc::ByteBuffer copy = frame;  // gRPC's copies share the slice
    frame.Clear();
    EXPECT_FALSE(watch.expired());
    v1::FetchChunk parsed;
    ASSERT_TRUE(parsed.ParseFromString(Flatten(copy)));
    ASSERT_EQ(parsed.data().size(), 4000u);
    float x;
    std::memcpy(&x, parsed.data().data() + 3996, 4);
    EXPECT_EQ(x, 2.5f);
  }
  EXPECT_TRUE(watch.expired());
}

TEST(ChunkFrameTest, DecodesElementsThatStraddlePiecesInOnePass) {
  std::vector<float> values(777);
  for (size_t i = 0; i < values.size(); ++i) values[i] = Bf16ToFloat(FloatToBf16(0.37f * i - 100.0f));
  // Blocks of 16 int8 elements (68 bytes) and of 32 int4 ones (20 bytes)
  // straddle the cuts too.
  for (const WireFormat& format : {WireFormat(WireEncoding::kFp32), WireFormat(WireEncoding::kBf16),
                                   WireFormat(WireEncoding::kInt8, 16), WireFormat(WireEncoding::kInt4, 32)}) {
    SCOPED_TRACE(format.ToString());
    std::string bytes(format.EncodedBytes(values.size()), '\0');
    EncodeElements(format, values, reinterpret_cast<std::byte*>(bytes.data()));
    std::vector<float> expected = values;
    RoundTripInPlace(format, expected);
    const uint32_t expected_crc = Crc32c(bytes.data(), bytes.size(), 0);
    v1::FetchChunk chunk;
    chunk.set_data(bytes);
    for (const std::vector<size_t>& cuts : {std::vector<size_t>{}, {30, 37, 41, 101, 26}, {25, 27, 29, 31, 600}}) {
      FrameData data;
      v1::FetchChunk header;
      ASSERT_TRUE(ParseFrame(Cut(chunk.SerializeAsString(), cuts), kFetchChunkDataField, &header, &data).ok());
      ASSERT_GT(data.pieces.size(), cuts.empty() ? 0u : 2u);
      std::vector<float> out(values.size(), -1.0f);
      EXPECT_EQ(DecodeFrameData(format, data, out, 0), expected_crc);
      EXPECT_EQ(out, expected);
    }
  }
}

}  // namespace
}  // namespace pshard

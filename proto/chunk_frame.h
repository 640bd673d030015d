// The data-carrying messages (FetchChunk, PushChunk) in their protobuf wire
// form, built and read without passing their `data` bytes through a
// std::string. The .proto stays the contract: a frame is an ordinary
// serialised message (its scalar fields, then the bytes field), so clients
// and servers that use the generated classes interoperate with it.
//
// Sending, the bytes field is a grpc::Slice that may reference memory the
// caller owns (a published version, a gradient) for as long as gRPC holds
// it. Receiving, the bytes field is a list of pieces that point into the
// slices gRPC received, to be moved once into their destination.
#ifndef PSHARD_PROTO_CHUNK_FRAME_H_
#define PSHARD_PROTO_CHUNK_FRAME_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "common/wire_encoding.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace pshard {

/// Field numbers of the bytes fields in shard.proto.
inline constexpr int kFetchChunkDataField = 2;
inline constexpr int kPushChunkDataField = 7;

/// The bytes of a received frame's data field, in order, pointing into the
/// slices that `slices` keeps alive.
struct FrameData {
  std::vector<grpc::Slice> slices;
  std::vector<std::span<const std::byte>> pieces;
  size_t size = 0;
};

/// A slice over `bytes` that keeps `owner` alive until gRPC lets go of it.
template <typename T>
grpc::Slice SliceOver(std::span<const std::byte> bytes, std::shared_ptr<const T> owner) {
  auto* hold = new std::shared_ptr<const T>(std::move(owner));
  return grpc::Slice(const_cast<std::byte*>(bytes.data()), bytes.size(),
                     [](void* p) { delete static_cast<std::shared_ptr<const T>*>(p); }, hold);
}

/// `header` (whose data field must be empty) followed by field `data_field`
/// holding `data`. Only the header's few bytes are copied.
grpc::ByteBuffer MakeFrame(const google::protobuf::MessageLite& header, int data_field, grpc::Slice data);

/// Splits a received frame: field `data_field` (the last occurrence, as
/// protobuf does) into `data`, everything else parsed into `header`. A frame
/// that is not a valid message is an InvalidArgument error.
absl::Status ParseFrame(const grpc::ByteBuffer& frame, int data_field, google::protobuf::MessageLite* header,
                        FrameData* data);

/// Decodes `data` (out.size() elements of a slice from a grain boundary in
/// `format`, data.size == format.EncodedBytes(out.size()), split anywhere:
/// an element or a block may straddle two pieces) into `out`, and returns
/// the CRC-32C of its bytes continued from `crc`: one pass over them.
uint32_t DecodeFrameData(const WireFormat& format, const FrameData& data, std::span<float> out, uint32_t crc);

/// A whole (small) message to or from a ByteBuffer: requests, responses.
grpc::ByteBuffer SerializeMessage(const google::protobuf::MessageLite& message);
absl::Status ParseMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message);

}  // namespace pshard

#endif  // PSHARD_PROTO_CHUNK_FRAME_H_

// The UCX data path's active messages: ids and fixed-size headers. Both ends
// run the same build, so the headers are plain little-endian structs.
// Requests carry the session token the server handed out at Join; replies
// echo the request id. No UCX header is needed here.
#ifndef PSHARD_COMMON_UCX_UCX_WIRE_H_
#define PSHARD_COMMON_UCX_UCX_WIRE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "absl/strings/string_view.h"

namespace pshard::ucx {

/// Active-message ids.
enum AmId : uint16_t {
  kFetchRequest = 1,  ///< trainer -> server: FetchHeader, no data
  kFetchReply = 2,    ///< server -> trainer: ReplyHeader, data = the encoded slice
  kPushRequest = 3,   ///< trainer -> server: PushHeader, data = the encoded slice
  kPushReply = 4,     ///< server -> trainer: ReplyHeader, no data
  /// trainer -> server, first on a new endpoint: HelloHeader, data = the
  /// trainer's worker address. The server answers this session over an
  /// endpoint of its own to that address, whose failure it is told of.
  kHello = 5,
};

struct HelloHeader {
  uint64_t token = 0;  ///< JoinResponse.session_token
  uint32_t flags = 0;  ///< kHelloSameHost
  uint32_t reserved = 0;
};
/// HelloHeader.flags: the trainer runs on the server's host and notices a
/// dead server itself, so the server's endpoint to it runs without UCX's
/// peer failure mode too, which lets UCX use shared memory.
inline constexpr uint32_t kHelloSameHost = 1;

struct FetchHeader {
  uint64_t token = 0;       ///< JoinResponse.session_token
  uint64_t request_id = 0;
  int64_t version = 0;
  int64_t wait_ms = 0;      ///< how long the trainer waits; the server answers before
  int32_t unit = 0;
  int32_t encoding = 0;     ///< v1::Encoding
  int32_t quant_block = 0;  ///< elements per scale (int8)
  int32_t reserved = 0;
  /// A piece of the encoded slice: `byte_length` bytes from `byte_offset`
  /// (fp32 only); byte_length 0 asks for the whole slice. The reply's
  /// checksum is the whole slice's either way: the trainer joins its
  /// pieces' checksums (Crc32cCombine).
  int64_t byte_offset = 0;
  int64_t byte_length = 0;
};

struct PushHeader {
  uint64_t token = 0;
  uint64_t request_id = 0;
  int64_t step = 0;
  int64_t slice_length = 0;  ///< elements in the data
  int32_t trainer = 0;       ///< ContributionId: first rank summed in
  int32_t rank_count = 1;
  int32_t micro_batch = 0;
  int32_t unit = 0;
  int32_t encoding = 0;     ///< v1::Encoding
  int32_t quant_block = 0;  ///< elements per scale (int8, int4)
  int32_t non_finite = 0;   ///< 1: PushChunk.non_finite
  int32_t reserved = 0;
};

/// Pushes: what became of the contribution (PushResponse::Disposition).
enum class Disposition : int32_t { kNone = 0, kAccepted = 1, kDuplicate = 2, kAcceptedNonFinite = 3 };

struct ReplyHeader {
  uint64_t request_id = 0;
  int64_t version = 0;       ///< fetch: the version sent
  int64_t slice_length = 0;  ///< fetch: elements in the data
  int32_t status_code = 0;   ///< absl::StatusCode
  uint32_t checksum = 0;     ///< fetch: CRC-32C of the encoded slice
  int32_t disposition = 0;   ///< push: Disposition
  uint32_t message_length = 0;
  char message[480] = {};    ///< the error, or a push's detail (truncated)

  void SetMessage(absl::string_view text) {
    message_length = static_cast<uint32_t>(std::min(text.size(), sizeof(message)));
    std::memcpy(message, text.data(), message_length);
  }
  absl::string_view Message() const {
    return absl::string_view(message, std::min<size_t>(message_length, sizeof(message)));
  }
};

static_assert(std::is_trivially_copyable_v<HelloHeader>);
static_assert(std::is_trivially_copyable_v<FetchHeader>);
static_assert(std::is_trivially_copyable_v<PushHeader>);
static_assert(std::is_trivially_copyable_v<ReplyHeader>);

/// Copies a received header out of an active message; false if the size is wrong.
template <typename Header>
bool ReadHeader(const void* data, size_t length, Header* out) {
  if (length != sizeof(Header)) return false;
  std::memcpy(out, data, sizeof(Header));
  return true;
}

}  // namespace pshard::ucx

#endif  // PSHARD_COMMON_UCX_UCX_WIRE_H_

#include "proto/chunk_frame.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace pshard {
namespace {

// Protobuf wire types (the deprecated groups, 3 and 4, are refused).
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// Reads a byte sequence that lies across several slices.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { SkipEmpty(); }

  bool done() const { return slice_ == slices_.size(); }

  bool ReadVarint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (done()) return false;
      const uint8_t byte = slices_[slice_].begin()[offset_];
      Advance(1);
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  // Moves over `n` bytes, handing each contiguous run to `visit`.
  template <typename Visit>
  bool Take(uint64_t n, Visit visit) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[slice_];
      const size_t run = static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      visit(std::span<const std::byte>(reinterpret_cast<const std::byte*>(s.begin()) + offset_, run));
      Advance(run);
      n -= run;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    if (offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (slice_ < slices_.size() && slices_[slice_].size() == 0) ++slice_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
};

}  // namespace

grpc::ByteBuffer MakeFrame(const google::protobuf::MessageLite& header, int data_field, grpc::Slice data) {
  std::string head = header.SerializeAsString();
  AppendVarint((static_cast<uint64_t>(data_field) << 3) | kLengthDelimited, &head);
  AppendVarint(data.size(), &head);
  grpc::Slice slices[2] = {grpc::Slice(head), std::move(data)};
  return grpc::ByteBuffer(slices, 2);
}

absl::Status ParseFrame(const grpc::ByteBuffer& frame, int data_field, google::protobuf::MessageLite* header,
                        FrameData* data) {
  *data = FrameData();
  if (grpc::Status s = frame.Dump(&data->slices); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("unreadable message: ", s.error_message()));
  }
  auto malformed = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("malformed ", header->GetTypeName(), ": ", what));
  };
  SliceCursor cursor(data->slices);
  std::string rest;  // every field but the data field, re-serialised for protobuf
  auto keep = [&rest](std::span<const std::byte> run) {
    rest.append(reinterpret_cast<const char*>(run.data()), run.size());
  };
  while (!cursor.done()) {
    uint64_t tag = 0;
    if (!cursor.ReadVarint(&tag) || (tag >> 3) == 0 || (tag >> 3) > (1u << 29)) return malformed("bad field tag");
    const int field = static_cast<int>(tag >> 3);
    const int type = static_cast<int>(tag & 7);
    if (field == data_field && type == kLengthDelimited) {
      uint64_t length = 0;
      if (!cursor.ReadVarint(&length)) return malformed("bad length");
      data->pieces.clear();  // a repeated occurrence replaces the earlier one
      data->size = 0;
      if (!cursor.Take(length, [data](std::span<const std::byte> run) {
            data->pieces.push_back(run);
            data->size += run.size();
          })) {
        return malformed("data field runs past the end");
      }
      continue;
    }
    AppendVarint(tag, &rest);
    bool ok = true;
    switch (type) {
      case kVarint: {
        uint64_t value = 0;
        ok = cursor.ReadVarint(&value);
        AppendVarint(value, &rest);
        break;
      }
      case kFixed64:
        ok = cursor.Take(8, keep);
        break;
      case kFixed32:
        ok = cursor.Take(4, keep);
        break;
      case kLengthDelimited: {
        uint64_t length = 0;
        ok = cursor.ReadVarint(&length);
        if (ok) {
          AppendVarint(length, &rest);
          ok = cursor.Take(length, keep);
        }
        break;
      }
      default:
        return malformed(absl::StrCat("field ", field, " has wire type ", type));
    }
    if (!ok) return malformed(absl::StrCat("field ", field, " runs past the end"));
  }
  if (!header->ParseFromString(rest)) return malformed("fields do not parse");
  return absl::OkStatus();
}

uint32_t DecodeFrameData(const WireFormat& format, const FrameData& data, std::span<float> out, uint32_t crc) {
  const size_t grain = format.GrainElements();
  std::vector<std::byte> straddle;  // a grain split across two pieces
  size_t at = 0;                    // elements decoded
  for (std::span<const std::byte> piece : data.pieces) {
    if (!straddle.empty()) {
      const size_t n = std::min(grain, out.size() - at);
      const size_t need = format.EncodedBytes(n);
      const size_t take = std::min(need - straddle.size(), piece.size());
      straddle.insert(straddle.end(), piece.begin(), piece.begin() + take);
      piece = piece.subspan(take);
      if (straddle.size() < need) continue;
      crc = DecodeAndChecksum(format, straddle.data(), out.subspan(at, n), crc);
      at += n;
      straddle.clear();
    }
    // `at` is on a grain boundary: the piece's whole grains decode in place.
    const size_t rest = out.size() - at;
    const size_t n = piece.size() >= format.EncodedBytes(rest) ? rest : piece.size() / format.GrainBytes() * grain;
    crc = DecodeAndChecksum(format, piece.data(), out.subspan(at, n), crc);
    at += n;
    straddle.assign(piece.begin() + format.EncodedBytes(n), piece.end());
  }
  return crc;
}

grpc::ByteBuffer SerializeMessage(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

absl::Status ParseMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message) {
  grpc::Slice whole;
  if (grpc::Status s = buffer.DumpToSingleSlice(&whole); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("unreadable message: ", s.error_message()));
  }
  if (!message->ParseFromArray(whole.begin(), static_cast<int>(whole.size()))) {
    return absl::InvalidArgumentError(absl::StrCat("malformed ", message->GetTypeName()));
  }
  return absl::OkStatus();
}

}  // namespace pshard

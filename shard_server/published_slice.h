// One version of a unit's slice as it goes on the wire in one encoding: its
// bytes and their CRC-32C, made once when the version is published and then
// sent from by every fetch of that version. A PublishedSlice is immutable
// while it is shared: a fetch holds it (std::shared_ptr) for as long as it
// sends from it, and the next version never writes into bytes that a fetch
// still holds (the owner copies first, see ShardState::ApplyStep).
#ifndef PSHARD_SHARD_SERVER_PUBLISHED_SLICE_H_
#define PSHARD_SHARD_SERVER_PUBLISHED_SLICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/wire_encoding.h"

namespace pshard {

class PublishedSlice {
 public:
  /// The fp32 view of `master`: its own bytes, shared rather than copied.
  static std::shared_ptr<PublishedSlice> OfMaster(std::shared_ptr<const std::vector<float>> master);
  /// `master` encoded in `format` (not fp32). Writes into `reuse`'s
  /// storage when it is given and nobody else holds it, else into new.
  static std::shared_ptr<PublishedSlice> Encode(const WireFormat& format, std::span<const float> master,
                                                std::shared_ptr<PublishedSlice> reuse);

  const WireFormat& format() const { return format_; }
  uint32_t checksum() const { return checksum_; }
  int64_t elements() const { return elements_; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  /// Bytes held besides the master's own (0 for the fp32 view).
  int64_t extra_bytes() const { return static_cast<int64_t>(encoded_.size()); }

 private:
  PublishedSlice() = default;

  WireFormat format_;
  uint32_t checksum_ = 0;
  int64_t elements_ = 0;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
  std::shared_ptr<const std::vector<float>> master_;  // the fp32 view's bytes
  std::vector<std::byte> encoded_;                    // any other encoding's
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_PUBLISHED_SLICE_H_

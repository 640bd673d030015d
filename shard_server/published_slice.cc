#include "shard_server/published_slice.h"

#include <algorithm>

#include "common/checksum.h"

namespace pshard {

std::shared_ptr<PublishedSlice> PublishedSlice::OfMaster(std::shared_ptr<const std::vector<float>> master) {
  std::shared_ptr<PublishedSlice> p(new PublishedSlice());
  p->format_ = WireFormat(WireEncoding::kFp32);
  p->elements_ = static_cast<int64_t>(master->size());
  p->data_ = reinterpret_cast<const std::byte*>(master->data());
  p->size_ = master->size() * sizeof(float);
  p->checksum_ = Crc32c(p->data_, p->size_);
  p->master_ = std::move(master);
  return p;
}

std::shared_ptr<PublishedSlice> PublishedSlice::Encode(const WireFormat& format, std::span<const float> master,
                                                       std::shared_ptr<PublishedSlice> reuse) {
  std::shared_ptr<PublishedSlice> p =
      reuse != nullptr && reuse.use_count() == 1 ? std::move(reuse) : std::shared_ptr<PublishedSlice>(new PublishedSlice());
  p->format_ = format;
  p->elements_ = static_cast<int64_t>(master.size());
  p->encoded_.resize(format.EncodedBytes(master.size()));
  // Encode and checksum piece by piece (whole blocks), while it is in cache.
  const size_t piece = format.ElementsPerPiece(32 << 10);
  uint32_t crc = 0;
  for (size_t at = 0; at < master.size(); at += piece) {
    const size_t n = std::min(piece, master.size() - at);
    std::byte* out = p->encoded_.data() + format.EncodedBytes(at);
    EncodeElements(format, master.subspan(at, n), out);
    crc = Crc32c(out, format.EncodedBytes(at + n) - format.EncodedBytes(at), crc);
  }
  p->checksum_ = crc;
  p->data_ = p->encoded_.data();
  p->size_ = p->encoded_.size();
  return p;
}

}  // namespace pshard

#include "shard_server/published_slice.h"

#include <algorithm>

#include "common/checksum.h"

namespace pshard {

std::shared_ptr<PublishedSlice> PublishedSlice::OfMaster(std::shared_ptr<const std::vector<float>> master) {
  std::shared_ptr<PublishedSlice> p(new PublishedSlice());
  p->encoding_ = WireEncoding::kFp32;
  p->elements_ = static_cast<int64_t>(master->size());
  p->data_ = reinterpret_cast<const std::byte*>(master->data());
  p->size_ = master->size() * sizeof(float);
  p->checksum_ = Crc32c(p->data_, p->size_);
  p->master_ = std::move(master);
  return p;
}

std::shared_ptr<PublishedSlice> PublishedSlice::Encode(WireEncoding encoding, std::span<const float> master,
                                                       std::shared_ptr<PublishedSlice> reuse) {
  std::shared_ptr<PublishedSlice> p =
      reuse != nullptr && reuse.use_count() == 1 ? std::move(reuse) : std::shared_ptr<PublishedSlice>(new PublishedSlice());
  const size_t width = BytesPerElement(encoding);
  p->encoding_ = encoding;
  p->elements_ = static_cast<int64_t>(master.size());
  p->encoded_.resize(master.size() * width);
  // Encode and checksum block by block, while the block is in cache.
  constexpr size_t kBlock = 16384;
  uint32_t crc = 0;
  for (size_t at = 0; at < master.size(); at += kBlock) {
    const size_t n = std::min(kBlock, master.size() - at);
    std::byte* out = p->encoded_.data() + at * width;
    EncodeElements(encoding, master.subspan(at, n), out);
    crc = Crc32c(out, n * width, crc);
  }
  p->checksum_ = crc;
  p->data_ = p->encoded_.data();
  p->size_ = p->encoded_.size();
  return p;
}

}  // namespace pshard

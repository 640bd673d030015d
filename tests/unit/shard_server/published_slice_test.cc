// Published slices: the bytes and checksum of a version in one encoding,
// shared by fetches; storage is reused only when nobody else holds it.
#include "shard_server/published_slice.h"

#include <cstring>
#include <vector>

#include "common/checksum.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

std::vector<float> Values(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(i) - 3.25f;
  return v;
}

TEST(PublishedSliceTest, TheFp32ViewIsTheMastersOwnBytes) {
  auto master = std::make_shared<std::vector<float>>(Values(1000, 0.5f));
  std::shared_ptr<PublishedSlice> p = PublishedSlice::OfMaster(master);
  EXPECT_EQ(p->format(), WireFormat(WireEncoding::kFp32));
  EXPECT_EQ(p->elements(), 1000);
  EXPECT_EQ(static_cast<const void*>(p->bytes().data()), static_cast<const void*>(master->data()));
  EXPECT_EQ(p->bytes().size(), 4000u);
  EXPECT_EQ(p->checksum(), Crc32c(master->data(), 4000));
  EXPECT_EQ(p->extra_bytes(), 0);
  // It keeps the master's storage alive.
  const float* data = master->data();
  master.reset();
  EXPECT_EQ(reinterpret_cast<const float*>(p->bytes().data())[999], data[999]);
}

TEST(PublishedSliceTest, AnEncodedViewHoldsTheEncodedBytesAndTheirChecksum) {
  const std::vector<float> master = Values(40000, 1e-3f);  // several encoding blocks
  std::shared_ptr<PublishedSlice> p = PublishedSlice::Encode(WireEncoding::kBf16, master, nullptr);
  std::vector<std::byte> want(master.size() * 2);
  EncodeElements(WireEncoding::kBf16, master, want.data());
  ASSERT_EQ(p->bytes().size(), want.size());
  EXPECT_EQ(std::memcmp(p->bytes().data(), want.data(), want.size()), 0);
  EXPECT_EQ(p->checksum(), Crc32c(want.data(), want.size()));
  EXPECT_EQ(p->extra_bytes(), 80000);
}

TEST(PublishedSliceTest, StorageIsReusedOnlyWhenNobodyElseHoldsIt) {
  const std::vector<float> v1 = Values(5000, 1.0f), v2 = Values(5000, -2.0f);
  std::shared_ptr<PublishedSlice> first = PublishedSlice::Encode(WireEncoding::kBf16, v1, nullptr);
  const std::byte* storage = first->bytes().data();
  // A fetch still sends from the first version: the next one gets new storage.
  std::shared_ptr<const PublishedSlice> reader = first;
  const uint32_t first_checksum = first->checksum();
  std::shared_ptr<PublishedSlice> second = PublishedSlice::Encode(WireEncoding::kBf16, v2, std::move(first));
  EXPECT_NE(second->bytes().data(), storage);
  EXPECT_EQ(reader->bytes().data(), storage);
  EXPECT_EQ(reader->checksum(), first_checksum);
  std::vector<std::byte> want(v1.size() * 2);
  EncodeElements(WireEncoding::kBf16, v1, want.data());
  EXPECT_EQ(std::memcmp(reader->bytes().data(), want.data(), want.size()), 0) << "a held version changed";
  // Once the reader lets go, the storage is written in place.
  reader.reset();
  const std::byte* second_storage = second->bytes().data();
  std::shared_ptr<PublishedSlice> third = PublishedSlice::Encode(WireEncoding::kBf16, v1, std::move(second));
  EXPECT_EQ(third->bytes().data(), second_storage);
  EXPECT_EQ(third->checksum(), first_checksum);
}

}  // namespace
}  // namespace pshard

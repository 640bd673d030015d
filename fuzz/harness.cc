#include "fuzz/harness.h"

#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace pshard::fuzz {

std::string_view FuzzInput::NextRecord() {
  if (done()) return {};
  size_t length = static_cast<uint8_t>(bytes_[at_]);
  if (at_ + 1 < bytes_.size()) length |= static_cast<size_t>(static_cast<uint8_t>(bytes_[at_ + 1])) << 8;
  at_ = std::min(at_ + 2, bytes_.size());
  const std::string_view record = bytes_.substr(at_, length);
  at_ += record.size();
  return record;
}

std::vector<std::string_view> FuzzInput::Records(size_t limit) {
  std::vector<std::string_view> records;
  while (!done() && records.size() < limit) records.push_back(NextRecord());
  return records;
}

std::string FuzzRecords(uint8_t choices, const std::vector<std::string>& records) {
  std::string out(1, static_cast<char>(choices));
  for (const std::string& r : records) {
    const size_t length = std::min<size_t>(r.size(), 0xffff);
    out.push_back(static_cast<char>(length & 0xff));
    out.push_back(static_cast<char>(length >> 8));
    out.append(r, 0, length);
  }
  return out;
}

void Require(bool holds, std::string_view what) {
  if (holds) return;
  std::fprintf(stderr, "fuzz invariant broken: %.*s\n", static_cast<int>(what.size()), what.data());
  std::abort();
}

const std::string& ScratchFolder() {
  static const std::string* folder = [] {
    const char* tmp = getenv("TMPDIR");
    auto* path = new std::string(std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/pshard-fuzz-XXXXXX");
    Require(mkdtemp(path->data()) != nullptr, "cannot make a scratch folder");
    return path;
  }();
  return *folder;
}

}  // namespace pshard::fuzz

#include "common/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/json.h"

namespace pshard {
namespace {

constexpr std::string_view kMetadataKey = "__metadata__";

void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetU64(std::string_view in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(in[i])) << (8 * i);
  return v;
}

// A JSON number that is a whole number in [0, limit], or -1.
int64_t WholeNumber(const JsonValue& v, double limit) {
  if (!v.is_number()) return -1;
  const double d = v.as_number();
  if (!(d >= 0 && d <= limit) || std::floor(d) != d) return -1;
  return static_cast<int64_t>(d);
}

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("not a safetensors file of F32/BF16 tensors: ", what));
}

}  // namespace

std::string_view SafetensorsDtypeName(SafetensorsDtype dtype) {
  return dtype == SafetensorsDtype::kF32 ? "F32" : "BF16";
}

int SafetensorsDtypeBytes(SafetensorsDtype dtype) { return dtype == SafetensorsDtype::kF32 ? 4 : 2; }

absl::StatusOr<std::string> EncodeSafetensors(std::span<const SafetensorsTensorView> tensors,
                                              const std::map<std::string, std::string>& metadata) {
  JsonValue::Object header;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const SafetensorsTensorView& t : tensors) {
    if (t.name.empty() || t.name == kMetadataKey) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: a tensor cannot be named \"", t.name, "\""));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", t.name, " given twice"));
    }
    uint64_t numel = 1;
    JsonValue::Array shape;
    for (int64_t d : t.shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", t.name, " has a negative dimension"));
      numel *= static_cast<uint64_t>(d);
      shape.push_back(JsonValue::Number(static_cast<double>(d)));
    }
    const uint64_t bytes = numel * SafetensorsDtypeBytes(t.dtype);
    if (bytes != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", t.name, " has ", t.data.size(),
                                                     " bytes of data; its shape needs ", bytes));
    }
    header[t.name] = JsonValue::MakeObject({
        {"dtype", JsonValue::String(std::string(SafetensorsDtypeName(t.dtype)))},
        {"shape", JsonValue::MakeArray(std::move(shape))},
        {"data_offsets", JsonValue::MakeArray({JsonValue::Number(static_cast<double>(offset)),
                                               JsonValue::Number(static_cast<double>(offset + bytes))})},
    });
    offset += bytes;
  }
  if (!metadata.empty()) {
    JsonValue::Object meta;
    for (const auto& [k, v] : metadata) meta[k] = JsonValue::String(v);
    header[std::string(kMetadataKey)] = JsonValue::MakeObject(std::move(meta));
  }
  std::string json = FormatJson(JsonValue::MakeObject(std::move(header)), /*one_line=*/true);
  while (!json.empty() && json.back() == '\n') json.pop_back();
  // The data starts 8-byte aligned: pad the header with spaces.
  json.append((8 - (8 + json.size()) % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + json.size() + offset);
  PutU64(&out, json.size());
  out += json;
  for (const SafetensorsTensorView& t : tensors) out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  return out;
}

absl::Status WriteSafetensors(const std::string& path, std::span<const SafetensorsTensorView> tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> bytes = EncodeSafetensors(tensors, metadata);
  if (!bytes.ok()) return bytes.status();
  const std::string tmp = path + ".partial";
  auto fail = [&](const char* what) {
    const absl::Status s = absl::InternalError(absl::StrCat(what, " ", tmp, ": ", std::strerror(errno)));
    std::remove(tmp.c_str());
    return s;
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  size_t written = 0;
  while (written < bytes->size()) {
    const ssize_t n = ::write(fd, bytes->data() + written, bytes->size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      return fail("cannot write");
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    return fail("cannot sync");
  }
  ::close(fd);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return fail("cannot rename into place");
  return absl::OkStatus();
}

std::vector<float> SafetensorsTensor::ToFloat() const {
  std::vector<float> out(numel);
  if (dtype == SafetensorsDtype::kF32) {
    std::memcpy(out.data(), data.data(), out.size() * sizeof(float));
  } else {
    for (int64_t i = 0; i < numel; ++i) {
      uint16_t b;
      std::memcpy(&b, data.data() + 2 * i, 2);
      out[i] = Bf16ToFloat(b);
    }
  }
  return out;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  for (const SafetensorsTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const SafetensorsEntry* SafetensorsIndex::Find(std::string_view name) const {
  for (const SafetensorsEntry& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(std::string_view head, uint64_t file_size) {
  if (file_size < 8 || head.size() < 8) {
    return Bad(absl::StrCat(file_size, " bytes, shorter than the header length"));
  }
  const uint64_t header_bytes = GetU64(head);
  if (header_bytes > kSafetensorsMaxHeaderBytes) {
    return Bad(absl::StrCat("a header of ", header_bytes, " bytes (at most ", kSafetensorsMaxHeaderBytes, ")"));
  }
  if (header_bytes > file_size - 8) {
    return Bad(absl::StrCat("a header of ", header_bytes, " bytes in a file of ", file_size));
  }
  if (header_bytes > head.size() - 8) {
    return Bad(absl::StrCat("a header of ", header_bytes, " bytes of which ", head.size() - 8, " were read"));
  }
  absl::StatusOr<JsonValue> header = ParseJson(head.substr(8, header_bytes));
  if (!header.ok()) return Bad(absl::StrCat("the header is not JSON (", header.status().message(), ")"));
  if (!header->is_object()) return Bad("the header is not a JSON object");
  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_size = file_size - data_start;

  SafetensorsIndex index;
  for (const auto& [name, entry] : header->as_object()) {
    if (name == kMetadataKey) {
      if (!entry.is_object()) return Bad("__metadata__ is not an object");
      for (const auto& [k, v] : entry.as_object()) {
        if (!v.is_string()) return Bad(absl::StrCat("__metadata__ entry ", k, " is not a string"));
        index.metadata[k] = v.as_string();
      }
      continue;
    }
    // The writer refuses what it could not name either.
    if (name.empty()) return Bad("a tensor has an empty name");
    if (!entry.is_object()) return Bad(absl::StrCat("tensor ", name, " is not an object"));
    const JsonValue* dtype = entry.Find("dtype");
    const JsonValue* shape = entry.Find("shape");
    const JsonValue* offsets = entry.Find("data_offsets");
    if (!dtype || !shape || !offsets || entry.as_object().size() != 3) {
      return Bad(absl::StrCat("tensor ", name, " needs exactly dtype, shape and data_offsets"));
    }
    SafetensorsEntry t;
    t.name = name;
    if (dtype->is_string() && dtype->as_string() == "F32") {
      t.dtype = SafetensorsDtype::kF32;
    } else if (dtype->is_string() && dtype->as_string() == "BF16") {
      t.dtype = SafetensorsDtype::kBF16;
    } else {
      return Bad(absl::StrCat("tensor ", name, " has dtype ", dtype->is_string() ? dtype->as_string() : "(not a string)",
                              "; pshard reads F32 and BF16"));
    }
    if (!shape->is_array()) return Bad(absl::StrCat("tensor ", name, ": shape is not an array"));
    uint64_t numel = 1;
    bool overflow = false;
    for (const JsonValue& d : shape->as_array()) {
      const int64_t dim = WholeNumber(d, static_cast<double>(data_size));
      if (dim < 0) return Bad(absl::StrCat("tensor ", name, ": a dimension is not a whole number within the file"));
      t.shape.push_back(dim);
      overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel);
    }
    for (int64_t dim : t.shape) {
      if (dim == 0) numel = 0, overflow = false;
    }
    if (overflow) return Bad(absl::StrCat("tensor ", name, ": its shape has more elements than the file has bytes"));
    if (!offsets->is_array() || offsets->as_array().size() != 2) {
      return Bad(absl::StrCat("tensor ", name, ": data_offsets is not [begin, end]"));
    }
    const int64_t begin = WholeNumber(offsets->as_array()[0], static_cast<double>(data_size));
    const int64_t end = WholeNumber(offsets->as_array()[1], static_cast<double>(data_size));
    if (begin < 0 || end < begin) {
      return Bad(absl::StrCat("tensor ", name, ": data_offsets are not 0 <= begin <= end <= ", data_size));
    }
    if (numel > data_size || numel * SafetensorsDtypeBytes(t.dtype) != static_cast<uint64_t>(end - begin)) {
      return Bad(absl::StrCat("tensor ", name, ": its shape needs a different size than its ", end - begin,
                              " bytes of data"));
    }
    t.numel = static_cast<int64_t>(numel);
    t.offset = static_cast<uint64_t>(begin);  // within the data until they are checked
    t.bytes = static_cast<uint64_t>(end - begin);
    index.tensors.push_back(std::move(t));
  }
  // The tensors tile the data: in offset order, each starts where the last ended.
  std::sort(index.tensors.begin(), index.tensors.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.bytes < b.bytes;
  });
  uint64_t at = 0;
  for (SafetensorsEntry& t : index.tensors) {
    if (t.offset != at) {
      return Bad(absl::StrCat("tensor ", t.name, " starts at byte ", t.offset, " of the data, not ", at,
                              " (tensors overlap or leave a gap)"));
    }
    at += t.bytes;
    t.offset += data_start;
  }
  if (at != data_size) return Bad(absl::StrCat(data_size - at, " bytes after the last tensor"));
  return index;
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(std::string_view bytes) {
  absl::StatusOr<SafetensorsIndex> index = ParseSafetensorsIndex(bytes, bytes.size());
  if (!index.ok()) return index.status();
  SafetensorsFile file;
  file.metadata = std::move(index->metadata);
  file.tensors.reserve(index->tensors.size());
  for (SafetensorsEntry& e : index->tensors) {
    SafetensorsTensor t;
    t.name = std::move(e.name);
    t.dtype = e.dtype;
    t.shape = std::move(e.shape);
    t.numel = e.numel;
    t.data.assign(bytes.substr(e.offset, e.bytes));
    file.tensors.push_back(std::move(t));
  }
  return file;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(text.str());
  if (!file.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", file.status().message()));
  return file;
}

absl::StatusOr<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::error_code error;
  const uint64_t size = std::filesystem::file_size(path, error);
  if (error) return absl::NotFoundError(absl::StrCat("cannot read ", path, ": ", error.message()));
  std::string head(std::min<uint64_t>(size, 8), '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  if (size >= 8 && in) {
    const uint64_t header_bytes = std::min(GetU64(head), std::min(size - 8, kSafetensorsMaxHeaderBytes));
    head.resize(8 + header_bytes);
    in.read(head.data() + 8, static_cast<std::streamsize>(header_bytes));
  }
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  absl::StatusOr<SafetensorsIndex> index = ParseSafetensorsIndex(head, size);
  if (!index.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", index.status().message()));
  return index;
}

}  // namespace pshard

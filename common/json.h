// A small JSON reader for configuration files (topologies) and writer for
// reports. Strict RFC 8259
// syntax; numbers are doubles; no comments.
#ifndef PSHARD_COMMON_JSON_H_
#define PSHARD_COMMON_JSON_H_

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"

namespace pshard {

/// One JSON value. A plain value type.
class JsonValue {
 public:
  using Array = std::vector<JsonValue>;
  using Object = std::map<std::string, JsonValue>;

  JsonValue() = default;
  bool is_null() const { return std::holds_alternative<std::monostate>(value_); }
  bool is_bool() const { return std::holds_alternative<bool>(value_); }
  bool is_number() const { return std::holds_alternative<double>(value_); }
  bool is_string() const { return std::holds_alternative<std::string>(value_); }
  bool is_array() const { return std::holds_alternative<std::shared_ptr<Array>>(value_); }
  bool is_object() const { return std::holds_alternative<std::shared_ptr<Object>>(value_); }

  bool as_bool() const { return std::get<bool>(value_); }
  double as_number() const { return std::get<double>(value_); }
  const std::string& as_string() const { return std::get<std::string>(value_); }
  const Array& as_array() const { return *std::get<std::shared_ptr<Array>>(value_); }
  const Object& as_object() const { return *std::get<std::shared_ptr<Object>>(value_); }
  /// The member `key` of an object, or nullptr.
  const JsonValue* Find(const std::string& key) const;

  static JsonValue Bool(bool b) { return JsonValue(b); }
  static JsonValue Number(double d) { return JsonValue(d); }
  static JsonValue String(std::string s) { return JsonValue(std::move(s)); }
  static JsonValue MakeArray(Array a) { return JsonValue(std::make_shared<Array>(std::move(a))); }
  static JsonValue MakeObject(Object o) { return JsonValue(std::make_shared<Object>(std::move(o))); }

 private:
  template <typename T>
  explicit JsonValue(T v) : value_(std::move(v)) {}
  std::variant<std::monostate, bool, double, std::string, std::shared_ptr<Array>, std::shared_ptr<Object>> value_;
};

/// Parses a whole document; errors give the line and column.
absl::StatusOr<JsonValue> ParseJson(std::string_view text);

/// Writes `value` as a JSON document that ParseJson reads back to the same
/// value: objects' members in key order, two spaces per level (or, with
/// `one_line`, all on one line: a JSON Lines record), numbers with up to 17
/// significant digits (integers without a fraction), and non-finite
/// numbers as null (JSON has none). Ends with a line break.
std::string FormatJson(const JsonValue& value, bool one_line = false);

}  // namespace pshard

#endif  // PSHARD_COMMON_JSON_H_

#include "common/json.h"

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pshard {

const JsonValue* JsonValue::Find(const std::string& key) const {
  if (!is_object()) return nullptr;
  auto it = as_object().find(key);
  return it == as_object().end() ? nullptr : &it->second;
}

namespace {

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  absl::StatusOr<JsonValue> Document() {
    absl::StatusOr<JsonValue> v = Value(0);
    if (!v.ok()) return v;
    SkipSpace();
    if (at_ != text_.size()) return Error("unexpected text after the document");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  absl::Status Error(const std::string& what) const {
    int line = 1, column = 1;
    for (size_t i = 0; i < at_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    return absl::InvalidArgumentError(absl::StrCat("JSON line ", line, ", column ", column, ": ", what));
  }

  void SkipSpace() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\t' || text_[at_] == '\n' || text_[at_] == '\r')) {
      ++at_;
    }
  }

  bool Consume(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }

  absl::StatusOr<JsonValue> Value(int depth) {
    if (depth > kMaxDepth) return Error("nested too deeply");
    SkipSpace();
    if (at_ >= text_.size()) return Error("unexpected end of input");
    const char c = text_[at_];
    if (c == '{') return ObjectValue(depth);
    if (c == '[') return ArrayValue(depth);
    if (c == '"') {
      absl::StatusOr<std::string> s = StringValue();
      if (!s.ok()) return s.status();
      return JsonValue::String(std::move(*s));
    }
    if (Consume("true")) return JsonValue::Bool(true);
    if (Consume("false")) return JsonValue::Bool(false);
    if (Consume("null")) return JsonValue();
    return NumberValue();
  }

  absl::StatusOr<JsonValue> NumberValue() {
    const size_t start = at_;
    if (at_ < text_.size() && text_[at_] == '-') ++at_;
    while (at_ < text_.size() && (std::isdigit(static_cast<unsigned char>(text_[at_])) || text_[at_] == '.' ||
                                  text_[at_] == 'e' || text_[at_] == 'E' || text_[at_] == '+' || text_[at_] == '-')) {
      ++at_;
    }
    const std::string number(text_.substr(start, at_ - start));
    char* end = nullptr;
    const double d = std::strtod(number.c_str(), &end);
    if (number.empty() || end != number.c_str() + number.size()) {
      at_ = start;
      return Error("expected a value");
    }
    return JsonValue::Number(d);
  }

  absl::StatusOr<std::string> StringValue() {
    ++at_;  // opening quote
    std::string out;
    while (at_ < text_.size()) {
      const char c = text_[at_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= text_.size()) break;
      const char e = text_[at_++];
      switch (e) {
        case '"': case '\\': case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (at_ + 4 > text_.size()) return Error("short \\u escape");
          const unsigned code = std::strtoul(std::string(text_.substr(at_, 4)).c_str(), nullptr, 16);
          at_ += 4;
          if (code >= 0xd800 && code <= 0xdfff) return Error("surrogate escapes are not supported");
          // UTF-8 encode the code point (BMP only).
          if (code < 0x80) {
            out += static_cast<char>(code);
          } else if (code < 0x800) {
            out += static_cast<char>(0xc0 | (code >> 6));
            out += static_cast<char>(0x80 | (code & 0x3f));
          } else {
            out += static_cast<char>(0xe0 | (code >> 12));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (code & 0x3f));
          }
          break;
        }
        default: return Error(absl::StrCat("bad escape \\", std::string(1, e)));
      }
    }
    return Error("unterminated string");
  }

  absl::StatusOr<JsonValue> ArrayValue(int depth) {
    ++at_;
    JsonValue::Array items;
    SkipSpace();
    if (Consume("]")) return JsonValue::MakeArray(std::move(items));
    while (true) {
      absl::StatusOr<JsonValue> v = Value(depth + 1);
      if (!v.ok()) return v;
      items.push_back(std::move(*v));
      SkipSpace();
      if (Consume("]")) return JsonValue::MakeArray(std::move(items));
      if (!Consume(",")) return Error("expected ',' or ']'");
    }
  }

  absl::StatusOr<JsonValue> ObjectValue(int depth) {
    ++at_;
    JsonValue::Object members;
    SkipSpace();
    if (Consume("}")) return JsonValue::MakeObject(std::move(members));
    while (true) {
      SkipSpace();
      if (at_ >= text_.size() || text_[at_] != '"') return Error("expected a member name");
      absl::StatusOr<std::string> key = StringValue();
      if (!key.ok()) return key.status();
      SkipSpace();
      if (!Consume(":")) return Error("expected ':'");
      absl::StatusOr<JsonValue> v = Value(depth + 1);
      if (!v.ok()) return v;
      if (!members.emplace(std::move(*key), std::move(*v)).second) return Error("duplicate member name");
      SkipSpace();
      if (Consume("}")) return JsonValue::MakeObject(std::move(members));
      if (!Consume(",")) return Error("expected ',' or '}'");
    }
  }

  std::string_view text_;
  size_t at_ = 0;
};

}  // namespace

absl::StatusOr<JsonValue> ParseJson(std::string_view text) { return Parser(text).Document(); }

namespace {

void AppendString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (const unsigned char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\t': out->append("\\t"); break;
      case '\r': out->append("\\r"); break;
      default:
        if (c < 0x20) {
          absl::StrAppend(out, absl::StrFormat("\\u%04x", c));
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

// Writes `v` at nesting `depth`; one_line: no line breaks or indentation.
void Append(const JsonValue& v, int depth, bool one_line, std::string* out) {
  const std::string indent = one_line ? "" : std::string(2 * (depth + 1), ' ');
  const std::string close = one_line ? "" : std::string(2 * depth, ' ');
  const char* open_break = one_line ? "" : "\n";
  const char* separator = one_line ? ", " : ",\n";
  if (v.is_null()) {
    out->append("null");
  } else if (v.is_bool()) {
    out->append(v.as_bool() ? "true" : "false");
  } else if (v.is_number()) {
    const double d = v.as_number();
    if (!std::isfinite(d)) {
      out->append("null");
    } else if (d == std::trunc(d) && std::fabs(d) < 9.007199254740992e15) {
      absl::StrAppend(out, static_cast<int64_t>(d));
    } else {
      // The shortest of 15, 16 or 17 digits that reads back as the same double.
      std::string text;
      for (int digits = 15; digits <= 17; ++digits) {
        text = absl::StrFormat("%.*g", digits, d);
        if (std::strtod(text.c_str(), nullptr) == d) break;
      }
      out->append(text);
    }
  } else if (v.is_string()) {
    AppendString(v.as_string(), out);
  } else if (v.is_array()) {
    if (v.as_array().empty()) return out->append("[]"), void();
    absl::StrAppend(out, "[", open_break);
    for (size_t i = 0; i < v.as_array().size(); ++i) {
      out->append(indent);
      Append(v.as_array()[i], depth + 1, one_line, out);
      out->append(i + 1 < v.as_array().size() ? separator : open_break);
    }
    absl::StrAppend(out, close, "]");
  } else {
    if (v.as_object().empty()) return out->append("{}"), void();
    absl::StrAppend(out, "{", open_break);
    size_t i = 0;
    for (const auto& [key, member] : v.as_object()) {
      out->append(indent);
      AppendString(key, out);
      out->append(": ");
      Append(member, depth + 1, one_line, out);
      out->append(++i < v.as_object().size() ? separator : open_break);
    }
    absl::StrAppend(out, close, "}");
  }
}

}  // namespace

std::string FormatJson(const JsonValue& value, bool one_line) {
  std::string out;
  Append(value, 0, one_line, &out);
  out.push_back('\n');
  return out;
}

}  // namespace pshard

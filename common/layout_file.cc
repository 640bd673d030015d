#include "common/layout_file.h"

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json.h"
#include "common/rng.h"
#include "common/status_macros.h"

namespace pshard {
namespace {

JsonValue TensorJson(const TensorSpec& t) {
  JsonValue::Array shape;
  for (int64_t d : t.shape) shape.push_back(JsonValue::Number(static_cast<double>(d)));
  JsonValue::Object o;
  o["name"] = JsonValue::String(t.name);
  o["shape"] = JsonValue::MakeArray(std::move(shape));
  o["init"] = JsonValue::String(std::string(InitKindName(t.init)));
  if (t.init == InitKind::kNormal) o["std"] = JsonValue::Number(t.init_std);
  o["weight_decay"] = JsonValue::Bool(t.weight_decay);
  return JsonValue::MakeObject(std::move(o));
}

// Refuses members of `o` outside `known`: a misspelt one is never ignored.
absl::Status OnlyKnownMembers(const JsonValue& o, const std::set<std::string>& known, const std::string& where) {
  for (const auto& [key, value] : o.as_object()) {
    if (known.count(key) == 0) return absl::InvalidArgumentError(absl::StrCat(where, ": unknown member \"", key, "\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> StringMember(const JsonValue& o, const std::string& key, const std::string& where) {
  const JsonValue* v = o.Find(key);
  if (v == nullptr || !v->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be a string"));
  }
  return v->as_string();
}

absl::StatusOr<const JsonValue::Array*> ArrayMember(const JsonValue& o, const std::string& key,
                                                     const std::string& where) {
  const JsonValue* v = o.Find(key);
  if (v == nullptr || !v->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be an array"));
  }
  return &v->as_array();
}

absl::Status AddTensor(const JsonValue& t, const std::string& unit, size_t index, ModelSpecBuilder& builder) {
  std::string where = absl::StrCat("unit ", unit, ", tensor ", index);
  if (!t.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " is not an object"));
  ASSIGN_OR_RETURN(const std::string name, StringMember(t, "name", where));
  where = absl::StrCat("unit ", unit, ", tensor \"", name, "\"");
  RETURN_IF_ERROR(OnlyKnownMembers(t, {"name", "shape", "init", "std", "weight_decay"}, where));
  ASSIGN_OR_RETURN(const JsonValue::Array* dims, ArrayMember(t, "shape", where));
  std::vector<int64_t> shape;
  for (const JsonValue& d : *dims) {
    const double v = d.is_number() ? d.as_number() : -1.0;
    if (!(v >= 1 && v <= static_cast<double>(kMaxLayoutElements)) || std::floor(v) != v) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": a dimension must be a whole number from 1 to ", kMaxLayoutElements));
    }
    shape.push_back(static_cast<int64_t>(v));
  }
  ASSIGN_OR_RETURN(const std::string init_name, StringMember(t, "init", where));
  absl::StatusOr<InitKind> init = InitKindFromName(init_name);
  if (!init.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", init.status().message()));
  const JsonValue* std_value = t.Find("std");
  double init_std = 0.0;
  if (*init == InitKind::kNormal) {
    if (std_value == nullptr || !std_value->is_number()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a normal initialisation needs a number \"std\""));
    }
    init_std = std_value->as_number();
  } else if (std_value != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": \"std\" is for normal initialisation only"));
  }
  bool decay = false;
  if (const JsonValue* d = t.Find("weight_decay"); d != nullptr) {
    if (!d->is_bool()) return absl::InvalidArgumentError(absl::StrCat(where, ": \"weight_decay\" must be true or false"));
    decay = d->as_bool();
  }
  builder.AddTensor(name, std::move(shape), *init, init_std, decay);
  return absl::OkStatus();
}

}  // namespace

std::string FormatLayoutJson(const ModelSpec& spec, bool one_line) {
  JsonValue::Array units;
  for (const UnitSpec& unit : spec.units) {
    JsonValue::Array tensors;
    for (const TensorSpec& t : unit.tensors) tensors.push_back(TensorJson(t));
    JsonValue::Object u;
    u["name"] = JsonValue::String(unit.name);
    u["tensors"] = JsonValue::MakeArray(std::move(tensors));
    units.push_back(JsonValue::MakeObject(std::move(u)));
  }
  JsonValue::Object doc;
  doc["format"] = JsonValue::String(kLayoutFormat);
  doc["model"] = JsonValue::String(spec.model);
  doc["units"] = JsonValue::MakeArray(std::move(units));
  return FormatJson(JsonValue::MakeObject(std::move(doc)), one_line);
}

absl::StatusOr<ModelSpec> ParseLayoutJson(std::string_view text) {
  absl::StatusOr<JsonValue> doc = ParseJson(text);
  if (!doc.ok()) return absl::InvalidArgumentError(absl::StrCat("layout: ", doc.status().message()));
  if (!doc->is_object()) return absl::InvalidArgumentError("layout: the document is not an object");
  RETURN_IF_ERROR(OnlyKnownMembers(*doc, {"format", "model", "units"}, "layout"));
  ASSIGN_OR_RETURN(const std::string format, StringMember(*doc, "format", "layout"));
  if (format != kLayoutFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: format \"", format, "\" is not one this build reads (", kLayoutFormat, ")"));
  }
  ASSIGN_OR_RETURN(std::string model, StringMember(*doc, "model", "layout"));
  ASSIGN_OR_RETURN(const JsonValue::Array* units, ArrayMember(*doc, "units", "layout"));
  if (units->size() > static_cast<size_t>(kMaxLayoutUnits)) {
    return absl::InvalidArgumentError(absl::StrCat("layout: more than ", kMaxLayoutUnits, " units"));
  }
  ModelSpecBuilder builder(std::move(model));
  for (size_t u = 0; u < units->size(); ++u) {
    const JsonValue& unit = (*units)[u];
    const std::string where = absl::StrCat("layout: unit ", u);
    if (!unit.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " is not an object"));
    RETURN_IF_ERROR(OnlyKnownMembers(unit, {"name", "tensors"}, where));
    ASSIGN_OR_RETURN(std::string name, StringMember(unit, "name", where));
    ASSIGN_OR_RETURN(const JsonValue::Array* tensors, ArrayMember(unit, "tensors", where));
    builder.AddUnit(name);
    for (size_t i = 0; i < tensors->size(); ++i) RETURN_IF_ERROR(AddTensor((*tensors)[i], name, i, builder));
  }
  absl::StatusOr<ModelSpec> spec = std::move(builder).Build();
  if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat("layout: ", spec.status().message()));
  return spec;
}

absl::StatusOr<ModelSpec> ReadLayoutFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read layout file ", path));
  std::ostringstream text;
  text << in.rdbuf();
  absl::StatusOr<ModelSpec> spec = ParseLayoutJson(text.str());
  if (!spec.ok()) return absl::Status(spec.status().code(), absl::StrCat(path, ": ", spec.status().message()));
  return spec;
}

uint64_t LayoutFingerprint(const ModelSpec& spec) {
  // FNV-1a over the canonical one-line document, then mixed.
  const std::string text = FormatLayoutJson(spec, /*one_line=*/true);
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : text) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ULL;
  }
  return Mix64(h);
}

std::string FingerprintHex(uint64_t fingerprint) { return absl::StrFormat("0x%016x", fingerprint); }

}  // namespace pshard

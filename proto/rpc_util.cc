#include "proto/rpc_util.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "common/checksum.h"
#include "common/rng.h"
#include "common/status_macros.h"

namespace pshard {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

namespace {

v1::TensorLayout::Init InitToProto(InitKind init) {
  switch (init) {
    case InitKind::kNormal: return v1::TensorLayout::INIT_NORMAL;
    case InitKind::kZeros: return v1::TensorLayout::INIT_ZEROS;
    case InitKind::kOnes: return v1::TensorLayout::INIT_ONES;
    case InitKind::kGiven: return v1::TensorLayout::INIT_GIVEN;
  }
  return v1::TensorLayout::INIT_UNSPECIFIED;
}

absl::StatusOr<InitKind> InitFromProto(v1::TensorLayout::Init init, const std::string& tensor) {
  switch (init) {
    case v1::TensorLayout::INIT_NORMAL: return InitKind::kNormal;
    case v1::TensorLayout::INIT_ZEROS: return InitKind::kZeros;
    case v1::TensorLayout::INIT_ONES: return InitKind::kOnes;
    case v1::TensorLayout::INIT_GIVEN: return InitKind::kGiven;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", tensor, ": unknown initialisation ", static_cast<int>(init)));
  }
}

}  // namespace

v1::ModelLayout LayoutToProto(const ModelSpec& spec) {
  v1::ModelLayout p;
  p.set_model(spec.model);
  for (const UnitSpec& unit : spec.units) {
    v1::UnitLayout* u = p.add_units();
    u->set_name(unit.name);
    for (const TensorSpec& t : unit.tensors) {
      v1::TensorLayout* tp = u->add_tensors();
      tp->set_name(t.name);
      for (int64_t d : t.shape) tp->add_shape(d);
      tp->set_init(InitToProto(t.init));
      tp->set_init_std(t.init_std);
      tp->set_weight_decay(t.weight_decay);
    }
  }
  return p;
}

absl::StatusOr<ModelSpec> LayoutFromProto(const v1::ModelLayout& p) {
  if (p.units_size() > kMaxLayoutUnits) {
    return absl::InvalidArgumentError(absl::StrCat("the layout has ", p.units_size(), " units; at most ", kMaxLayoutUnits));
  }
  ModelSpecBuilder builder(p.model());
  for (const v1::UnitLayout& u : p.units()) {
    builder.AddUnit(u.name());
    for (const v1::TensorLayout& t : u.tensors()) {
      ASSIGN_OR_RETURN(const InitKind init, InitFromProto(t.init(), t.name()));
      if (t.shape_size() > kMaxTensorRank) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name(), " has more than ", kMaxTensorRank,
                                                       " dimensions"));
      }
      builder.AddTensor(t.name(), std::vector<int64_t>(t.shape().begin(), t.shape().end()), init, t.init_std(),
                        t.weight_decay());
    }
  }
  return std::move(builder).Build();
}

v1::JobSpec JobToProto(const JobConfig& job) {
  v1::JobSpec p;
  *p.mutable_layout() = LayoutToProto(job.model);
  p.set_init_fingerprint(job.init_fingerprint);
  v1::OptimizerConfig* o = p.mutable_optimizer();
  o->set_lr(job.optimizer.lr);
  o->set_min_lr(job.optimizer.min_lr);
  o->set_warmup_steps(job.optimizer.warmup_steps);
  o->set_total_steps(job.optimizer.total_steps);
  o->set_beta1(job.optimizer.beta1);
  o->set_beta2(job.optimizer.beta2);
  o->set_eps(job.optimizer.eps);
  o->set_weight_decay(job.optimizer.weight_decay);
  o->set_grad_clip(job.optimizer.grad_clip);
  p.set_seed(job.seed);
  p.set_num_shards(job.num_shards);
  p.set_num_trainers(job.num_trainers);
  p.set_slice_alignment(job.slice_alignment);
  p.set_deterministic(job.deterministic);
  p.set_micro_batches(job.micro_batches);
  p.set_accumulate_on_trainer(job.accumulate_on_trainer);
  return p;
}

absl::StatusOr<JobConfig> JobFromProto(const v1::JobSpec& p) {
  JobConfig job;
  ASSIGN_OR_RETURN(job.model, LayoutFromProto(p.layout()));
  job.init_fingerprint = p.init_fingerprint();
  job.optimizer.lr = p.optimizer().lr();
  job.optimizer.min_lr = p.optimizer().min_lr();
  job.optimizer.warmup_steps = p.optimizer().warmup_steps();
  job.optimizer.total_steps = p.optimizer().total_steps();
  job.optimizer.beta1 = p.optimizer().beta1();
  job.optimizer.beta2 = p.optimizer().beta2();
  job.optimizer.eps = p.optimizer().eps();
  job.optimizer.weight_decay = p.optimizer().weight_decay();
  job.optimizer.grad_clip = p.optimizer().grad_clip();
  job.seed = p.seed();
  job.num_shards = p.num_shards();
  job.num_trainers = p.num_trainers();
  job.slice_alignment = p.slice_alignment();
  job.deterministic = p.deterministic();
  job.micro_batches = p.micro_batches();
  job.accumulate_on_trainer = p.accumulate_on_trainer();
  if (absl::Status s = job.Validate(); !s.ok()) return s;
  return job;
}

uint64_t JobFingerprint(const JobConfig& job) {
  // Proto3 scalars serialise in field order, so equal jobs give equal bytes.
  const v1::JobSpec p = JobToProto(job);
  const std::string bytes = p.SerializeAsString();
  const uint32_t lo = Crc32c(bytes.data(), bytes.size());
  return Mix64((static_cast<uint64_t>(lo) << 32) ^ bytes.size());
}

std::vector<std::pair<std::string, int>> DataPathTransportArguments() {
  return {
      {GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 1 << 20},
      {GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 8 << 20},
      {GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 8 << 20},
      {GRPC_ARG_HTTP2_BDP_PROBE, 0},
  };
}

v1::Encoding EncodingToProto(WireEncoding encoding) {
  switch (encoding) {
    case WireEncoding::kFp32: return v1::ENCODING_FP32;
    case WireEncoding::kBf16: return v1::ENCODING_BF16;
    case WireEncoding::kInt8: return v1::ENCODING_INT8;
    case WireEncoding::kInt4: return v1::ENCODING_INT4;
  }
  return v1::ENCODING_UNSPECIFIED;
}

absl::StatusOr<WireEncoding> EncodingFromProto(v1::Encoding encoding) {
  switch (encoding) {
    case v1::ENCODING_FP32: return WireEncoding::kFp32;
    case v1::ENCODING_BF16: return WireEncoding::kBf16;
    case v1::ENCODING_INT8: return WireEncoding::kInt8;
    case v1::ENCODING_INT4: return WireEncoding::kInt4;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported wire encoding ", static_cast<int>(encoding)));
  }
}

absl::StatusOr<WireFormat> FormatFromProto(v1::Encoding encoding, int64_t quant_block) {
  ASSIGN_OR_RETURN(const WireEncoding e, EncodingFromProto(encoding));
  if (IsQuantized(e)) RETURN_IF_ERROR(CheckQuantBlock(quant_block));
  return WireFormat(e, static_cast<int>(quant_block));
}

absl::StatusOr<WireFormat> WeightFormatFromProto(v1::Encoding encoding, int64_t quant_block) {
  if (encoding == v1::ENCODING_INT4) {
    return absl::InvalidArgumentError("weights travel as fp32, bf16 or int8; int4 is for gradients only");
  }
  return FormatFromProto(encoding, quant_block);
}

}  // namespace pshard

// Conversions at the wire boundary: absl::Status <-> grpc::Status, and the
// job description between its C++ form and its protocol message.
#ifndef PSHARD_PROTO_RPC_UTIL_H_
#define PSHARD_PROTO_RPC_UTIL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "common/wire_encoding.h"
#include "grpcpp/support/status.h"
#include "proto/shard.pb.h"

namespace pshard {

/// Converts once, at a service boundary; codes map one to one.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

v1::JobSpec JobToProto(const JobConfig& job);
/// Validates the result; an error names the bad field.
absl::StatusOr<JobConfig> JobFromProto(const v1::JobSpec& proto);
/// A stable hash of everything in the job: servers and trainers of one job
/// must all report the same value.
uint64_t JobFingerprint(const JobConfig& job);

v1::Encoding EncodingToProto(WireEncoding encoding);
absl::StatusOr<WireEncoding> EncodingFromProto(v1::Encoding encoding);

}  // namespace pshard

#endif  // PSHARD_PROTO_RPC_UTIL_H_

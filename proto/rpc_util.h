// Conversions at the wire boundary: absl::Status <-> grpc::Status, and the
// job description between its C++ form and its protocol message.
#ifndef PSHARD_PROTO_RPC_UTIL_H_
#define PSHARD_PROTO_RPC_UTIL_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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

v1::ModelLayout LayoutToProto(const ModelSpec& spec);
/// Validates the result (ValidateModelSpec).
absl::StatusOr<ModelSpec> LayoutFromProto(const v1::ModelLayout& proto);

v1::JobSpec JobToProto(const JobConfig& job);
/// Validates the result; an error names the bad field.
absl::StatusOr<JobConfig> JobFromProto(const v1::JobSpec& proto);
/// A stable hash of everything in the job: servers and trainers of one job
/// must all report the same value.
uint64_t JobFingerprint(const JobConfig& job);

/// gRPC transport settings that let the data path run near the link's
/// speed, for servers (ServerBuilder::AddChannelArgument) and trainers'
/// channels (ChannelArguments::SetInt) alike; each side applies them to what
/// it receives. Reads of at least 1 MiB (gRPC starts at 256 bytes and grows
/// them slowly), and a fixed 8 MiB flow-control window per stream: gRPC's
/// bandwidth-delay probe shrinks the window to what it measures, which on a
/// fast short link stalls each stream every few hundred KiB. 8 MiB covers a
/// 10 Gbit/s link with 6 ms of round trip per stream (bench/README.md).
/// The cost: a connection that is reading holds a receive buffer of at
/// least 1 MiB, and a stream may have 8 MiB in flight towards its reader.
std::vector<std::pair<std::string, int>> DataPathTransportArguments();

v1::Encoding EncodingToProto(WireEncoding encoding);
absl::StatusOr<WireEncoding> EncodingFromProto(v1::Encoding encoding);
/// A request's encoding with its block size (checked when quantized).
absl::StatusOr<WireFormat> FormatFromProto(v1::Encoding encoding, int64_t quant_block);
/// The same for a fetch of weights, which never travel as int4.
absl::StatusOr<WireFormat> WeightFormatFromProto(v1::Encoding encoding, int64_t quant_block);

}  // namespace pshard

#endif  // PSHARD_PROTO_RPC_UTIL_H_

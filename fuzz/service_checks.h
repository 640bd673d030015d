// What the request-handler harnesses check of a shard's answers, and how
// they read pushes out of an input; shared by the harness of each rpc and
// the session harness that mixes them.
#ifndef PSHARD_FUZZ_SERVICE_CHECKS_H_
#define PSHARD_FUZZ_SERVICE_CHECKS_H_

#include <string>
#include <string_view>
#include <vector>

#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "shard_server/shard_state.h"

namespace pshard::fuzz {

/// A served fetch is the whole slice the request names, in order, at the
/// version asked for, with the CRC-32C of its bytes; in fp32 at the
/// shard's current version, the master weights' very bytes. A request that
/// does not parse is refused.
void CheckFetchAnswer(ShardState& state, std::string_view request, const RawResult& answer);

/// A push answer is a PushResponse with a disposition; a refused push
/// leaves the contributions the step still waits for as they were
/// (`pending_before`: PendingContributions before the push).
void CheckPushAnswer(ShardState& state, const std::string& pending_before, const RawResult& answer);

/// Which contributions the current step still waits for, in words.
std::string PendingContributions(ShardState& state);

/// The pushes of an input's records: each record is one frame (one
/// PushChunk), an empty record ends a push and starts the next. At most
/// `max_pushes` pushes; each one's frames arrive cut into pieces of
/// `piece_bytes` bytes.
std::vector<RawCall> PushCalls(FuzzInput& input, Caller caller, size_t piece_bytes, size_t max_pushes);

/// Piece sizes by the top 2 bits of a choices byte: whole, 1, 5 or 64 bytes.
size_t PieceBytesFrom(uint8_t choices);

/// After step `step - 1` closed: the shard is at `step` and serves every
/// unit's new version, whose weights are all finite (a non-finite gradient
/// skips the step).
void CheckClosedStep(InProcessShard& shard, int64_t step);

}  // namespace pshard::fuzz

#endif  // PSHARD_FUZZ_SERVICE_CHECKS_H_

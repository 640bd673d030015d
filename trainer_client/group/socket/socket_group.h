// A fabric group whose members are separate processes, on one host or on
// hosts joined by a fast network: every pair of members shares one TCP
// connection, each collective sends every member only the ranges it needs,
// and reduce-scatter sums the members' parts in the canonical tree order of
// member index, so the results equal the shared-memory group's bit for bit.
// The members find each other through a rendezvous (the shard servers'
// Rendezvous RPC): each posts its listening address and gets all of them.
// A fabric slower than the machine can be emulated: each member's messages
// then pass its own outgoing interface (a token bucket at the given rate)
// and arrive one latency later, the way the slow links are emulated.
#ifndef PSHARD_TRAINER_CLIENT_GROUP_SOCKET_SOCKET_GROUP_H_
#define PSHARD_TRAINER_CLIENT_GROUP_SOCKET_SOCKET_GROUP_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "trainer_client/group/group_collective.h"
#include "trainer_client/transport/link/link_emulator.h"

namespace pshard {

/// Joins member `rank` of a group of `size`: listens on `host` (any free
/// port), meets the others through `rendezvous`, and connects to each of
/// them. Every step, including each later collective, waits at most
/// `timeout` and then fails naming the member it waited for. `fabric`
/// (rate and latency; jitter is not emulated here) shapes what this member
/// sends; the default sends at the machine's speed.
absl::StatusOr<std::unique_ptr<GroupCollective>> JoinSocketGroup(const std::string& host, int rank, int size,
                                                                 const RendezvousFn& rendezvous,
                                                                 absl::Duration timeout = absl::Seconds(120),
                                                                 const LinkSpec& fabric = {});

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_GROUP_SOCKET_SOCKET_GROUP_H_

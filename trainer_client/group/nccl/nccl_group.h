// A fabric group over NCCL: trainer processes with one GPU each, on GPUs
// joined by NVLink, PCIe or InfiniBand. Member 0 makes NCCL's unique id and
// posts it to the servers' rendezvous (the same one the TCP group uses); the
// others read it from there and every member joins the communicator.
//
// The collectives take the trainer's host buffers, as every GroupCollective
// does: each member's ranges are packed, copied to the device, exchanged with
// ncclAllGather / ncclReduceScatter (members' parts padded to the longest)
// and copied back. NCCL sums in its own order: for one or two members that
// equals the canonical tree order bit for bit, for more it may differ in the
// last bits (use the TCP group where bit-reproducibility matters).
#ifndef PSHARD_TRAINER_CLIENT_GROUP_NCCL_NCCL_GROUP_H_
#define PSHARD_TRAINER_CLIENT_GROUP_NCCL_NCCL_GROUP_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "trainer_client/group/group_collective.h"

namespace pshard {

/// Joins member `rank` of a group of `size` on CUDA device `device`.
absl::StatusOr<std::unique_ptr<GroupCollective>> JoinNcclGroup(int rank, int size, int device,
                                                               const RendezvousFn& rendezvous);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_GROUP_NCCL_NCCL_GROUP_H_

// A fabric group whose members are threads of one process, meeting in
// shared memory: the grouping logic (ownership, packing, the canonical
// reduction order) runs and is tested on any machine.
#ifndef PSHARD_TRAINER_CLIENT_GROUP_HOST_HOST_GROUP_H_
#define PSHARD_TRAINER_CLIENT_GROUP_HOST_HOST_GROUP_H_

#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "trainer_client/group/group_collective.h"

namespace pshard {

/// Creates the `size` members of a group whose members are threads of this
/// process (shared memory). Every call waits at most `timeout` for the other
/// members and then fails naming the ones that did not arrive.
std::vector<std::unique_ptr<GroupCollective>> CreateHostGroup(int size,
                                                              absl::Duration timeout = absl::Seconds(120));

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_GROUP_HOST_HOST_GROUP_H_

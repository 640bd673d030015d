// A UnitModel that behaves like a device model (asynchronous calls, work
// done later in call order on another thread) but computes with the CPU
// model: the trainer's pipelined path (two backwards in flight, gradients
// taken later, a timeline from another thread) tested where there is no GPU.
#ifndef PSHARD_TESTS_TESTUTIL_ASYNC_CPU_MODEL_H_
#define PSHARD_TESTS_TESTUTIL_ASYNC_CPU_MODEL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model_spec.h"
#include "trainer_client/model/unit_model.h"

namespace pshard::testing {

/// The CPU model for `options` (device must be "cpu"), run asynchronously.
/// Each unit's compute is stretched to at least `min_unit_time`, so that
/// tests can make compute dominate the step.
absl::StatusOr<std::unique_ptr<UnitModel>> MakeAsyncCpuModel(const ModelSpec& spec, const UnitModelOptions& options,
                                                             absl::Duration min_unit_time = absl::ZeroDuration());

}  // namespace pshard::testing

#endif  // PSHARD_TESTS_TESTUTIL_ASYNC_CPU_MODEL_H_

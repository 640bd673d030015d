// The planner's step time: an event model of one trainer's step as
// trainer_client/trainer.cc runs it, over links that behave as the
// in-process emulation does (a token bucket per node and direction, shared
// by all of the node's connections, plus a one-way latency).
//
// What it follows, per pass: the fetch schedule (forward 0..U-1, backward
// U-2..0 at stage 3; less when units are kept, regathered or resident), the
// prefetch window (asking for position p issues every fetch up to p +
// depth), each unit's compute (model FLOPs ÷ FLOP/s · mfu, one third
// forward and two thirds backward, plus recomputation), each push issued
// when its unit's backward ends, and the step's end when the last push is
// acknowledged. Every trainer runs the same schedule at the same moments,
// so each bucket carries, at once, what all of them move through it: a
// node's interface each way (every slice of the trainers on the node, and
// each server's slice once for every trainer fetching it), or a node
// pair's own link (a topology's, PlanInput::nodes). A fetch of trainer m's
// slices ends when the slowest bucket on its ways has passed them, plus a
// latency each way; a server on m's own node costs nothing. With a
// topology each fabric group is simulated in turn and the slowest group's
// step is the job's. Fabric collectives pass (G-1)/G of the unit at the
// fabric's rate with G-1 latencies.
//
// Not modelled: the servers' optimizer step and norm agreement between
// steps, CPU work of encoding, decoding and copying, and jitter. A fixed
// PlanInput::step_overhead stands for them at the start of each step (a
// sweep measures it on an unshaped run); the measured MFU absorbs what of
// them overlaps compute.
#ifndef PSHARD_LAB_STEP_MODEL_H_
#define PSHARD_LAB_STEP_MODEL_H_

#include <span>
#include <vector>

#include "common/partition.h"
#include "lab/plan.h"

namespace pshard {

/// Model FLOPs of one micro-batch's forward + backward of each unit
/// (recomputation excluded), for the input's shape.
std::vector<double> UnitFlops(const PlanInput& input);

/// FLOPs recomputation adds per micro-batch to each unit's backward.
std::vector<double> UnitRecomputeFlops(const PlanInput& input);

/// The predicted step of `input` over `units` (its partition).
StepTime PredictStepTime(const PlanInput& input, std::span<const UnitPartition> units);

}  // namespace pshard

#endif  // PSHARD_LAB_STEP_MODEL_H_

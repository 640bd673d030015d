// The FLOP rate a CPU trainer's MFU is measured against.
#ifndef PSHARD_TRAINER_CLIENT_PEAK_FLOPS_H_
#define PSHARD_TRAINER_CLIENT_PEAK_FLOPS_H_

namespace pshard {

/// This machine's best single-precision GEMM rate with the current BLAS
/// thread setting, in FLOP/s (the best of 512^3 products over 0.25 s).
double MeasureSgemmFlops();

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_PEAK_FLOPS_H_

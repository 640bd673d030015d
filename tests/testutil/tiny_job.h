// The small job the integration tests train: quick, and shaped to exercise
// the optimizer (warm-up then cosine, weight decay, active clipping) and
// slice boundaries that fall inside tensors.
#ifndef PSHARD_TESTS_TESTUTIL_TINY_JOB_H_
#define PSHARD_TESTS_TESTUTIL_TINY_JOB_H_

#include <cstdint>

#include "common/job_config.h"
#include "trainer_client/model/gpt_spec.h"
#include "trainer_client/data/dataset.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {

/// A 2-layer, width-16 GPT over `shards` servers and `trainers` trainers,
/// with the cosine schedule ending at `steps`.
inline JobConfig TinyGptJob(int shards, int trainers, int64_t steps = 5) {
  JobConfig job;
  job.model = MakeGptSpec(GptConfig{.num_layers = 2, .d_model = 16, .num_heads = 2, .context = 8, .vocab = 256}).value();
  job.optimizer.lr = 1e-2;
  job.optimizer.min_lr = 1e-3;
  job.optimizer.warmup_steps = 2;
  job.optimizer.total_steps = steps;
  job.optimizer.weight_decay = 0.1;
  job.optimizer.grad_clip = 0.5;  // small enough that clipping is active
  job.num_shards = shards;
  job.num_trainers = trainers;
  job.slice_alignment = 8;  // many slice boundaries inside tensors
  job.deterministic = true;
  return job;
}

/// Micro-batches of 2 sequences of 8 tokens.
inline TrainerOptions TinyTrainerOptions(uint64_t data_seed = 7) {
  TrainerOptions t;
  t.batch = 2;
  t.seq_len = 8;
  t.prefetch_depth = 1;
  t.data_seed = data_seed;
  return t;
}

/// The built-in corpus, made once.
const TokenDataset& TestCorpus();

}  // namespace pshard::testing

#endif  // PSHARD_TESTS_TESTUTIL_TINY_JOB_H_

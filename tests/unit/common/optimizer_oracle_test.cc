// The optimizer against torch: tests/data/torch_adamw_vectors.txt holds six
// steps of torch.optim.AdamW (single-tensor path) over a tensor with weight
// decay and one without, their gradients, torch's clip_grad_norm_ factor and
// the learning rate the documented schedule gives each step
// (torch_adamw_oracle.py made it). AdamWUpdate must give torch's parameters
// and moments, the schedule its learning rates, and ClipCoefficient its
// factor (torch sums the norm in float32, pshard exactly: within 1e-6), to a
// few parts in a million.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/model_spec.h"
#include "common/optimizer.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

float FromBits(const std::string& hex) {
  const uint32_t pattern = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
  float v;
  std::memcpy(&v, &pattern, sizeof(v));
  return v;
}

// The words after `from` up to the next word that is not hex of 8 digits.
std::vector<float> Floats(std::istringstream& words) {
  std::vector<float> out;
  std::string word;
  while (words.peek() != EOF) {
    const std::streampos at = words.tellg();
    if (!(words >> word)) break;
    if (word.size() != 8 || word.find_first_not_of("0123456789abcdef") != std::string::npos) {
      words.seekg(at);
      break;
    }
    out.push_back(FromBits(word));
  }
  return out;
}

constexpr double kTolerance = 1e-6;

struct Tensor {
  bool decay = false;
  std::vector<float> param, m, v;
};

TEST(OptimizerOracleTest, AdamWScheduleAndClipMatchTorch) {
  std::ifstream in(std::string(PSHARD_TEST_DATA_DIR) + "/torch_adamw_vectors.txt");
  ASSERT_TRUE(in.good()) << "cannot read torch_adamw_vectors.txt";
  OptimizerConfig config;
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::vector<float>> grads;
  int64_t step = -1;
  double lr = 0, torch_norm = 0;
  float clip = 1.0f;
  int steps_checked = 0;
  double worst = 0;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind;
    words >> kind;
    if (kind == "config") {
      words >> config.lr >> config.min_lr >> config.warmup_steps >> config.total_steps >> config.beta1 >>
          config.beta2 >> config.eps >> config.weight_decay >> config.grad_clip;
    } else if (kind == "tensor") {
      std::string name, decay;
      words >> name >> decay;
      Tensor& t = tensors[name];
      t.decay = decay == "decay=1";
      t.param = Floats(words);
      t.m.assign(t.param.size(), 0.0f);
      t.v.assign(t.param.size(), 0.0f);
    } else if (kind == "step") {
      std::string word, clip_hex;
      words >> step >> word >> lr >> word >> torch_norm >> word >> clip_hex;
      clip = FromBits(clip_hex);
      EXPECT_NEAR(LearningRateAt(config, step), lr, 1e-15 * lr) << "step " << step;
      EXPECT_NEAR(ClipCoefficient(config.grad_clip, torch_norm), clip, 1e-6) << "step " << step;
    } else if (kind == "grad") {
      std::string name;
      words >> name;
      grads[name] = Floats(words);
    } else if (kind == "after") {
      std::string name, word;
      words >> name;
      Tensor& t = tensors.at(name);
      const std::vector<ElementRun> decay_runs =
          t.decay ? std::vector<ElementRun>{{0, static_cast<int64_t>(t.param.size())}} : std::vector<ElementRun>{};
      AdamWUpdate(config, AdamWStep{lr, step + 1, clip}, t.param, t.m, t.v, grads.at(name), decay_runs);
      words >> word;
      const std::vector<float> param = Floats(words);
      words >> word;
      const std::vector<float> m = Floats(words);
      words >> word;
      const std::vector<float> v = Floats(words);
      ASSERT_EQ(param.size(), t.param.size());
      // The same operations on the same floats, some rounded in another
      // order (torch 1.13's first moment is m*b1 + (1-b1)*g, pshard's the
      // lerp of later torch; addcmul and addcdiv fold their scalar in
      // differently): within a part in a million of the tensor's largest
      // value after 6 steps, where a wrong beta, bias correction, decay, clip
      // or learning rate is off by a part in a thousand or more.
      for (auto [what, ours, theirs] : {std::tuple{"first moment", &t.m, &m}, std::tuple{"second moment", &t.v, &v},
                                        std::tuple{"parameter", &t.param, &param}}) {
        double scale = 0;
        for (float x : *theirs) scale = std::max(scale, std::abs(static_cast<double>(x)));
        for (size_t i = 0; i < theirs->size(); ++i) {
          const double gap = std::abs(static_cast<double>((*ours)[i]) - (*theirs)[i]);
          EXPECT_LE(gap, kTolerance * scale) << name << "[" << i << "] step " << step << ": " << what << " "
                                             << (*ours)[i] << " vs torch " << (*theirs)[i];
          worst = std::max(worst, gap / scale);
        }
      }
      ++steps_checked;
    }
  }
  EXPECT_EQ(steps_checked, 12);  // 6 steps of 2 tensors
  std::printf("largest difference from torch: %.2e of the tensor's largest value\n", worst);
}

}  // namespace
}  // namespace pshard

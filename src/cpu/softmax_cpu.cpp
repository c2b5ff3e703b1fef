#include <cmath>
#include <vector>

#include "common/math.hpp"
#include "common/ops.hpp"
#include "cpu/cpu_util.hpp"

namespace fce::cpu {

size_t softmax_workspace(const SoftmaxProblem&) { return 0; }

void softmax(const SoftmaxProblem& p, Workspace) {
  const int64_t N = p.logits.rows, V = p.logits.cols;
#pragma omp parallel
  {
    std::vector<float> x(static_cast<size_t>(V)), prob(static_cast<size_t>(V)), logp(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      load_row(p.logits, i, x.data());
      const float T = p.temperatures ? load_f32(p.temperatures, i) : p.temperature;
      // Max of the raw logits first; NaN anywhere (or a bad temperature, or no finite logit) poisons the row.
      float m = -INFINITY;
      int64_t amax = 0;
      bool nan = std::isnan(T) || T < 0.f;
      for (int64_t j = 0; j < V; ++j) {
        nan |= std::isnan(x[size_t(j)]);
        if (x[size_t(j)] > m) { m = x[size_t(j)]; amax = j; }
      }
      if (m == -INFINITY) nan = true;
      if (nan) {
        for (int64_t j = 0; j < V; ++j) prob[size_t(j)] = logp[size_t(j)] = NAN;
      } else if (T == 0.f) {  // greedy: one-hot at the first maximum
        for (int64_t j = 0; j < V; ++j) {
          prob[size_t(j)] = j == amax ? 1.f : 0.f;
          logp[size_t(j)] = j == amax ? 0.f : -INFINITY;
        }
      } else {
        const SoftmaxShift shift(m, 1.f / T);  // +inf temperature: the uniform distribution over finite logits
        double s = 0;
        for (int64_t j = 0; j < V; ++j) {
          const float d = shift(x[size_t(j)]);
          logp[size_t(j)] = d;
          s += std::exp(double(d));
        }
        const float log_s = float(std::log(s));
        const float inv_s = float(1.0 / s);
        for (int64_t j = 0; j < V; ++j) {
          const float d = logp[size_t(j)];
          prob[size_t(j)] = std::exp(d) * inv_s;
          logp[size_t(j)] = d - log_s;
        }
      }
      if (p.probs) store_row(p.probs, i, prob.data());
      if (p.logprobs) store_row(p.logprobs, i, logp.data());
    }
  }
}

}  // namespace fce::cpu

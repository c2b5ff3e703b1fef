#include <cmath>
#include <algorithm>

#include "common/math.hpp"
#include "common/ops.hpp"
#include "cpu/cpu_util.hpp"

namespace fce::cpu {

size_t softmax_workspace(const SoftmaxProblem&) { return 0; }

void softmax(const SoftmaxProblem& p, Workspace) {
  const int64_t N = p.logits.rows, V = p.logits.cols;
#pragma omp parallel
  {
    simd::Row xbuf(V), pbuf(V), lbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* x = row_in(p.logits, i, xbuf.data());
      const float T = p.temperatures ? load_f32(p.temperatures, i) : p.temperature;
      // Max of the raw logits first; NaN anywhere (or a bad temperature, or no finite logit) poisons the row.
      const simd::MaxNan mx = simd::max_nan(x, V);
      const float m = mx.max;
      const bool nan = mx.nan || std::isnan(T) || T < 0.f || m == -INFINITY;
      const int64_t amax = !nan && T == 0.f ? simd::find_first(x, V, m) : 0;
      // The outputs are written once x is read whole (probs may be the logits).
      float* prob = p.probs ? row_out(p.probs, i, pbuf.data()) : pbuf.data();
      float* logp = p.logprobs ? row_out(p.logprobs, i, lbuf.data()) : lbuf.data();
      if (nan) {
        std::fill(prob, prob + V, NAN);
        std::fill(logp, logp + V, NAN);
      } else if (T == 0.f) {  // greedy: one-hot at the first maximum
        std::fill(prob, prob + V, 0.f);
        std::fill(logp, logp + V, -INFINITY);
        prob[amax] = 1.f;
        logp[amax] = 0.f;
      } else {
        const SoftmaxShift shift(m, 1.f / T);  // +inf temperature: the uniform distribution over finite logits
        const double s = simd::softmax_exp(shift, x, V, logp, prob);
        simd::softmax_finish(prob, logp, V, float(1.0 / s), float(std::log(s)));
      }
      if (p.probs) row_out_done(p.probs, i, prob);
      if (p.logprobs) row_out_done(p.logprobs, i, logp);
    }
  }
}

}  // namespace fce::cpu

#include <cmath>

#include "common/math.hpp"
#include "cpu/cpu_util.hpp"
#include "common/ops.hpp"

namespace fce::cpu {

size_t lse_workspace(const LseProblem&) { return 0; }

void lse(const LseProblem& p, Workspace) {
  const int64_t N = p.x.rows, V = p.x.cols;
#pragma omp parallel
  {
    simd::Row xbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* x = row_in(p.x, i, xbuf.data());
      const simd::MaxNan mx = simd::max_nan(x, V);
      const float m = mx.max;
      float out;
      if (mx.nan) out = NAN;
      else if (m == -INFINITY) out = -INFINITY;
      else if (m == INFINITY) out = INFINITY;
      else out = float(double(p.scale) * m + std::log(simd::exp_sum(x, V, m, p.scale)));
      store_f32(p.lse, i, out);
    }
  }
}

}  // namespace fce::cpu

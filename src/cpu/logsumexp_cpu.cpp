#include <cmath>
#include <vector>

#include "common/math.hpp"
#include "cpu/cpu_util.hpp"
#include "common/ops.hpp"

namespace fce::cpu {

size_t lse_workspace(const LseProblem&) { return 0; }

void lse(const LseProblem& p, Workspace) {
  const int64_t N = p.x.rows, V = p.x.cols;
#pragma omp parallel
  {
    std::vector<float> x(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      load_row(p.x, i, x.data());
      float m = -INFINITY;
      bool nan = false;
      for (int64_t j = 0; j < V; ++j) {
        nan |= std::isnan(x[size_t(j)]);
        m = std::fmax(m, x[size_t(j)]);
      }
      float out;
      if (nan) out = NAN;
      else if (m == -INFINITY) out = -INFINITY;
      else if (m == INFINITY) out = INFINITY;
      else {
        double s = 0;
        for (int64_t j = 0; j < V; ++j) s += std::exp(double(p.scale) * double(x[size_t(j)] - m));
        out = float(double(p.scale) * m + std::log(s));
      }
      store_f32(p.lse, i, out);
    }
  }
}

}  // namespace fce::cpu

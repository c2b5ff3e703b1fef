// fce_scale_rows on the CPU: rows in parallel, each element formed in fp32 and rounded once.
#include <vector>

#include "common/ops.hpp"
#include "cpu/cpu_util.hpp"

namespace fce::cpu {

void scale_rows(const ScaleProblem& p) {
  const int64_t N = p.x.rows, V = p.x.cols;
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float f = load_f32(p.factor, i);
      if (f == 1.f) continue;  // x * 1 is x: nothing to read or write
      load_row(p.x, i, row.data());
      for (float& v : row) v *= f;
      store_row(p.x, i, row.data());
    }
  }
}

}  // namespace fce::cpu

#include <vector>

#include "cpu/ce_row.hpp"

namespace fce::cpu {

size_t ce_workspace(const CeProblem&) { return 0; }

void ce_shard_backward(const CeProblem& p);  // vocab_parallel_cpu.cpp

void ce(const CeProblem& p, Workspace) {
  if (p.o.sharded()) return ce_shard_backward(p);  // the API takes a shard's backward only
  const int64_t N = p.logits.rows, V = p.logits.cols;
  const CeContext c(p.o, V);
  const bool want_grad = static_cast<bool>(p.dlogits);
  const double denom = (want_grad || p.o.reduction == FCE_REDUCTION_MEAN) ? c.mean_denominator(p.targets) : 0.0;
  std::vector<double> row_loss(p.backward() ? 0 : size_t(N)), row_zl(p.backward() ? 0 : size_t(N));

#pragma omp parallel
  {
    simd::Row xbuf(V), zbuf(V), gbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = load_index(p.targets.data, p.targets.dtype, i);
      const float* x = row_in(p.logits, i, xbuf.data());
      LsePair lse;
      float H = 0.f;
      const float* z;
      if (p.backward()) {
        lse = load_lse(p.saved_lse, i);
        if (p.grad_entropy) H = load_f32(p.saved_entropy, i);
        z = c.transformed(x, zbuf.data());
      } else {
        const CeRow r = ce_row_forward(c, x, zbuf.data(), t, static_cast<bool>(p.argmax));
        z = r.z;
        lse = r.pair;
        H = r.entropy;
        row_loss[size_t(i)] = r.loss;
        row_zl[size_t(i)] = r.z_loss;
        if (p.lse) store_lse(p.lse, i, r.pair, r.lse);
        if (p.entropy) store_f32(p.entropy, i, r.entropy);
        if (p.argmax) store_index(p.argmax.data, p.argmax.dtype, i, r.argmax);
        if (p.o.reduction == FCE_REDUCTION_NONE) {
          store_f32(p.loss, i, r.loss);
          if (p.z_loss) store_f32(p.z_loss, i, r.z_loss);
        }
      }
      if (want_grad) {  // z is read whole before dx is written (dlogits may be the logits, or z)
        float* dx = row_out(p.dlogits, i, gbuf.data());
        ce_row_grad(c, z, lse, t, c.grad_scale(p.grad_loss, i, denom), entropy_grad(p.grad_entropy, i, H), dx);
        row_out_done(p.dlogits, i, dx);
      }
    }
  }
  if (!p.backward()) reduce_losses(p.o.reduction, row_loss, row_zl, denom, p.loss, p.z_loss);
}

}  // namespace fce::cpu

// CUDA knowledge-distillation losses (fce_kd_loss): full teacher logits or a top-K teacher.
//
// A row is handled by C blocks (C = 1, 2, 4 or 8), block `rank` owning the columns split_range(V, C, rank).
// Phases, each followed by an exchange of per-block partials that every block of the row merges in rank
// order (so all of them hold bitwise-identical row statistics):
//   phase 0  raw maxima of the student (and teacher) logits                       -> exchange 0
//   phase 1  sums of exp(z - max z), z = logits / T: log d_s (and log d_t)        -> exchange 1
//   phase 2  the divergence terms of KdTerm (log p = (t/T - max) - log d_t, log q likewise, LogProb: from
//            max-shifted values, so no error grows with a common offset of the logits): the row's loss
//            and A = sum_j a_j                                                     -> exchange 2
//   phase 3  dstudent_j = scale * (a_j - q_j A) (kd_grad), scale = grad * T2factor / T (/ rows)
// The gradient needs A, known only once the whole row has been seen, so phase 3 recomputes a_j with KdTerm
// from the slices still in shared memory (one more exp per column for forward KL, two for reverse KL/JSD,
// plus q_j) rather than keeping it: keeping a_j in fp32 would double the shared memory of a resident bf16
// row pair (4 -> 8 bytes per column: fewer blocks per SM, or rows too long to stay resident), and keeping
// it in DRAM would add a write and a read of 4 bytes per column to the 6 the op moves. The recomputation
// is ~20 instructions per column, hidden behind the memory traffic.
// How the blocks of a row work together (plan_rows, from N, V, the dtypes and the GPU):
//   resident  the row's slices of student and teacher stay in shared memory from phase 0 on, so each is
//             read from DRAM exactly once whatever the number of phases: two reads (plus one write of
//             dstudent), the minimum. With C > 1 the C blocks are one thread-block cluster (Hopper) and
//             exchange partials through distributed shared memory. (A row of 128256 bf16 columns is
//             500 KiB for the pair: re-reading it "from L2" is not an option with ~400 rows in flight.)
//   streaming one block per row, re-reading the row from global memory in every phase (many rows too
//             long for shared memory, or no clusters).
//   phased    few rows too long for shared memory (or no clusters): split_count() blocks per row and one
//             launch per phase, partials through the workspace, merged in split order.
// Top-K teacher: ids [N,K] and teacher log-probs [N,K]; teacher p = softmax over the used slots of
// logprobs/T (every block computes it: K is small). Full-vocabulary normalization uses the same phases on
// the student alone, phase 2 taking the terms at the ids inside the block's own columns, phase 3 writing
// -q_j A everywhere and then a_k - q_k A at the ids (each element formed in fp32 and stored once per
// store; the id values overwrite the dense ones after a barrier). Renormalized over the K: one block per
// row that never reads the rest of the student row (gathers only; the gradient is 0 outside the K).
// Masked rows (targets == ignore_index, or a top-K row without a used slot): loss 0, gradient 0. A top-K
// id >= V: loss and gradient NaN. MEAN is batchmean over unmasked rows: with a gradient a tiny pre-kernel
// counts them (integer atomics: exact), and SUM/MEAN go through a single-block finalize that sums the
// per-row losses in a fixed order in fp64 (and counts the rows' unmasked flags for MEAN). No float atomics, no host sync, no allocation: bitwise
// repeatable and capturable in a CUDA graph.
// Faster paths when rows fill the GPU (at least one block per SM): forward only, forward and reverse KL and
// the full-vocabulary top-K need no normalized probability per element, so one streaming pass computes the
// loss (kd_kl_onepass_kernel, kd_topk_onepass_kernel: each row read once); with dstudent, forward and
// reverse KL of one dtype with aligned rows use persistent blocks (or clusters of two for long rows) that
// pipeline the rows through shared memory (kd_kl_grad_pipe_kernel: two passes, A known in closed form).
// The paths: cuda/plan.hpp (KdPath, and plan_rows for the rows path).
#include "cuda/kd_fast.cuh"
#include "cuda/kd_rows.cuh"

namespace fce::cuda {
namespace {

// ---- host side -------------------------------------------------------------------------------------

bool renormalized(const KdProblem& p) { return p.topk() && p.o.topk_norm == FCE_KD_TOPK_RENORMALIZE; }

// Generalized JSD at beta 0 / 1 is exactly forward / reverse KL (KdTerm's convention), decided here so
// the kernels specialize on it.
int effective_div(const KdProblem& p) {
  int div = p.o.divergence;
  if (div == FCE_KD_JSD && p.o.beta == 0.f) div = FCE_KD_FORWARD_KL;
  if (div == FCE_KD_JSD && p.o.beta == 1.f) div = FCE_KD_REVERSE_KL;
  return div;
}

// The plan of a call (src/cuda/plan.hpp: KdPath).
KdPlan kd_plan(const fce_handle* h, const KdProblem& p) {
  KdShape sh;
  sh.N = p.student.rows;
  sh.V = p.student.cols;
  sh.student_size = int(dtype_size(p.student.dtype));
  sh.teacher_size = p.topk() ? 0 : int(dtype_size(p.teacher.dtype));
  sh.dstudent = static_cast<bool>(p.dstudent);
  sh.topk = p.topk();
  sh.renormalized = renormalized(p);
  const int div = effective_div(p);
  sh.kl = div == FCE_KD_FORWARD_KL || div == FCE_KD_REVERSE_KL;
  if (p.dstudent && !p.topk() && p.teacher.dtype == p.student.dtype && p.dstudent.dtype == p.student.dtype) {
    const int es = sh.student_size;
    sh.pipe_layout = aligned16(p.student.data, p.student.ld, es) && aligned16(p.teacher.data, p.teacher.ld, es) &&
                     aligned16(p.dstudent.data, p.dstudent.ld, es) && p.student.cols * int64_t(es) >= 16 * 1024;
  }
  return plan_kd(sh, h->caps, kKdThreads);
}

struct KdWorkspace {
  int* count = nullptr;
  float* row_loss = nullptr;
  int* row_used = nullptr;
  LossA *ws0 = nullptr, *ws1 = nullptr, *ws2 = nullptr;  // 8-byte partials of any exchange
  float* slot_val = nullptr;
  size_t bytes = 0;
};

KdWorkspace kd_layout(const KdProblem& p, const RowPlan& pl, void* base) {
  Carver c(base);
  KdWorkspace w;
  const size_t N = size_t(p.student.rows), NC = N * size_t(pl.C);
  if (p.o.reduction == FCE_REDUCTION_MEAN && p.dstudent) w.count = c.take<int>(1);
  if (p.o.reduction != FCE_REDUCTION_NONE) {
    w.row_loss = c.take<float>(N);
    w.row_used = c.take<int>(N);
  }
  if (pl.phased) {
    w.ws0 = c.take<LossA>(NC);
    w.ws1 = c.take<LossA>(NC);
    w.ws2 = c.take<LossA>(NC);
  }
  if (p.dstudent && p.topk() && (renormalized(p) || !pl.resident))
    w.slot_val = c.take<float>(N * size_t(p.topk_ids.cols));
  w.bytes = c.used;
  return w;
}

static_assert(sizeof(Max2) == 8 && sizeof(Sum2) == 8 && sizeof(LossA) == 8, "8-byte partials");

// Runs the phases of a row kernel: one fused launch, or one launch per phase.
template <class Args>
void run_phases(void (*kernel)(Args), const RowPlan& pl, int64_t N, Args a, cudaStream_t s, const char* what) {
  if (pl.phased) {
    for (int ph = 0; ph <= kLastPhase; ++ph) {
      a.p0 = a.p1 = ph;
      launch_rows(kernel, pl, N, a, s, what);
    }
  } else {
    a.p0 = 0;
    a.p1 = kLastPhase;
    launch_rows(kernel, pl, N, a, s, what);
  }
}

}  // namespace

size_t kd_workspace(fce_handle* h, const KdProblem& p) {
  DeviceGuard guard(h->device_id);
  return kd_layout(p, kd_plan(h, p).rows, nullptr).bytes;
}

void kd(fce_handle* h, fce_stream_t stream, const KdProblem& p, Workspace w) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const int64_t N = p.student.rows, V = p.student.cols;
  const KdPlan plan = kd_plan(h, p);
  const RowPlan& pl = plan.rows;
  const KdWorkspace ws = kd_layout(p, pl, w.ptr);
  const bool reduced = p.o.reduction != FCE_REDUCTION_NONE;

  KdArgs a{};
  a.s = p.student.data;
  a.lds = p.student.ld;
  if (p.topk()) {
    a.ids = p.topk_ids.data;
    a.ldi = p.topk_ids.ld;
    a.ids64 = p.topk_ids.dtype == DType::I64;
    a.K = p.topk_ids.cols;
    a.lp = reinterpret_cast<const float*>(p.topk_lp.data);
    a.ldlp = p.topk_lp.ld;
  } else {
    a.t = p.teacher.data;
    a.ldt = p.teacher.ld;
    a.t_off = round16(slice_cols(V, pl.C) * int64_t(dtype_size(p.student.dtype)));
  }
  a.targets = p.targets ? p.targets.data : nullptr;
  a.tgt64 = p.targets && p.targets.dtype == DType::I64;
  a.ignore_index = p.o.ignore_index;
  a.ds = p.dstudent ? p.dstudent.data : nullptr;
  a.ldd = p.dstudent ? p.dstudent.ld : 0;
  a.grad = p.grad_loss ? reinterpret_cast<const float*>(p.grad_loss.data) : nullptr;
  a.grad_scalar = p.grad_loss && p.grad_loss.scalar;
  a.count = ws.count;
  a.row_loss = reduced ? ws.row_loss : reinterpret_cast<float*>(p.loss.data);
  a.row_used = ws.row_used;
  a.slot_val = ws.slot_val;
  a.reduction = p.o.reduction;
  const int div = effective_div(p);
  a.div = div;
  a.beta = p.o.beta;
  a.inv_t = 1.f / p.o.temperature;
  a.temperature = p.o.temperature;
  a.t2 = p.o.scale_by_t2 ? p.o.temperature * p.o.temperature : 1.f;
  a.N = N;
  a.V = V;
  a.C = pl.C;
  a.cluster = pl.cluster;
  a.ws0 = ws.ws0;
  a.ws1 = ws.ws1;
  a.ws2 = ws.ws2;

  if (ws.count) {
    check(cudaMemsetAsync(ws.count, 0, sizeof(int), s), "cudaMemsetAsync (KD row count)");
    const int64_t blocks = (N + 7) / 8;
    kd_count_kernel<<<unsigned(blocks), 256, 0, s>>>(a, ws.count);
    check_launch("KD row-count kernel");
  }
  dispatch_float(p.student.dtype, [&](auto stag) {
    using Ts = decltype(stag);
    const unsigned grid = unsigned(N < (int64_t(1) << 30) ? N : (int64_t(1) << 30));
    switch (plan.path) {
      case KdPath::Renorm:
        kd_topk_renorm_kernel<Ts><<<grid, pl.threads, 0, s>>>(a);
        check_launch("KD top-K kernel");
        break;
      case KdPath::Onepass:
        if (p.topk()) {
          kd_topk_onepass_kernel<Ts><<<grid, kKdThreads, 0, s>>>(a);
          check_launch("KD top-K kernel");
          break;
        }
        dispatch_float(p.teacher.dtype, [&](auto ttag) {
          using Tt = decltype(ttag);
          if (div == FCE_KD_FORWARD_KL) kd_kl_onepass_kernel<Ts, Tt, FCE_KD_FORWARD_KL><<<grid, kKdThreads, 0, s>>>(a);
          else kd_kl_onepass_kernel<Ts, Tt, FCE_KD_REVERSE_KL><<<grid, kKdThreads, 0, s>>>(a);
        });
        check_launch("KD kernel");
        break;
      case KdPath::Pipe:
      case KdPath::PipeC1: {
        const int64_t vecs = V * int64_t(sizeof(Ts)) / 16;
        const int64_t fit = pipe_smem(h->caps) / 32;  // both rows' slots
        const int C = plan.pipe_blocks;
        const int64_t slice = (vecs + C - 1) / C;
        const int64_t cache_vecs = slice < fit ? slice : fit;
        const size_t smem = size_t(cache_vecs) * 32;
        void (*kernel)(const KdArgs, int64_t) = nullptr;
        auto pick = [&](auto cc) {
          constexpr int CC = decltype(cc)::value;
          kernel = div == FCE_KD_FORWARD_KL ? kd_kl_grad_pipe_kernel<Ts, FCE_KD_FORWARD_KL, CC>
                                            : kd_kl_grad_pipe_kernel<Ts, FCE_KD_REVERSE_KL, CC>;
        };
        if (C == 2) pick(std::integral_constant<int, 2>{});
        else pick(std::integral_constant<int, 1>{});
        check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
              "cudaFuncSetAttribute");
        // Persistent clusters (blocks when C = 1): as few as give the same rows each as all that fit at once.
        const int sm = h->caps.sm_count > 0 ? h->caps.sm_count : 1;
        int64_t groups = C > 1 ? max_active_clusters(h, reinterpret_cast<const void*>(kernel), C, 1024, smem) : sm;
        if (groups <= 0) groups = sm / C > 0 ? sm / C : 1;
        const int64_t rows_each = (N + groups - 1) / groups;
        const int64_t g = (N + rows_each - 1) / rows_each;
        RowPlan lp;
        lp.C = C;
        lp.cluster = C > 1;
        lp.threads = 1024;
        lp.smem = smem;
        lp.resident = false;
        launch_grid(kernel, lp, g * C, s, "KD kernel", false, a, cache_vecs);
        break;
      }
      case KdPath::Rows:
        if (p.topk()) {
          if (pl.resident) run_phases(kd_topk_kernel<Ts, true>, pl, N, a, s, "KD top-K kernel");
          else run_phases(kd_topk_kernel<Ts, false>, pl, N, a, s, "KD top-K kernel");
          break;
        }
        dispatch_float(p.teacher.dtype, [&](auto ttag) {
          using Tt = decltype(ttag);
          if (!pl.resident) {
            run_phases(kd_full_kernel<Ts, Tt, -1, false>, pl, N, a, s, "KD kernel");
          } else if (div == FCE_KD_FORWARD_KL) {
            run_phases(kd_full_kernel<Ts, Tt, FCE_KD_FORWARD_KL, true>, pl, N, a, s, "KD kernel");
          } else if (div == FCE_KD_REVERSE_KL) {
            run_phases(kd_full_kernel<Ts, Tt, FCE_KD_REVERSE_KL, true>, pl, N, a, s, "KD kernel");
          } else {
            run_phases(kd_full_kernel<Ts, Tt, FCE_KD_JSD, true>, pl, N, a, s, "KD kernel");
          }
        });
        break;
    }
  });
  if (reduced) {
    kd_finalize_kernel<<<1, 1024, 0, s>>>(ws.row_loss, ws.row_used, N, p.o.reduction == FCE_REDUCTION_MEAN,
                                          reinterpret_cast<float*>(p.loss.data));
    check_launch("KD finalize kernel");
  }
}

}  // namespace fce::cuda

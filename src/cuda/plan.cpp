#include "cuda/plan.hpp"

#include <algorithm>

#include "common/force_path.hpp"

namespace fce::cuda {

// One entry per architecture measured; the default (arch 0) for the others. The reasons, by field:
//   split_blocks_per_sm 2: 4 and 8 blocks per SM were slower on the split-row kernels.
//   min_cols 4096: a block over fewer columns spends more on its merge than on its slice.
//   soft_smem 64 KiB: three resident blocks per SM overlap their phases; larger slices split further.
//   lse_reg_rows 64: the register path beats the split path up to here; at 64 x 151936 the split path runs.
//   softmax_reg_rows 64: as lse_reg_rows, with the softmax's stores.
//   replicate_bytes 24 KiB: one SM's store rate bounds a block's stores from about here.
//   max_replicas 8: more copies add loads (from L2) and no store rate.
//   lce_logits_tiles 176x128, 168x128 and lce_dweight_tile 128x160 (cuBLASLt's ids; src/cuda/blas.cpp takes
//   the first heuristic algorithm with one): 2-10 % above cublasGemmEx's logits GEMM, and the chunked dweight
//   GEMM, which adds into its output, at the whole GEMM's rate where cublasGemmEx's ran at 85 %.
// Measurements behind each: docs/lab-notes.md, "Kernel choices" (H100). sm_80 and the default carry the
// H100's values, not measured on those devices, but for the cuBLASLt tiles (Hopper's kernels): none.
namespace {
// cuBLASLt's tile ids (cublasLtMatmulTile_t) of the sm_90 entry: 201 = 176x128, 197 = 168x128, 29 = 128x160.
constexpr Tuning kTunings[] = {
    {90, 2, 4096, size_t(64) << 10, 64, 64, 24 << 10, 8, {201, 197}, 29},
    {80, 2, 4096, size_t(64) << 10, 64, 64, 24 << 10, 8, {0, 0}, 0},
    {0, 2, 4096, size_t(64) << 10, 64, 64, 24 << 10, 8, {0, 0}, 0},
};
}  // namespace

const Tuning& tuning_for(int arch) {
  for (const Tuning& t : kTunings)
    if (t.arch == arch) return t;
  // The nearest older entry of the same major generation, else the default.
  const Tuning* best = &kTunings[sizeof(kTunings) / sizeof(kTunings[0]) - 1];
  for (const Tuning& t : kTunings)
    if (t.arch && t.arch / 10 == arch / 10 && t.arch < arch && (best->arch == 0 || t.arch > best->arch)) best = &t;
  return *best;
}

int64_t slice_cols(int64_t V, int C) {
  int64_t b, e;
  split_range(V, C, 0, &b, &e);  // rank 0 has the widest slice
  return e - b;
}

size_t round16(int64_t bytes) { return size_t((bytes + 15) / 16 * 16); }

int split_count(const DeviceCaps& c, int64_t N, int64_t V) {
  const Tuning& t = tuning_for(c.arch);
  const int64_t target = int64_t(c.sm_count) * t.split_blocks_per_sm;
  if (N >= target) return 1;
  int64_t s = (target + N - 1) / N;
  const int64_t by_cols = V / t.min_cols;
  if (s > by_cols) s = by_cols;
  if (s > 256) s = 256;
  return s < 1 ? 1 : int(s);
}

// ---- rows planner -------------------------------------------------------------------------------------

RowsForce rows_force() {
  static constexpr const char* kNames[] = {"nocluster", "stream", "split"};
  const int f = forced_path("rows", kNames);
  return f < 0 ? RowsForce::None : RowsForce(f + 1);
}

namespace {

// Threads per block: short slices get small blocks; long ones wide blocks when the blocks are few (or when
// a streamed row is long), 256 otherwise (several blocks per SM overlap their phases).
int threads_for(int64_t blocks, int64_t cols, int sm, bool streaming, int max_threads) {
  int t = 256;
  if (cols <= 1024) t = 64;
  else if (cols <= 4096) t = 128;
  else if (blocks < sm || (streaming && cols > 16384)) t = 512;
  return t < max_threads ? t : max_threads;
}

}  // namespace

RowPlan plan_rows(const DeviceCaps& c, int64_t N, int64_t V, int sa, int sb, int max_threads) {
  const RowsForce force = rows_force();
  const Tuning& t = tuning_for(c.arch);
  const int sm = c.sm_count > 0 ? c.sm_count : 1;
  const size_t budget = c.max_smem_optin > 8192 ? size_t(c.max_smem_optin) - 4096 : 0;  // static smem margin
  RowPlan p;
  if (force == RowsForce::None || force == RowsForce::NoCluster) {
    const int cmax = force != RowsForce::NoCluster && c.clusters ? kMaxCluster : 1;
    for (int C = 1; C <= cmax; C *= 2) {
      const int64_t cols = slice_cols(V, C);
      const size_t smem = round16(cols * sa) + (sb ? round16(cols * sb) : 0);
      if (smem > budget) continue;
      const bool few = N * C < 2 * int64_t(sm) && cols >= 2 * t.min_cols;  // worth splitting further
      if (C < cmax && (smem > t.soft_smem || few)) continue;
      if (few && cmax == 1) break;  // no clusters: few long rows go to the phased split
      p.C = C;
      p.cluster = C > 1;
      p.resident = true;
      p.threads = threads_for(N * C, cols, sm, false, max_threads);
      p.smem = smem;
      return p;
    }
  }
  int S = split_count(c, N, V);
  if (force == RowsForce::Stream) S = 1;
  if (force == RowsForce::Split && S < 4) S = 4;
  p.C = S;
  p.phased = S > 1 || force == RowsForce::Split;
  p.threads = threads_for(N * S, slice_cols(V, S), sm, true, max_threads);
  return p;
}

// ---- register-resident rows ---------------------------------------------------------------------------

// Blocks that a register plan may take: up to 3/4 of the SMs, so that the clusters fit at once with room to
// spare (clusters the occupancy query accepts were at times placed in two waves at 7 or 8 blocks; at 6
// never: docs/lab-notes.md, "Kernel choices").
int64_t reg_block_limit(const DeviceCaps& c) { return int64_t(c.sm_count > 0 ? c.sm_count : 1) * 3 / 4; }

// The register plan of C blocks per row for rows of V values of `esize` bytes (false when a slice needs
// more than 1024 threads). Threads sized to the slice (two or four vectors each, a multiple of a warp), so
// that no slot is idle. reads_only (a kernel that writes one value per row, logsumexp): a multiple of four
// warps above 128 threads, so that each of an SM's four schedulers (and its share of the special-function
// units) gets as many warps; plan_regs then allows up to two blocks per SM, whose exponentials, merges and
// exchanges overlap (docs/lab-notes.md, "Kernel choices").
bool reg_plan_at(int64_t V, int C, int esize, bool reads_only, RegPlan* out) {
  const int64_t K = 16 / esize;
  const int64_t vecs = (slice_cols(V, C) + K - 1) / K;
  const int64_t R = vecs <= 64 ? 1 : vecs <= 2 * 1024 ? 2 : kMaxRegVecs;
  int64_t threads = std::max<int64_t>(64, ((vecs + R - 1) / R + 31) / 32 * 32);
  if (reads_only && threads > 128) threads = (threads + 127) / 128 * 128;
  out->C = C;
  out->threads = int(std::min<int64_t>(threads, 1024));
  out->R = int(R);
  return threads <= 1024;
}

// Register-resident plan for decode batches (C blocks per row, a cluster when C > 1, R vectors per thread),
// or C = 0 when the rows do not fit (more than kMaxRegVecs vectors for 1024 threads would spill), are not
// 16-byte aligned or are more than max_rows. C grows while the N * C blocks stay within 3/4 of the SMs (two
// blocks per SM for reads_only) and the slices are long; then it shrinks while the N clusters would not all
// be resident at once (a second wave of clusters costs a whole kernel's latency). Plans of more than 5/4 of
// a block per SM (two for reads_only) are refused: beyond that, these one-shot clusters run in waves whose
// packing varies from process to process (docs/lab-notes.md, "Kernel choices").
RegPlan plan_regs(const DeviceCaps& c, int64_t N, int64_t V, int esize, bool aligned16, const ClusterFit& fit,
                  int64_t max_rows, bool reads_only, bool one_wave) {
  RegPlan p;
  const int sm = c.sm_count > 0 ? c.sm_count : 1;
  const Tuning& t = tuning_for(c.arch);
  if (N > max_rows || !aligned16) return p;
  // Non-portable clusters (9..16 blocks) only where the device reports room for all N of them at once.
  const int cmax = !c.clusters ? 1 : fit.nonportable(kMaxRegVecs) ? kMaxFewCluster : kMaxCluster;
  auto plan = [&](int C, RegPlan* out) { return reg_plan_at(V, C, esize, reads_only, out); };
  const int64_t limit = reads_only ? 2 * int64_t(sm) : reg_block_limit(c);
  int C = 1;
  for (; C <= cmax; ++C) {
    if (!plan(C, &p)) continue;
    if (C < cmax && N * (C + 1) <= limit && slice_cols(V, C) >= 2 * t.min_cols) continue;
    break;
  }
  if (C > cmax) return RegPlan{};
  const int64_t cap = reads_only ? 2 * int64_t(sm) : int64_t(sm) * 5 / 4;
  auto capped = [&](const RegPlan& r) { return int64_t(r.C) * N > cap ? RegPlan{} : r; };
  for (int k = C; k > 1; --k) {
    RegPlan q;
    if (!plan(k, &q)) break;
    const int n = fit.clusters(q.R, k, q.threads);
    if ((n == 0 && k <= kMaxCluster) || N <= n) return capped(q);
  }
  if (p.C > kMaxCluster) return RegPlan{};  // no non-portable cluster fits: not this path
  // No smaller cluster fits in one wave either. one_wave: refuse (the softmax's shared-memory kernel does
  // better then: docs/lab-notes.md, "Kernel choices"). Otherwise the first choice.
  if (one_wave && C > 1) return RegPlan{};
  return capped(p);
}

// Replicas for a register plan `p` whose blocks each write `out_bytes`: D copies of each row's cluster (D
// clusters per row, gridDim.y) each compute the row's statistics from their own loads and write 1/D of the
// row, so that D times as many SMs share the stores; the other copies' loads hit L2. Worth it where a block
// would store at least replicate_bytes (one SM's store rate bounds a block's stores: dev/probe_store_rate.cu).
// D stays within reg_block_limit, the warps of a block (a replica writes the values of every D-th warp) and
// the clusters the device holds at once.
RegPlan replicate_rows(const DeviceCaps& c, int64_t N, RegPlan p, int64_t out_bytes, const ClusterFit& fit) {
  const Tuning& t = tuning_for(c.arch);
  if (p.C < 2 || out_bytes < t.replicate_bytes) return p;
  int64_t D = std::min<int64_t>({reg_block_limit(c) / (N * p.C), p.threads / 32, int64_t(t.max_replicas)});
  const int n = fit.clusters(p.R, p.C, p.threads);
  if (n > 0) D = std::min<int64_t>(D, n / N);
  p.D = D > 1 ? int(D) : 1;
  return p;
}

// ---- persistent pipelined rows ------------------------------------------------------------------------

// Dynamic shared bytes per block (one block per SM), leaving a margin for static shared memory.
int64_t pipe_smem(const DeviceCaps& c) { return int64_t(c.max_smem_optin) - 4096; }

// Persistent blocks for N rows: as few as give the same rows per block as one per SM (4096 rows on 132 SMs:
// 128 blocks of 32 rows, not 4 blocks finishing a 32nd row alone while the rest idle).
int64_t pipe_grid(const DeviceCaps& c, int64_t N) {
  const int64_t sm = c.sm_count > 0 ? c.sm_count : 1;
  if (N <= sm) return N;
  const int64_t per = (N + sm - 1) / sm;
  return (N + per - 1) / per;
}

// ---- cross-entropy rows and logsumexp -----------------------------------------------------------------

namespace {

// Blocks per row of a forced split path: at least 2 and up to 4 (so that the merge has partials to merge),
// at most kMaxGatherCluster for the cluster path; 0 (not this path) for rows of fewer than two 64-column
// slices.
int forced_splits(int s, int64_t V, bool cluster) {
  if (V < 128) return 0;
  const int64_t want = std::min<int64_t>(4, V / 64);
  int64_t k = std::max<int64_t>(s, want);
  if (cluster) k = std::min<int64_t>(k, kMaxGatherCluster);
  return int(k);
}

// The split paths of CE and logsumexp with `splits` blocks per row: one cluster launch where the device
// has clusters and the partials fit one, else partial and merge kernels.
bool split_cluster_ok(const DeviceCaps& c, int splits) { return c.clusters && splits <= kMaxGatherCluster; }

}  // namespace

int ce_splits(const DeviceCaps& c, int64_t N, int64_t V) {
  const int s = split_count(c, N, V);
  const int f = forced_path("ce", kCePaths);
  const int k = f == int(CePath::SplitCluster) && c.clusters ? forced_splits(s, V, true)
                : f == int(CePath::SplitPhased)              ? forced_splits(s, V, false)
                                                             : 0;
  return k ? k : s;
}

CePlan plan_ce(const CeShape& s, const DeviceCaps& c, const ClusterFit& fit) {
  CePlan p;
  p.splits = ce_splits(c, s.N, s.V);
  if (s.backward) {
    p.path = CePath::Backward;
    return p;
  }
  const int64_t max_rows = tuning_for(c.arch).lse_reg_rows;
  auto regs = [&] { return plan_regs(c, s.N, s.V, s.esize, s.aligned16, fit, max_rows, /*reads_only=*/true); };
  const bool pipe = s.grad && s.pipe_layout && c.sm_count > 0;
  const int f = forced_path("ce", kCePaths);
  const bool split =
      f == int(CePath::SplitPhased) || (f == int(CePath::SplitCluster) && split_cluster_ok(c, p.splits));
  if (split && p.splits >= 2) {  // a split path needs two blocks per row
    p.path = CePath(f);
    return p;
  }
  p.splits = split_count(c, s.N, s.V);
  const bool regs_ok = !s.grad && s.regs_options;
  if (f == int(CePath::Regs) && regs_ok && (p.regs = regs()).C > 0) p.path = CePath::Regs;
  else if (f == int(CePath::Pipe) && pipe) p.path = CePath::Pipe;
  else if (f == int(CePath::Cached) && s.grad) p.path = CePath::Cached;
  else if (f == int(CePath::Row) && !s.grad) p.path = CePath::Row;
  // The planner's choice (also where a forced path cannot run the call):
  else if (regs_ok && p.splits > 1 && (p.regs = regs()).C > 0) p.path = CePath::Regs;  // few rows: one launch
  else if (p.splits == 1 && pipe) p.path = CePath::Pipe;
  else if (p.splits == 1 && s.grad) p.path = CePath::Cached;
  else if (p.splits == 1) p.path = CePath::Row;
  else p.path = split_cluster_ok(c, p.splits) ? CePath::SplitCluster : CePath::SplitPhased;
  if (p.path != CePath::SplitCluster && p.path != CePath::SplitPhased && p.path != CePath::Regs) p.splits = 1;
  return p;
}

int lse_splits(const DeviceCaps& c, int64_t N, int64_t V) {
  const int s = split_count(c, N, V);
  const int f = forced_path("lse", kLsePaths);
  const int k = f == int(LsePath::SplitCluster) && c.clusters ? forced_splits(s, V, true)
                : f == int(LsePath::SplitPhased)              ? forced_splits(s, V, false)
                                                              : 0;
  return k ? k : s;
}

LsePlan plan_lse(int64_t N, int64_t V, int esize, bool aligned16, const DeviceCaps& c, const ClusterFit& fit) {
  LsePlan p;
  p.splits = lse_splits(c, N, V);
  const int64_t max_rows = tuning_for(c.arch).lse_reg_rows;
  auto regs = [&] { return plan_regs(c, N, V, esize, aligned16, fit, max_rows, /*reads_only=*/true); };
  const int f = forced_path("lse", kLsePaths);
  const bool split =
      f == int(LsePath::SplitPhased) || (f == int(LsePath::SplitCluster) && split_cluster_ok(c, p.splits));
  if (split && p.splits >= 2) {  // a split path needs two blocks per row
    p.path = LsePath(f);
    return p;
  }
  p.splits = split_count(c, N, V);
  if (f == int(LsePath::Regs) && (p.regs = regs()).C > 0) p.path = LsePath::Regs;
  else if (f == int(LsePath::Row)) p.path = LsePath::Row;
  // The planner's choice (also where a forced path cannot run the call):
  else if (p.splits > 1 && (p.regs = regs()).C > 0) p.path = LsePath::Regs;  // few rows: one launch
  else if (p.splits == 1) p.path = LsePath::Row;
  else p.path = split_cluster_ok(c, p.splits) ? LsePath::SplitCluster : LsePath::SplitPhased;
  if (p.path == LsePath::Row) p.splits = 1;
  return p;
}

// ---- temperature softmax ------------------------------------------------------------------------------

namespace {

// A register plan of four vectors per thread spread over more SMs: clusters of kMaxCluster blocks where
// they keep one block per SM (N * C <= SMs), in blocks of at most two_threads threads of the kernel whose
// registers leave room for two blocks per SM. With the 64-register kernel not all N such clusters fit at
// once (an H100 holds 15 clusters of 8 one-per-SM blocks: one GPC is short), so the plan stays at 6 blocks
// per row for 16 rows; with room for two blocks per SM all N fit at once. More SMs then share the row's
// exponentials and stores (docs/lab-notes.md, "Kernel choices").
RegPlan spread_regs(const DeviceCaps& c, int64_t N, int64_t V, int esize, RegPlan rp, const ClusterFit& two,
                    int two_threads) {
  constexpr int C = kMaxCluster;
  if (rp.R != kMaxRegVecs || rp.D > 1 || rp.C >= C || N * C > c.sm_count) return rp;
  RegPlan q;
  if (!reg_plan_at(V, C, esize, /*reads_only=*/false, &q) || q.R != kMaxRegVecs || q.threads > two_threads ||
      two.clusters(kMaxRegVecs, C, q.threads) < N)
    return rp;
  q.two = true;
  return q;
}

}  // namespace

SoftmaxPlan plan_softmax(const SoftmaxShape& s, const DeviceCaps& c, const ClusterFit& fit,
                         const ClusterFit& fit_two, int two_threads) {
  SoftmaxPlan p;
  p.rows = plan_rows(c, s.N, s.V, s.esize, 0, 512);
  // A forced rows path turns the lean kernels off (they would not run the path it names).
  const bool lean = s.probs_only && rows_force() == RowsForce::None;
  const int f = forced_path("softmax", kSoftmaxPaths);
  auto regs = [&] {
    RegPlan r = plan_regs(c, s.N, s.V, s.esize, s.aligned16, fit, tuning_for(c.arch).softmax_reg_rows,
                          /*reads_only=*/false, /*one_wave=*/true);
    if (r.C == 0) return r;
    r = replicate_rows(c, s.N, r, slice_cols(s.V, r.C) * s.out_size, fit);
    return spread_regs(c, s.N, s.V, s.esize, r, fit_two, two_threads);
  };
  const bool smem = lean && p.rows.resident && s.N * p.rows.C <= (int64_t(1) << 30);
  if (f == int(SoftmaxPath::Regs) && lean && (p.regs = regs()).C > 0) p.path = SoftmaxPath::Regs;
  else if (f == int(SoftmaxPath::Smem) && smem) p.path = SoftmaxPath::Smem;
  else if (f == int(SoftmaxPath::Rows)) p.path = SoftmaxPath::Rows;
  // The planner's choice (also where a forced path cannot run the call):
  else if (lean && (p.regs = regs()).C > 0) p.path = SoftmaxPath::Regs;
  else if (smem) p.path = SoftmaxPath::Smem;
  else p.path = SoftmaxPath::Rows;
  return p;
}

// ---- knowledge distillation ---------------------------------------------------------------------------

KdPlan plan_kd(const KdShape& s, const DeviceCaps& c, int kd_threads) {
  KdPlan p;
  const int64_t sm = c.sm_count > 0 ? c.sm_count : 1;
  const bool rows_free = rows_force() == RowsForce::None;  // a forced rows path turns the others off
  // Forward only, a divergence that needs no normalized probability per element: one streaming pass.
  const bool onepass = !s.dstudent && !s.renormalized && (s.topk || s.kl);
  // With dstudent, forward or reverse KL of one layout: persistent blocks pipelining the rows.
  const bool pipe = s.dstudent && !s.topk && s.kl && s.pipe_layout;
  const int f = forced_path("kd", kKdPaths);
  if (s.renormalized) p.path = KdPath::Renorm;
  else if (f == int(KdPath::Onepass) && onepass) p.path = KdPath::Onepass;
  else if ((f == int(KdPath::Pipe) || f == int(KdPath::PipeC1)) && pipe) p.path = KdPath(f);
  else if (f == int(KdPath::Rows)) p.path = KdPath::Rows;
  // The planner's choice (also where a forced path cannot run the call): the one-block-per-row paths when
  // the rows fill the GPU.
  else if (rows_free && onepass && s.N >= 2 * sm) p.path = KdPath::Onepass;
  else if (rows_free && pipe && s.N >= sm) p.path = KdPath::Pipe;
  else p.path = KdPath::Rows;
  if (p.path == KdPath::Rows) {
    p.rows = plan_rows(c, s.N, s.V, s.student_size, s.topk ? 0 : s.teacher_size, kd_threads);
  } else {
    p.rows.threads = 128;
  }
  if (p.path == KdPath::Pipe) {
    // Blocks per row pair: 2 (a cluster) when the pair does not fit one SM's shared memory, else 1 (4 pays
    // the per-row costs four times over; docs/lab-notes.md, "Kernel choices").
    const int64_t vecs = s.V * int64_t(s.student_size) / 16, fit = pipe_smem(c) / 32;  // both rows' slots
    p.pipe_blocks = vecs <= fit || !c.clusters ? 1 : 2;
  } else if (p.path == KdPath::PipeC1) {
    p.path = KdPath::Pipe;
    p.pipe_blocks = 1;
  }
  return p;
}

}  // namespace fce::cuda

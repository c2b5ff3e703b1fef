// The plan of a CUDA call: which of an op's paths runs it and with how many blocks per row, decided on the
// host from the call's shape, dtypes and alignment and the device's capabilities (DeviceCaps) only. Pure
// functions (plan.cpp, plain C++): tests/unit/test_plan.cpp runs them without a GPU. Each op's host code
// launches through one switch on its plan; FCE_FORCE_PATH=<op>:<path> forces a path where it can run the
// call (src/common/force_path.hpp). The paths, per op:
//   ce       backward | regs | pipe | cached | row | split_cluster | split_phased   (cross_entropy.cu)
//   lse      regs | row | split_cluster | split_phased                               (cross_entropy.cu)
//   softmax  regs | smem | rows                                                      (softmax.cu)
//   kd       renorm | onepass | pipe | pipe_c1 | rows                                (kd.cu)
//   rows     nocluster | stream | split: the fallbacks of plan_rows, the planner of softmax's and KD's
//            `rows` path; forcing any of them also turns softmax's and KD's other paths off.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/device_caps.hpp"

#if defined(__CUDACC__)
#define FCE_HD __host__ __device__ __forceinline__
#else
#define FCE_HD inline
#endif

namespace fce::cuda {

constexpr int kMaxCluster = 8;        // portable cluster size
constexpr int kMaxFewCluster = 16;    // register-resident rows: non-portable clusters where allowed
constexpr int kMaxGatherCluster = 8;  // split rows whose partials one cluster gathers
constexpr int kMaxRegVecs = 4;        // 16-byte vectors per thread of a register plan

// Host-side tuning, one entry per architecture (plan.cpp's table gives each value's reason).
struct Tuning {
  int arch;                    // compute capability of the entry (0: the default)
  int split_blocks_per_sm;     // split_count's target blocks per SM for few rows
  int64_t min_cols;            // fewest columns worth one more block of a row
  size_t soft_smem;            // preferred shared bytes per block of a resident row
  int64_t lse_reg_rows;        // rows up to which logsumexp and the CE forward try the register path
  int64_t softmax_reg_rows;    // rows up to which the softmax tries the register path
  int64_t replicate_bytes;     // stores per block from which a register plan replicates its clusters
  int max_replicas;            // most copies of a row's cluster
  int lce_logits_tiles[2];     // linear CE's logits GEMM: cuBLASLt tile ids to take first (0: none)
  int lce_dweight_tile;        // linear CE's dweight GEMM (adding into its output): the same
};
const Tuning& tuning_for(int arch);

// Columns [begin, end) of split `k` of `splits` over V (multiples of 64 so vector loads stay aligned).
FCE_HD void split_range(int64_t V, int splits, int k, int64_t* begin, int64_t* end) {
  int64_t chunk = (V + splits - 1) / splits;
  chunk = (chunk + 63) / 64 * 64;
  *begin = chunk * k < V ? chunk * k : V;
  *end = chunk * (k + 1) < V ? chunk * (k + 1) : V;
}
int64_t slice_cols(int64_t V, int C);  // the widest split's columns
size_t round16(int64_t bytes);

// Blocks per row: 1 when there are enough rows to fill the GPU, else enough to give every SM a few blocks,
// each with at least min_cols columns. Depends only on (N, V, the device): deterministic.
int split_count(const DeviceCaps& c, int64_t N, int64_t V);

// What the runtime says about the kernel a register plan would launch (for R vectors per thread); tests
// give fixed answers.
struct ClusterFit {
  virtual ~ClusterFit() = default;
  // Clusters of C blocks of `threads` threads resident at once; 0 when unknown or not allowed.
  virtual int clusters(int R, int C, int threads) const = 0;
  // Whether clusters of kMaxFewCluster (non-portable) blocks may launch.
  virtual bool nonportable(int R) const = 0;
};

// ---- rows planner (softmax, KD) --------------------------------------------------------------------
enum class RowsForce { None, NoCluster, Stream, Split };
RowsForce rows_force();  // FCE_FORCE_PATH=rows:<...>

struct RowPlan {
  int C = 1;              // blocks per row
  bool cluster = false;   // fused launch whose C > 1 blocks per row form a cluster
  bool resident = false;  // slices kept in shared memory
  bool phased = false;    // one launch per phase, partials through the workspace
  int threads = 256;
  size_t smem = 0;        // dynamic shared bytes per block
  int replicas = 1;       // gridDim.y
};
// N rows of V columns whose resident slices take `sa` (+ `sb`) bytes per column, for a kernel of at most
// `max_threads` threads per block.
RowPlan plan_rows(const DeviceCaps& c, int64_t N, int64_t V, int sa, int sb, int max_threads);

// ---- register-resident rows (few rows: logsumexp, CE forward, softmax) ------------------------------
struct RegPlan {
  int C = 0, R = 0, threads = 512;  // C == 0: no plan
  int D = 1;         // replicas of each row's cluster (gridDim.y; see replicate_rows)
  bool two = false;  // the softmax's kernel with registers for two blocks per SM (spread_regs)
};
bool reg_plan_at(int64_t V, int C, int esize, bool reads_only, RegPlan* out);
int64_t reg_block_limit(const DeviceCaps& c);
// The register plan of N rows (or none): see plan.cpp.
RegPlan plan_regs(const DeviceCaps& c, int64_t N, int64_t V, int esize, bool aligned16, const ClusterFit& fit,
                  int64_t max_rows, bool reads_only = false, bool one_wave = false);
RegPlan replicate_rows(const DeviceCaps& c, int64_t N, RegPlan p, int64_t out_bytes, const ClusterFit& fit);

// ---- persistent pipelined rows (CE with dlogits, KD with dstudent) ----------------------------------
int64_t pipe_smem(const DeviceCaps& c);
int64_t pipe_grid(const DeviceCaps& c, int64_t N);

// ---- cross-entropy rows and logsumexp ---------------------------------------------------------------
enum class CePath { Backward, Regs, Pipe, Cached, Row, SplitCluster, SplitPhased };
inline constexpr const char* kCePaths[] = {"backward", "regs", "pipe", "cached", "row", "split_cluster",
                                           "split_phased"};
struct CeShape {
  int64_t N = 0, V = 0;
  int esize = 2;              // logits bytes per element
  bool grad = false;          // dlogits written
  bool backward = false;      // from a saved lse
  bool regs_options = false;  // options the register path covers (no soft-cap, smoothing, entropy, argmax)
  bool aligned16 = false;     // logits rows 16-byte aligned
  bool pipe_layout = false;   // logits and dlogits of one dtype, 16-byte aligned rows of >= 16 KiB
};
struct CePlan {
  CePath path = CePath::Row;
  int splits = 1;  // blocks per row of the split and backward paths
  RegPlan regs;    // the Regs path's plan
};
// Blocks per row of the split and backward paths (the workspace is sized by it).
int ce_splits(const DeviceCaps& c, int64_t N, int64_t V);
CePlan plan_ce(const CeShape& s, const DeviceCaps& c, const ClusterFit& fit);

enum class LsePath { Regs, Row, SplitCluster, SplitPhased };
inline constexpr const char* kLsePaths[] = {"regs", "row", "split_cluster", "split_phased"};
int lse_splits(const DeviceCaps& c, int64_t N, int64_t V);
struct LsePlan {
  LsePath path = LsePath::Row;
  int splits = 1;
  RegPlan regs;
};
LsePlan plan_lse(int64_t N, int64_t V, int esize, bool aligned16, const DeviceCaps& c, const ClusterFit& fit);

// ---- temperature softmax ------------------------------------------------------------------------------
enum class SoftmaxPath { Regs, Smem, Rows };
inline constexpr const char* kSoftmaxPaths[] = {"regs", "smem", "rows"};
struct SoftmaxShape {
  int64_t N = 0, V = 0;
  int esize = 2;            // logits bytes per element
  int out_size = 2;         // probabilities' bytes per element
  bool probs_only = false;  // probabilities without log-probabilities
  bool aligned16 = false;   // logits rows 16-byte aligned
};
struct SoftmaxPlan {
  SoftmaxPath path = SoftmaxPath::Rows;
  RowPlan rows;  // the rows path's plan (and the workspace's)
  RegPlan regs;  // the regs path's plan
};
// `fit`: the register kernel of four vectors per thread; `fit_two`: its variant of up to `two_threads`
// threads with registers for two blocks per SM.
SoftmaxPlan plan_softmax(const SoftmaxShape& s, const DeviceCaps& c, const ClusterFit& fit,
                         const ClusterFit& fit_two, int two_threads);

// ---- knowledge distillation ---------------------------------------------------------------------------
enum class KdPath { Renorm, Onepass, Pipe, PipeC1, Rows };
inline constexpr const char* kKdPaths[] = {"renorm", "onepass", "pipe", "pipe_c1", "rows"};
struct KdShape {
  int64_t N = 0, V = 0;
  int student_size = 2, teacher_size = 2;  // bytes per element (teacher 0: top-K teacher)
  bool dstudent = false;
  bool topk = false;
  bool renormalized = false;  // top-K renormalized over the K (its own kernel, nothing to plan)
  bool kl = false;            // forward or reverse KL (after the JSD beta = 0 / 1 cases)
  bool pipe_layout = false;   // student, teacher and dstudent of one dtype, 16-byte aligned rows of >= 16 KiB
};
struct KdPlan {
  KdPath path = KdPath::Rows;
  RowPlan rows;  // the rows path's plan (and the workspace's); threads for the one-block-per-row paths
  int pipe_blocks = 1;  // blocks per row pair of the pipe path (2: a cluster)
};
// `kd_threads`: the most threads per block of the rows path's kernels.
KdPlan plan_kd(const KdShape& s, const DeviceCaps& c, int kd_threads);

}  // namespace fce::cuda

// The CUDA planners (src/cuda/plan.hpp) on the host, no GPU: shape -> path tables for an H100's
// capabilities and for smaller GPUs without clusters, and FCE_FORCE_PATH.
#include <gtest/gtest.h>

#include <cstdlib>

#include "common/error.hpp"
#include "cuda/plan.hpp"

using namespace fce;
using namespace fce::cuda;

namespace {

const DeviceCaps kH100{90, 132, 232448, true, true};
const DeviceCaps kA100{80, 108, 166912, false, true};
const DeviceCaps kL4{89, 58, 101376, false, true};

// Occupancy answers of a device whose SMs come in GPCs of `gpc` SMs: clusters never straddle a GPC.
struct Fit : ClusterFit {
  int sms, gpc;
  bool big;
  Fit(int s, int g, bool b) : sms(s), gpc(g), big(b) {}
  int clusters(int, int C, int threads) const override {
    if (C > 8 && !big) return 0;
    const int per_sm = threads <= 512 ? 2 : 1;
    return (sms / gpc) * (gpc * per_sm / C);
  }
  bool nonportable(int) const override { return big; }
};
const Fit kH100Fit(132, 16, true);  // 8 GPCs of 16 usable SMs (and 4 left over)
const Fit kNoFit(108, 14, false);

// Sets FCE_FORCE_PATH for the scope.
struct Force {
  explicit Force(const char* v) { setenv("FCE_FORCE_PATH", v, 1); }
  ~Force() { unsetenv("FCE_FORCE_PATH"); }
};

CeShape ce(int64_t N, int64_t V, bool grad, bool aligned = true) {
  CeShape s;
  s.N = N;
  s.V = V;
  s.esize = 2;
  s.grad = grad;
  s.regs_options = !grad;
  s.aligned16 = aligned;
  s.pipe_layout = grad && aligned && V * 2 >= 16 * 1024;
  return s;
}

}  // namespace

TEST(Plan, SplitCount) {
  // Enough rows for two blocks per SM: one block per row.
  EXPECT_EQ(split_count(kH100, 264, 128256), 1);
  EXPECT_EQ(split_count(kH100, 8192, 128256), 1);
  // One row: 2 * 132 blocks wanted, at most V / 4096 (31) of them.
  EXPECT_EQ(split_count(kH100, 1, 128256), 31);
  EXPECT_EQ(split_count(kH100, 64, 128256), 5);   // ceil(264 / 64)
  EXPECT_EQ(split_count(kA100, 64, 128256), 4);   // ceil(216 / 64)
  EXPECT_EQ(split_count(kH100, 1, 4095), 1);      // too short to split
  int64_t b, e;
  split_range(1000, 3, 2, &b, &e);  // 64-column multiples: 384, 384, 232
  EXPECT_EQ(b, 768);
  EXPECT_EQ(e, 1000);
  EXPECT_EQ(slice_cols(1000, 3), 384);
}

TEST(Plan, TuningTable) {
  EXPECT_EQ(tuning_for(90).arch, 90);
  EXPECT_EQ(tuning_for(80).arch, 80);
  EXPECT_EQ(tuning_for(86).arch, 80);   // the nearest older entry of the generation
  EXPECT_EQ(tuning_for(75).arch, 0);    // the default
  EXPECT_EQ(tuning_for(100).arch, 0);
}

TEST(Plan, CrossEntropyPaths) {
  struct Row {
    const DeviceCaps* caps;
    const Fit* fit;
    CeShape shape;
    CePath path;
    int splits;
  };
  CeShape bwd = ce(8192, 128256, true);
  bwd.backward = true;
  CeShape entropy = ce(1, 128256, false);
  entropy.regs_options = false;  // entropy: not the register path
  const Row rows[] = {
      {&kH100, &kH100Fit, ce(8192, 128256, false), CePath::Row, 1},
      {&kH100, &kH100Fit, ce(8192, 128256, true), CePath::Pipe, 1},
      {&kH100, &kH100Fit, ce(8192, 128256, true, /*aligned=*/false), CePath::Cached, 1},
      {&kH100, &kH100Fit, bwd, CePath::Backward, 1},
      {&kH100, &kH100Fit, ce(1, 128256, false), CePath::Regs, 16},
      {&kH100, &kH100Fit, ce(1, 128256, false, /*aligned=*/false), CePath::SplitPhased, 31},
      {&kH100, &kH100Fit, entropy, CePath::SplitPhased, 31},
      {&kH100, &kH100Fit, ce(64, 32768, false, false), CePath::SplitCluster, 5},
      {&kH100, &kH100Fit, ce(64, 128256, true), CePath::SplitCluster, 5},
      {&kH100, &kH100Fit, ce(16, 128256, true), CePath::SplitPhased, 17},  // over 8: partial + merge
      {&kA100, &kNoFit, ce(1, 128256, false), CePath::SplitPhased, 31},
      {&kA100, &kNoFit, ce(8192, 128256, true), CePath::Pipe, 1},
      {&kL4, &kNoFit, ce(64, 32768, false, false), CePath::SplitPhased, 1 + (116 - 1) / 64},
  };
  for (const Row& r : rows) {
    const CePlan p = plan_ce(r.shape, *r.caps, *r.fit);
    SCOPED_TRACE(testing::Message() << "arch " << r.caps->arch << " N " << r.shape.N << " V " << r.shape.V
                                    << " grad " << r.shape.grad);
    EXPECT_EQ(int(p.path), int(r.path)) << kCePaths[int(p.path)];
    if (p.path == CePath::Regs) EXPECT_EQ(p.regs.C, r.splits);
    else EXPECT_EQ(p.splits, r.splits);
  }
  // The register plan of one row on an H100: 16 blocks of 8016 columns, two vectors per thread, 512 threads.
  const CePlan one = plan_ce(ce(1, 128256, false), kH100, kH100Fit);
  EXPECT_EQ(one.regs.R, 2);
  EXPECT_EQ(one.regs.threads, 512);
}

TEST(Plan, LogsumexpPaths) {
  EXPECT_EQ(int(plan_lse(8192, 128256, 2, true, kH100, kH100Fit).path), int(LsePath::Row));
  EXPECT_EQ(int(plan_lse(1, 128256, 2, true, kH100, kH100Fit).path), int(LsePath::Regs));
  EXPECT_EQ(int(plan_lse(1, 128256, 2, false, kH100, kH100Fit).path), int(LsePath::SplitPhased));
  EXPECT_EQ(int(plan_lse(1, 128256, 2, true, kA100, kNoFit).path), int(LsePath::SplitPhased));
  const LsePlan c = plan_lse(64, 32768, 2, false, kH100, kH100Fit);
  EXPECT_EQ(int(c.path), int(LsePath::SplitCluster));
  EXPECT_EQ(c.splits, 5);
}

TEST(Plan, ForcedPaths) {
  {
    Force f("ce:split_phased");
    const CePlan p = plan_ce(ce(8192, 128256, true), kH100, kH100Fit);
    EXPECT_EQ(int(p.path), int(CePath::SplitPhased));
    EXPECT_EQ(p.splits, 4);  // at least 4 blocks per row, for the merge
    EXPECT_EQ(ce_splits(kH100, 8192, 128256), 4);  // the workspace follows
    // Rows of fewer than two 64-column slices have no split: the planner's choice.
    const CePlan narrow = plan_ce(ce(1, 100, false, false), kH100, kH100Fit);
    EXPECT_EQ(int(narrow.path), int(CePath::Row));
    EXPECT_EQ(ce_splits(kH100, 1, 100), 1);
    EXPECT_EQ(ce_splits(kH100, 1, 130), 2);
  }
  {
    Force f("ce:split_cluster");
    EXPECT_EQ(int(plan_ce(ce(8192, 128256, false), kH100, kH100Fit).path), int(CePath::SplitCluster));
    // No clusters on the device: the planner's choice.
    EXPECT_EQ(int(plan_ce(ce(8192, 128256, false), kA100, kNoFit).path), int(CePath::Row));
  }
  {
    Force f("ce:cached");
    EXPECT_EQ(int(plan_ce(ce(8192, 128256, true), kH100, kH100Fit).path), int(CePath::Cached));
    const CePlan few = plan_ce(ce(4, 128256, true), kH100, kH100Fit);  // few rows too
    EXPECT_EQ(int(few.path), int(CePath::Cached));
    EXPECT_EQ(few.splits, 1);
    // A forward has no cached path: the planner's choice.
    EXPECT_EQ(int(plan_ce(ce(8192, 128256, false), kH100, kH100Fit).path), int(CePath::Row));
  }
  {
    Force f("ce:row");
    EXPECT_EQ(int(plan_ce(ce(1, 128256, false), kH100, kH100Fit).path), int(CePath::Row));
  }
  {
    Force f("lse:split_phased,ce:regs");
    EXPECT_EQ(int(plan_lse(8192, 128256, 2, true, kH100, kH100Fit).path), int(LsePath::SplitPhased));
    EXPECT_EQ(lse_splits(kH100, 8192, 128256), 4);
    EXPECT_EQ(int(plan_ce(ce(1, 128256, false), kH100, kH100Fit).path), int(CePath::Regs));
  }
  {
    Force f("ce:nonsense");
    try {
      plan_ce(ce(8, 128, false), kH100, kH100Fit);
      ADD_FAILURE() << "an unknown path was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status, FCE_STATUS_INVALID_ARGUMENT);
      EXPECT_NE(e.message.find("split_phased"), std::string::npos) << e.message;  // lists the paths
    }
  }
  // Unset again: the planner's choice.
  EXPECT_EQ(int(plan_ce(ce(8192, 128256, true), kH100, kH100Fit).path), int(CePath::Pipe));
}

TEST(Plan, RowsPlanner) {
  // Softmax rows of 128256 bf16 on an H100: resident slices in clusters; one long row splits further.
  const RowPlan many = plan_rows(kH100, 8192, 128256, 2, 0, 512);
  EXPECT_TRUE(many.resident);
  EXPECT_EQ(many.C, 4);  // 64 KiB slices at most (the soft limit)
  EXPECT_TRUE(many.cluster);
  const RowPlan one = plan_rows(kH100, 1, 128256, 2, 0, 512);
  EXPECT_EQ(one.C, 8);
  // No clusters: one resident block per row where it fits, else the phased split for few rows.
  const RowPlan a100 = plan_rows(kA100, 8192, 32000, 2, 0, 512);
  EXPECT_TRUE(a100.resident);
  EXPECT_EQ(a100.C, 1);
  const RowPlan a100_few = plan_rows(kA100, 1, 128256, 2, 0, 512);
  EXPECT_TRUE(a100_few.phased);
  EXPECT_EQ(a100_few.C, 31);
  {
    Force f("rows:stream");
    const RowPlan s = plan_rows(kH100, 8192, 128256, 2, 0, 512);
    EXPECT_FALSE(s.resident);
    EXPECT_FALSE(s.phased);
    EXPECT_EQ(s.C, 1);
  }
  {
    Force f("rows:split");
    EXPECT_EQ(plan_rows(kH100, 8192, 128256, 2, 0, 512).C, 4);
  }
}

TEST(Plan, SoftmaxAndKdPaths) {
  SoftmaxShape sm;
  sm.N = 8192;
  sm.V = 128256;
  sm.probs_only = true;
  sm.aligned16 = true;
  EXPECT_EQ(int(plan_softmax(sm, kH100, kH100Fit, kH100Fit, 640).path), int(SoftmaxPath::Smem));
  sm.probs_only = false;  // log-probabilities too: the general kernel
  EXPECT_EQ(int(plan_softmax(sm, kH100, kH100Fit, kH100Fit, 640).path), int(SoftmaxPath::Rows));
  sm.probs_only = true;
  sm.N = 4;
  EXPECT_EQ(int(plan_softmax(sm, kH100, kH100Fit, kH100Fit, 640).path), int(SoftmaxPath::Regs));
  {
    Force f("rows:nocluster");  // a forced rows path turns the lean kernels off
    EXPECT_EQ(int(plan_softmax(sm, kH100, kH100Fit, kH100Fit, 640).path), int(SoftmaxPath::Rows));
  }

  KdShape kd;
  kd.N = 8192;
  kd.V = 128256;
  kd.kl = true;
  EXPECT_EQ(int(plan_kd(kd, kH100, 256).path), int(KdPath::Onepass));
  kd.dstudent = true;
  kd.pipe_layout = true;
  KdPlan p = plan_kd(kd, kH100, 256);
  EXPECT_EQ(int(p.path), int(KdPath::Pipe));
  EXPECT_EQ(p.pipe_blocks, 2);  // a bf16 row pair of 128256 columns is 501 KiB: two blocks
  EXPECT_EQ(plan_kd(kd, kA100, 256).pipe_blocks, 1);  // no clusters
  kd.N = 16;  // rows that do not fill the GPU: the rows planner
  EXPECT_EQ(int(plan_kd(kd, kH100, 256).path), int(KdPath::Rows));
  kd.N = 8192;
  {
    Force f("kd:pipe_c1");
    p = plan_kd(kd, kH100, 256);
    EXPECT_EQ(int(p.path), int(KdPath::Pipe));
    EXPECT_EQ(p.pipe_blocks, 1);
  }
  {
    Force f("kd:rows");
    EXPECT_EQ(int(plan_kd(kd, kH100, 256).path), int(KdPath::Rows));
  }
  kd.topk = kd.renormalized = true;
  EXPECT_EQ(int(plan_kd(kd, kH100, 256).path), int(KdPath::Renorm));
}

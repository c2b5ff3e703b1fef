/*
 * demo_real.c: libfusedce on a real language model's data (docs/demo.md).
 *
 * Reads data/smollm2_kjv_sample.safetensors (SmolLM2-135M-Instruct on KJV Genesis 1:1-6:4, made by
 * tools/fetch-sample.sh, layout in docs/real-input-sample.md), runs the library's forward ops on it and
 * compares every result with the float64 references stored in the file, or with float64 references
 * computed here where the file has none. Prints loss, perplexity, top-1 accuracy, KD divergences, the
 * next-token distribution after the prompt, the largest differences and the wall time of every call.
 *
 * Exit status: 0 all values within the tolerances of docs/demo.md; 1 a value out of tolerance or a
 * library error; 2 bad arguments or a malformed file; 77 the sample file is absent (meson: skipped), or
 * with --device cuda: no CUDA device, or an op that the CUDA backend does not implement yet.
 *
 * Build:
 *   meson (build/examples/demo_real): logits materialized with OpenBLAS (-DFCE_DEMO_BLAS)
 *   cc demo_real.c $(pkg-config --cflags --libs fusedce libcjson)     (plain loop, fewer logit rows)
 *   GPU: add -DFCE_DEMO_CUDA -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcudart
 * Usage: demo_real [--device auto|cpu|cuda] [--rows N] [FILE]
 *   --device  auto (default): the GPU when a CUDA handle can be made and the demo was built with
 *             FCE_DEMO_CUDA, else the CPU. cuda: the GPU or exit 77.
 *   --rows N  tokens for which [N,V] logits are materialized (default: all with BLAS, 64 without).
 *
 * The program needs no libm (-lm is in neither package's flags): exp and log in float64 are written out
 * below (d_exp, d_log); frexp and ldexp come from libc.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cJSON.h>
#include <fusedce/fusedce.h>
#ifdef FCE_DEMO_BLAS
#include <cblas.h>
#endif

#define SAMPLE_DEFAULT "data/smollm2_kjv_sample.safetensors"
#define EXIT_SKIP 77

/* ============================================================================================== */
/* Tolerances (docs/demo.md says why each is what it is)                                           */
/* ============================================================================================== */

/* Cross-entropy statistics (loss, lse, log-probabilities) computed in fp32 from exact inputs, against
 * float64: |d| <= ATOL + RTOL*|ref|. fp32 logits over D = 576 are off by up to ~3e-5 here. */
#define TOL_ATOL 2e-4
#define TOL_RTOL 1e-5
/* KD divergences against float64 from float64 logits: the library gets fp32 logits (error ~4e-5), which a
 * divergence amplifies by up to |log p/q| (~100 on this data). */
#define TOL_KD_ATOL 1e-3
#define TOL_KD_RTOL 1e-5
/* KD divergences against float64 math on the same fp32 logits: the kernel's own rounding only, fp32
 * arithmetic on terms p*log(p/q) whose magnitudes sum to ~100 here. */
#define TOL_KERNEL_ATOL 1e-4
#define TOL_KERNEL_RTOL 1e-5
#define KD_SUB 256
/* Sampling probabilities: |d| <= 1e-7 + 1e-4 * p; log-probabilities like the statistics. */
#define TOL_PROB_ATOL 1e-7
#define TOL_PROB_RTOL 1e-4
/* An argmax may differ from the float64 one only between ids whose float64 logits are this close. */
#define TOL_ARGMAX_TIE 1e-3
/* bf16 hidden against the file's references (computed from the fp32 hidden): the input is rounded, so
 * this bounds an input effect, not kernel error: per token, and on the mean over the passage. */
#define TOL_BF16_TOKEN 0.25
#define TOL_BF16_MEAN 0.01

/* ============================================================================================== */
/* float64 exp and log without libm                                                                */
/* ============================================================================================== */

static const double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;

/* e^x: x = k ln2 + r, |r| <= ln2/2, Taylor series of degree 14 (truncation below 1e-19), times 2^k. */
static double d_exp(double x) {
  if (x != x) return x;
  if (x > 709.8) return INFINITY;
  if (x < -745.2) return 0.0;
  const double kd = x * 1.44269504088896338700;
  const int k = (int)(kd < 0 ? kd - 0.5 : kd + 0.5);
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  /* sum_{n=0}^{14} r^n/n! in nested form: 1 + r(1 + r/2(1 + r/3(... (1 + r/14)))). */
  double s = 1.0;
  for (int n = 14; n >= 1; --n) s = 1.0 + s * r / n;
  return ldexp(s, k);
}

/* ln x: x = m 2^e with m in [sqrt(1/2), sqrt(2)); ln m = 2 atanh(s), s = (m-1)/(m+1), |s| < 0.172. */
static double d_log(double x) {
  if (x != x || x < 0) return NAN;
  if (x == 0) return -INFINITY;
  if (x == INFINITY) return x;
  int e;
  double m = frexp(x, &e); /* m in [0.5, 1) */
  if (m < 0.70710678118654752440) {
    m *= 2;
    e -= 1;
  }
  const double s = (m - 1) / (m + 1), s2 = s * s;
  double t = 0;
  for (int n = 29; n >= 3; n -= 2) t = (t + 1.0 / n) * s2;
  return e * kLn2Hi + (e * kLn2Lo + 2 * s * (1 + t));
}

static double d_abs(double x) { return x < 0 ? -x : x; }

/* ============================================================================================== */
/* Small helpers                                                                                   */
/* ============================================================================================== */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void* xmalloc(size_t n) {
  void* p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "demo_real: out of memory (%zu bytes)\n", n);
    exit(1);
  }
  return p;
}

static float bf16_to_f32(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t f32_to_bf16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* ============================================================================================== */
/* The sample file (safetensors: u64 LE header length, JSON header, raw little-endian data)        */
/* ============================================================================================== */

typedef struct {
  unsigned char* bytes;
  size_t size;
  size_t data_start;
  cJSON* header;
  const char* path;
} Sample;

static void bad_file(const char* path, const char* what) {
  fprintf(stderr, "demo_real: %s: %s\n(regenerate it: bash tools/fetch-sample.sh --force)\n", path, what);
  exit(2);
}

/* Reads the whole file (78 MB) and parses its header. Exits 77 when it does not exist. */
static void sample_load(Sample* s, const char* path) {
  s->path = path;
  FILE* f = fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT) {
      printf("demo_real: the sample file %s does not exist.\n"
             "Make it with `bash tools/fetch-sample.sh` (Debian apt + PyPI, about a minute; see\n"
             "docs/real-input-sample.md), or pass its path as the argument. Skipping.\n",
             path);
      exit(EXIT_SKIP);
    }
    fprintf(stderr, "demo_real: cannot open %s: %s\n", path, strerror(errno));
    exit(2);
  }
  if (fseek(f, 0, SEEK_END) != 0) bad_file(path, "cannot seek");
  const long n = ftell(f);
  if (n < 8) bad_file(path, "shorter than 8 bytes");
  rewind(f);
  s->size = (size_t)n;
  s->bytes = xmalloc(s->size);
  if (fread(s->bytes, 1, s->size, f) != s->size) bad_file(path, "short read");
  fclose(f);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = hlen << 8 | s->bytes[i];
  if (hlen > s->size - 8) bad_file(path, "header length beyond the end of the file");
  s->data_start = 8 + (size_t)hlen;
  s->header = cJSON_ParseWithLength((const char*)s->bytes + 8, (size_t)hlen);
  if (!s->header || !cJSON_IsObject(s->header)) bad_file(path, "the JSON header does not parse");
}

/* A tensor of the file, checked: dtype, rank, bounds, alignment. shape[] receives the extents. */
static const void* sample_tensor(const Sample* s, const char* name, const char* dtype, int ndim, int64_t* shape) {
  char msg[256];
  const cJSON* t = cJSON_GetObjectItemCaseSensitive(s->header, name);
  const cJSON* dt = cJSON_GetObjectItemCaseSensitive(t, "dtype");
  const cJSON* sh = cJSON_GetObjectItemCaseSensitive(t, "shape");
  const cJSON* off = cJSON_GetObjectItemCaseSensitive(t, "data_offsets");
  if (!cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2) {
    snprintf(msg, sizeof msg, "tensor '%s' is missing or malformed", name);
    bad_file(s->path, msg);
  }
  if (strcmp(dt->valuestring, dtype) != 0 || cJSON_GetArraySize(sh) != ndim) {
    snprintf(msg, sizeof msg, "tensor '%s' is %s of rank %d; expected %s of rank %d", name, dt->valuestring,
             cJSON_GetArraySize(sh), dtype, ndim);
    bad_file(s->path, msg);
  }
  size_t elem = !strcmp(dtype, "F64") ? 8 : !strcmp(dtype, "BF16") ? 2 : !strcmp(dtype, "U8") ? 1 : 4;
  double count = 1;
  for (int i = 0; i < ndim; ++i) {
    shape[i] = (int64_t)cJSON_GetArrayItem(sh, i)->valuedouble;
    count *= (double)shape[i];
  }
  const double a = cJSON_GetArrayItem(off, 0)->valuedouble, b = cJSON_GetArrayItem(off, 1)->valuedouble;
  if (a < 0 || b - a != count * (double)elem || s->data_start + b > (double)s->size || (size_t)a % elem) {
    snprintf(msg, sizeof msg, "tensor '%s' has bad data_offsets", name);
    bad_file(s->path, msg);
  }
  return s->bytes + s->data_start + (size_t)a;
}

static const char* sample_meta(const Sample* s, const char* key) {
  const cJSON* m = cJSON_GetObjectItemCaseSensitive(s->header, "__metadata__");
  const cJSON* v = cJSON_GetObjectItemCaseSensitive(m, key);
  return cJSON_IsString(v) ? v->valuestring : "?";
}

/* ============================================================================================== */
/* Device memory: the only CUDA-specific piece (compiled with -DFCE_DEMO_CUDA, linked with cudart) */
/* ============================================================================================== */

#ifdef FCE_DEMO_CUDA
#include <cuda_runtime_api.h>
#define DEMO_HAS_CUDA 1
static void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "demo_real: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
  }
}
static void* dev_alloc(size_t n) {
  void* p = NULL;
  cuda_check(cudaMalloc(&p, n ? n : 1), "cudaMalloc");
  return p;
}
static void dev_free(void* p) { cudaFree(p); }
static void dev_upload(void* d, const void* h, size_t n) { cuda_check(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), "cudaMemcpy H2D"); }
static void dev_download(void* h, const void* d, size_t n) { cuda_check(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H"); }
static void dev_sync(void) { cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
#else
/* CPU-only build: never called, since no CUDA handle is used. */
#define DEMO_HAS_CUDA 0
static void* dev_alloc(size_t n) { (void)n; abort(); }
static void dev_free(void* p) { (void)p; }
static void dev_upload(void* d, const void* h, size_t n) { (void)d, (void)h, (void)n; abort(); }
static void dev_download(void* h, const void* d, size_t n) { (void)d, (void)h, (void)n; abort(); }
static void dev_sync(void) {}
#endif

/* ============================================================================================== */
/* Tensors and the op runner                                                                       */
/* ============================================================================================== */

/* A DLTensor with its host copy, and a device copy on the GPU path (inputs uploaded once). */
typedef struct {
  DLTensor t;
  int64_t shape[2];
  void* host;
  size_t bytes;
  void* dev;
  int output;
  int uploaded;
} Buf;

static const DLDataType kF32 = {kDLFloat, 32, 1}, kBF16 = {kDLBfloat, 16, 1}, kI32 = {kDLInt, 32, 1};

#define MAX_BUFS 64
static Buf* g_bufs[MAX_BUFS];
static int g_nbufs;

/* ndim 0 is a scalar. */
static Buf* buf_new(const void* host, DLDataType dt, int ndim, int64_t n0, int64_t n1, int output) {
  Buf* b = calloc(1, sizeof *b);
  if (!b || g_nbufs == MAX_BUFS) abort();
  g_bufs[g_nbufs++] = b;
  b->shape[0] = n0;
  b->shape[1] = n1;
  b->t.ndim = ndim;
  b->t.shape = b->shape;
  b->t.dtype = dt;
  b->host = (void*)host;
  b->bytes = (size_t)(dt.bits / 8) * (ndim > 0 ? (size_t)n0 : 1) * (ndim > 1 ? (size_t)n1 : 1);
  b->output = output;
  return b;
}

static void buf_place(Buf* b, int on_gpu) {
  if (on_gpu) {
    if (!b->dev) b->dev = dev_alloc(b->bytes);
    if (!b->output && !b->uploaded) dev_upload(b->dev, b->host, b->bytes), b->uploaded = 1;
    b->t.data = b->dev;
    b->t.device.device_type = kDLCUDA;
  } else {
    b->t.data = b->host;
    b->t.device.device_type = kDLCPU;
  }
  b->t.device.device_id = 0;
}

static void bufs_free(void) {
  for (int i = 0; i < g_nbufs; ++i) {
    if (g_bufs[i]->dev) dev_free(g_bufs[i]->dev);
    free(g_bufs[i]);
  }
  g_nbufs = 0;
}

typedef struct {
  fce_handle_t cpu, gpu; /* gpu NULL on the CPU path */
  int require_gpu;
  int fell_back; /* ops the CUDA backend does not implement, run on the CPU instead */
} Devices;
static Devices g_dev;

typedef fce_status_t (*OpFn)(fce_handle_t h, void* args);

typedef struct {
  char label[96];
  const char* device;
  double ms;
  double work; /* flops or bytes, for the rate column */
  int is_flops;
} Timing;
static Timing g_times[64];
static int g_ntimes;

static void record_time(const char* label, const char* device, double ms, double work, int is_flops) {
  if (g_ntimes == 64) return;
  Timing* t = &g_times[g_ntimes++];
  snprintf(t->label, sizeof t->label, "%s", label);
  t->device = device;
  t->ms = ms;
  t->work = work;
  t->is_flops = is_flops;
}

static void die_status(const char* label, fce_status_t st) {
  fprintf(stderr, "demo_real: %s failed: %s: %s\n", label, fce_status_string(st), fce_last_error_message());
  exit(1);
}

/* Runs one call on the GPU when there is one (a warm-up call, then the mean of 3 timed calls, outputs
 * copied back), else once on the CPU; an op the CUDA backend does not implement runs on the CPU. */
static double run_op(const char* label, OpFn fn, void* args, Buf** bufs, int n, double work, int is_flops) {
  fce_status_t st;
  if (g_dev.gpu) {
    for (int i = 0; i < n; ++i) buf_place(bufs[i], 1);
    st = fn(g_dev.gpu, args);
    dev_sync();
    if (st == FCE_STATUS_SUCCESS) {
      const int reps = 3;
      const double t0 = now_ms();
      for (int r = 0; r < reps && st == FCE_STATUS_SUCCESS; ++r) st = fn(g_dev.gpu, args);
      dev_sync();
      const double ms = (now_ms() - t0) / reps;
      if (st != FCE_STATUS_SUCCESS) die_status(label, st);
      for (int i = 0; i < n; ++i)
        if (bufs[i]->output) dev_download(bufs[i]->host, bufs[i]->dev, bufs[i]->bytes);
      record_time(label, "cuda", ms, work, is_flops);
      return ms;
    }
    if (st != FCE_STATUS_NOT_IMPLEMENTED) die_status(label, st);
    printf("    [%s: %s on CUDA; run on the CPU instead]\n", label, fce_status_string(st));
    g_dev.fell_back++;
  }
  for (int i = 0; i < n; ++i) buf_place(bufs[i], 0);
  const double t0 = now_ms();
  st = fn(g_dev.cpu, args);
  const double ms = now_ms() - t0;
  if (st != FCE_STATUS_SUCCESS) die_status(label, st);
  record_time(label, "cpu", ms, work, is_flops);
  return ms;
}

/* --- the calls ------------------------------------------------------------------------------------ */

typedef struct {
  Buf *hidden, *weight, *targets, *loss, *lse, *argmax;
  int32_t reduction;
} LceArgs;

static fce_status_t op_linear_ce(fce_handle_t h, void* p) {
  const LceArgs* a = p;
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = a->reduction;
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = &a->loss->t;
  out.lse = a->lse ? &a->lse->t : NULL;
  out.argmax = a->argmax ? &a->argmax->t : NULL;
  return fce_linear_cross_entropy_fwd(h, NULL, &a->hidden->t, &a->weight->t, NULL, &a->targets->t, &o, &out, NULL, 0);
}

typedef struct {
  Buf *logits, *targets, *loss, *lse, *argmax;
  int32_t reduction;
} CeArgs;

static fce_status_t op_ce(fce_handle_t h, void* p) {
  const CeArgs* a = p;
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = a->reduction;
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = &a->loss->t;
  out.lse = a->lse ? &a->lse->t : NULL;
  out.argmax = a->argmax ? &a->argmax->t : NULL;
  return fce_cross_entropy_fwd(h, NULL, &a->logits->t, &a->targets->t, &o, &out, NULL, 0);
}

typedef struct {
  Buf *student, *teacher, *topk_ids, *topk_lp, *loss;
  int32_t divergence, reduction, topk_norm;
} KdArgs;

static fce_status_t op_kd(fce_handle_t h, void* p) {
  const KdArgs* a = p;
  fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
  o.divergence = a->divergence;
  o.beta = 0.5f;
  o.reduction = a->reduction;
  o.topk_norm = a->topk_norm;
  fce_kd_teacher_t t = FCE_KD_TEACHER_INIT;
  if (a->teacher) {
    t.logits = &a->teacher->t;
  } else {
    t.topk_ids = &a->topk_ids->t;
    t.topk_logprobs = &a->topk_lp->t;
  }
  fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
  out.loss = &a->loss->t;
  return fce_kd_loss(h, NULL, &a->student->t, &t, NULL, &o, &out, NULL, 0);
}

typedef struct {
  Buf *logits, *probs, *logprobs;
  float temperature;
} SoftmaxArgs;

static fce_status_t op_softmax(fce_handle_t h, void* p) {
  const SoftmaxArgs* a = p;
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  o.temperature = a->temperature;
  return fce_temp_softmax(h, NULL, &a->logits->t, &o, &a->probs->t, &a->logprobs->t, NULL, 0);
}

/* ============================================================================================== */
/* Checks against references                                                                       */
/* ============================================================================================== */

static int g_checks, g_failed;

static void report(const char* what, double maxdiff, const char* where, const char* tol, int ok) {
  ++g_checks;
  if (!ok) ++g_failed;
  printf("    %-46s max |d| %-9.2e %-12s tol %-18s %s\n", what, maxdiff, where, tol, ok ? "ok" : "FAILED");
}

/* got (fp32) against ref (float64) over n values: |got - ref| <= atol + rtol |ref| everywhere. */
static double check_vec_at(const char* what, const float* got, const double* ref, int64_t n, double atol, double rtol,
                           const char* index_name) {
  double worst = 0, maxd = 0;
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = d_abs((double)got[i] - ref[i]);
    const double r = d / (atol + rtol * d_abs(ref[i]));
    if (!(r <= worst)) { /* also catches NaN */
      worst = r;
      at = i;
    }
    if (d > maxd || d != d) maxd = d;
  }
  char where[32], tol[32];
  snprintf(where, sizeof where, "(%s %lld)", index_name, (long long)at);
  snprintf(tol, sizeof tol, "%.0e+%.0e|ref|", atol, rtol);
  report(what, maxd, where, tol, worst <= 1.0);
  return maxd;
}

static double check_vec(const char* what, const float* got, const double* ref, int64_t n, double atol, double rtol) {
  return check_vec_at(what, got, ref, n, atol, rtol, "row");
}

static void check_scalar(const char* what, double got, double ref, double atol, double rtol) {
  const double d = d_abs(got - ref);
  char tol[32];
  snprintf(tol, sizeof tol, "%.0e+%.0e|ref|", atol, rtol);
  report(what, d, "", tol, d <= atol + rtol * d_abs(ref));
}

static double mean_f64(const double* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s / (double)n;
}

/* float64 dot product of an fp32 row and a bf16 row (both widened exactly). */
static double dot64(const float* h, const uint16_t* w, int64_t D) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t k = 0;
  for (; k + 4 <= D; k += 4) {
    s0 += (double)h[k] * bf16_to_f32(w[k]);
    s1 += (double)h[k + 1] * bf16_to_f32(w[k + 1]);
    s2 += (double)h[k + 2] * bf16_to_f32(w[k + 2]);
    s3 += (double)h[k + 3] * bf16_to_f32(w[k + 3]);
  }
  for (; k < D; ++k) s0 += (double)h[k] * bf16_to_f32(w[k]);
  return (s0 + s1) + (s2 + s3);
}

/* float64 log-sum-exp of n values. */
static double lse64(const double* x, int64_t n) {
  double m = -INFINITY, s = 0;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] > m) m = x[i];
  for (int64_t i = 0; i < n; ++i) s += d_exp(x[i] - m);
  return m + d_log(s);
}

static double lse64f(const float* x, int64_t n) {
  double m = -INFINITY, s = 0;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] > m) m = x[i];
  for (int64_t i = 0; i < n; ++i) s += d_exp(x[i] - m);
  return m + d_log(s);
}

/* Forward KL(P||Q), reverse KL(Q||P), JSD(0.5) in float64 of one row, P = softmax(zt), Q = softmax(zs). */
static void kd_full_f64(const float* zs, const float* zt, int64_t V, double out[3]) {
  const double ls = lse64f(zs, V), lt = lse64f(zt, V);
  double f = 0, r = 0, j = 0;
  for (int64_t v = 0; v < V; ++v) {
    const double logp = zt[v] - lt, logq = zs[v] - ls, p = d_exp(logp), q = d_exp(logq), m = 0.5 * p + 0.5 * q;
    f += p * (logp - logq);
    r += q * (logq - logp);
    if (m > 0) {
      const double logm = d_log(m);
      j += 0.5 * p * (logp - logm) + 0.5 * q * (logq - logm);
    }
  }
  out[0] = f, out[1] = r, out[2] = j;
}

/* The same for a top-K teacher (P = softmax over its K log-probs lp), student logits zs at the K ids and
 * the student's lse over the full vocabulary: terms summed over the K ids (the header's definition);
 * out[3] = forward KL with the student renormalized over the K. */
static void kd_topk_f64(const double* zs, double lse_s, const float* lp, int64_t K, double out[4]) {
  double lpd[256] = {0};
  for (int64_t k = 0; k < K; ++k) lpd[k] = lp[k];
  const double lse_t = lse64(lpd, K), lse_k = lse64(zs, K);
  double f = 0, r = 0, j = 0, fr = 0;
  for (int64_t k = 0; k < K; ++k) {
    const double logp = lpd[k] - lse_t, logq = zs[k] - lse_s, p = d_exp(logp), q = d_exp(logq), m = 0.5 * p + 0.5 * q;
    f += p * (logp - logq);
    r += q * (logq - logp);
    if (m > 0) {
      const double logm = d_log(m);
      j += 0.5 * p * (logp - logm) + 0.5 * q * (logq - logm);
    }
    fr += p * (logp - (zs[k] - lse_k));
  }
  out[0] = f, out[1] = r, out[2] = j, out[3] = fr;
}

/* Argmax agreement: a disagreement passes only if the float64 logits of the two ids are within
 * TOL_ARGMAX_TIE (a near tie that fp32 rounding may order either way). */
static void check_argmax(const char* what, const int32_t* got, const int32_t* ref, int64_t n, const float* hidden,
                         const uint16_t* W, int64_t D) {
  int64_t differ = 0, worst_at = 0;
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (got[i] == ref[i]) continue;
    ++differ;
    const double gap = dot64(hidden + i * D, W + (int64_t)ref[i] * D, D) - dot64(hidden + i * D, W + (int64_t)got[i] * D, D);
    if (!(gap <= worst)) {
      worst = gap;
      worst_at = i;
    }
  }
  char name[96], where[32], tol[32];
  snprintf(name, sizeof name, "%s: %lld/%lld agree", what, (long long)(n - differ), (long long)n);
  snprintf(where, sizeof where, differ ? "(row %lld)" : "", (long long)worst_at);
  snprintf(tol, sizeof tol, "tie <= %.0e", TOL_ARGMAX_TIE);
  report(name, worst, where, tol, worst <= TOL_ARGMAX_TIE);
}

/* ============================================================================================== */
/* Materialized logits [rows, V] in fp32 (the library has no GEMM entry point)                     */
/* ============================================================================================== */

static void logits_f32(const float* h, int64_t rows, const float* W, int64_t V, int64_t D, float* out) {
#ifdef FCE_DEMO_BLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)V, (int)D, 1.f, h, (int)D, W, (int)D, 0.f, out,
              (int)V);
#else
  /* Plain loop, 4 rows per pass over the weight; fp32 accumulation like an sgemm. */
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const int64_t nr = rows - r0 < 4 ? rows - r0 : 4;
    for (int64_t v = 0; v < V; ++v) {
      const float* w = W + v * D;
      for (int64_t r = 0; r < nr; ++r) {
        const float* x = h + (r0 + r) * D;
        float s = 0.f;
        for (int64_t k = 0; k < D; ++k) s += x[k] * w[k];
        out[(r0 + r) * V + v] = s;
      }
    }
  }
#endif
}

/* ============================================================================================== */
/* Printing tokens                                                                                 */
/* ============================================================================================== */

typedef struct {
  const unsigned char* blob;
  const int32_t* off;
  int64_t V;
} Vocab;

/* Prints raw token bytes: printable ASCII as is, \n \t, valid UTF-8 sequences as is, other bytes \xNN. */
static void print_bytes(const unsigned char* p, int64_t n) {
  for (int64_t i = 0; i < n;) {
    const unsigned c = p[i];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    int ok = len > 1 && i + len <= n;
    for (int k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xc0) == 0x80;
    if (c == '\n') fputs("\\n", stdout);
    else if (c == '\t') fputs("\\t", stdout);
    else if (c == '"' || c == '\\') printf("\\%c", c);
    else if (c >= 0x20 && c < 0x7f) putchar((int)c);
    else if (ok) {
      fwrite(p + i, 1, (size_t)len, stdout);
      i += len;
      continue;
    } else printf("\\x%02x", c);
    ++i;
  }
}

static void print_token(const Vocab* voc, int64_t id) {
  putchar('"');
  if (id >= 0 && id < voc->V) print_bytes(voc->blob + voc->off[id], voc->off[id + 1] - voc->off[id] - 1);
  putchar('"');
}

/* ids of the k largest values of x[0..n) (descending, lowest id first on ties). */
static void top_k(const float* x, int64_t n, int k, int64_t* ids) {
  for (int j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
      int taken = 0;
      for (int q = 0; q < j; ++q) taken |= ids[q] == i;
      if (!taken && (best < 0 || x[i] > x[best])) best = i;
    }
    ids[j] = best;
  }
}

/* ============================================================================================== */
/* main                                                                                            */
/* ============================================================================================== */

static void usage(void) {
  fprintf(stderr, "usage: demo_real [--device auto|cpu|cuda] [--rows N] [FILE (default %s)]\n", SAMPLE_DEFAULT);
  exit(2);
}

static void open_devices(const char* want) {
  fce_status_t st = fce_handle_create(kDLCPU, 0, &g_dev.cpu);
  if (st != FCE_STATUS_SUCCESS) die_status("fce_handle_create(kDLCPU)", st);
  if (!strcmp(want, "cpu")) {
    printf("device: CPU (--device cpu)\n");
    return;
  }
  g_dev.require_gpu = !strcmp(want, "cuda");
  fce_handle_t gpu = NULL;
  st = fce_handle_create(kDLCUDA, 0, &gpu);
  if (st != FCE_STATUS_SUCCESS) {
    printf("device: CPU (no CUDA handle: %s: %s)\n", fce_status_string(st), fce_last_error_message());
    if (g_dev.require_gpu) {
      printf("--device cuda: skipping\n");
      exit(EXIT_SKIP);
    }
    return;
  }
  if (!DEMO_HAS_CUDA) {
    fce_handle_destroy(gpu);
    printf("device: CPU (a CUDA device exists, but this demo was built without -DFCE_DEMO_CUDA and cannot copy\n"
           "        inputs to it; rebuild with -DFCE_DEMO_CUDA and cudart to run there)\n");
    if (g_dev.require_gpu) exit(EXIT_SKIP);
    return;
  }
  g_dev.gpu = gpu;
  printf("device: CUDA device 0 (timings: mean of 3 calls after a warm-up; inputs uploaded once)\n");
}

int main(int argc, char** argv) {
  const char* path = SAMPLE_DEFAULT;
  const char* device = "auto";
  int64_t rows_opt = -1;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
    else if (!strncmp(argv[i], "--device=", 9)) device = argv[i] + 9;
    else if (!strcmp(argv[i], "--rows") && i + 1 < argc) rows_opt = atoll(argv[++i]);
    else if (!strncmp(argv[i], "--rows=", 7)) rows_opt = atoll(argv[i] + 7);
    else if (argv[i][0] == '-') usage();
    else path = argv[i];
  }
  if (strcmp(device, "auto") && strcmp(device, "cpu") && strcmp(device, "cuda")) usage();
  const double t_start = now_ms();

  printf("libfusedce %s (ABI %u) on real data: %s\n", fce_version_string(), fce_abi_version(), path);
  if (fce_version_number() != FCE_VERSION_NUMBER)
    printf("  note: header %d.%d.%d, loaded library %s\n", FCE_VERSION_MAJOR, FCE_VERSION_MINOR, FCE_VERSION_PATCH,
           fce_version_string());
  fce_build_info_t info = FCE_BUILD_INFO_INIT;
  if (fce_build_info(&info) == FCE_STATUS_SUCCESS) {
    if (info.cuda_backend)
      printf("  built with CUDA %d.%d, cuBLAS %d, GPU code: %s\n", info.cuda_runtime_version / 1000,
             info.cuda_runtime_version % 1000 / 10, info.cublas_version, info.cuda_architectures);
    else
      printf("  built without the CUDA backend\n");
  }

  /* ---- load ---------------------------------------------------------------------------------- */
  Sample s;
  double t0 = now_ms();
  sample_load(&s, path);
  int64_t sh[2], sh2[2];
  const uint16_t* W = sample_tensor(&s, "lm_head", "BF16", 2, sh);
  const int64_t V = sh[0], D = sh[1];
  const float* hidden = sample_tensor(&s, "hidden", "F32", 2, sh);
  const int64_t T = sh[0];
  const float* student_hidden = sample_tensor(&s, "student_hidden", "F32", 2, sh2);
  if (sh[1] != D || sh2[0] != T || sh2[1] != D) bad_file(path, "hidden / student_hidden shapes disagree with lm_head");
  const int32_t* targets = sample_tensor(&s, "targets", "I32", 1, sh);
  if (sh[0] != T) bad_file(path, "targets has the wrong length");
  const double* ref_loss = sample_tensor(&s, "ref_loss", "F64", 1, sh);
  const double* ref_lse = sample_tensor(&s, "ref_lse", "F64", 1, sh);
  const double* ref_student_lse = sample_tensor(&s, "ref_student_lse", "F64", 1, sh);
  const double* ref_kl_fwd = sample_tensor(&s, "ref_kl_fwd", "F64", 1, sh);
  const double* ref_kl_rev = sample_tensor(&s, "ref_kl_rev", "F64", 1, sh);
  const double* ref_jsd = sample_tensor(&s, "ref_jsd", "F64", 1, sh);
  const int32_t* ref_argmax = sample_tensor(&s, "ref_argmax", "I32", 1, sh);
  const int32_t* topk_ids = sample_tensor(&s, "teacher_topk_ids", "I32", 2, sh);
  const int64_t K = sh[1];
  const float* topk_lp = sample_tensor(&s, "teacher_topk_logprobs", "F32", 2, sh2);
  if (sh[0] != T || sh2[0] != T || sh2[1] != K || K > 256) bad_file(path, "teacher_topk_* shapes");
  const int32_t* prompt_ids = sample_tensor(&s, "prompt_ids", "I32", 1, sh);
  const int64_t P = sh[0];
  Vocab voc;
  voc.off = sample_tensor(&s, "vocab_offsets", "I32", 1, sh);
  if (sh[0] != V + 1) bad_file(path, "vocab_offsets has the wrong length");
  voc.blob = sample_tensor(&s, "vocab_blob", "U8", 1, sh);
  voc.V = V;
  for (int64_t i = 0; i < V; ++i)
    if (voc.off[i] < 0 || voc.off[i + 1] <= voc.off[i] || voc.off[i + 1] > sh[0]) bad_file(path, "vocab_offsets");
  for (int64_t i = 0; i < T; ++i)
    if (targets[i] < 0 || targets[i] >= V) bad_file(path, "a target is outside [0, V)");
  if (P < 1 || P > T) bad_file(path, "prompt_ids");
  printf("model %s, text %s\n", sample_meta(&s, "model"), sample_meta(&s, "passage"));
  printf("T=%lld tokens, V=%lld, D=%lld, K=%lld, prompt %lld tokens; loaded in %.0f ms\n", (long long)T, (long long)V,
         (long long)D, (long long)K, (long long)P, now_ms() - t0);

  open_devices(device);

#ifdef FCE_DEMO_BLAS
  const int64_t rows_default = T;
  const char* gemm_name = "OpenBLAS cblas_sgemm";
#else
  const int64_t rows_default = 64;
  const char* gemm_name = "a plain C loop (built without -DFCE_DEMO_BLAS)";
#endif
  int64_t R = rows_opt > 0 ? rows_opt : rows_default; /* rows with materialized logits */
  if (R > T) R = T;
  if (R < P) R = P;

  printf("\nprompt: \"");
  for (int64_t i = 0; i < P; ++i) print_bytes(voc.blob + voc.off[prompt_ids[i]], voc.off[prompt_ids[i] + 1] - voc.off[prompt_ids[i]] - 1);
  printf("\"\n");

  /* lm_head widened to fp32 (exact) and the hidden states rounded to bf16, for the two dtype choices. */
  t0 = now_ms();
  float* W32 = xmalloc((size_t)(V * D) * 4);
  for (int64_t i = 0; i < V * D; ++i) W32[i] = bf16_to_f32(W[i]);
  uint16_t* hidden16 = xmalloc((size_t)(T * D) * 2);
  for (int64_t i = 0; i < T * D; ++i) hidden16[i] = f32_to_bf16(hidden[i]);
  printf("lm_head bf16 -> fp32 and hidden fp32 -> bf16 in %.0f ms\n", now_ms() - t0);

  const double lce_flops = 2.0 * (double)T * (double)D * (double)V;
  float* loss = xmalloc((size_t)T * 4);
  float* lse = xmalloc((size_t)T * 4);
  int32_t* amax = xmalloc((size_t)T * 4);
  float mean_loss = 0;

  /* ---- 1. linear cross-entropy, fp32 ----------------------------------------------------------- */
  printf("\n[1] fce_linear_cross_entropy_fwd: hidden [%lld,%lld] x lm_head^T [%lld,%lld], no logits held\n",
         (long long)T, (long long)D, (long long)D, (long long)V);
  printf("  fp32 (lm_head bf16 -> fp32 exactly: the references' own inputs)\n");
  {
    Buf* bh = buf_new(hidden, kF32, 2, T, D, 0);
    Buf* bw = buf_new(W32, kF32, 2, V, D, 0);
    Buf* bt = buf_new(targets, kI32, 1, T, 0, 0);
    Buf* bl = buf_new(loss, kF32, 1, T, 0, 1);
    Buf* bs = buf_new(lse, kF32, 1, T, 0, 1);
    Buf* ba = buf_new(amax, kI32, 1, T, 0, 1);
    Buf* bm = buf_new(&mean_loss, kF32, 0, 0, 0, 1);
    LceArgs a = {bh, bw, bt, bl, bs, ba, FCE_REDUCTION_NONE};
    Buf* l1[] = {bh, bw, bt, bl, bs, ba};
    const double ms = run_op("linear CE fp32, none + lse + argmax", op_linear_ce, &a, l1, 6, lce_flops, 1);
    LceArgs m = {bh, bw, bt, bm, NULL, NULL, FCE_REDUCTION_MEAN};
    Buf* l2[] = {bh, bw, bt, bm};
    const double ms2 = run_op("linear CE fp32, mean", op_linear_ce, &m, l2, 4, lce_flops, 1);
    int64_t hits = 0;
    for (int64_t i = 0; i < T; ++i) hits += amax[i] == targets[i];
    const double ref_mean = mean_f64(ref_loss, T);
    printf("    mean loss %.6f nats, perplexity %.4f, top-1 accuracy %.4f (%lld/%lld)   [%.0f ms, %.0f ms]\n",
           mean_loss, d_exp(mean_loss), (double)hits / (double)T, (long long)hits, (long long)T, ms, ms2);
    printf("    file: mean loss %s, perplexity %s, top-1 accuracy %s\n", sample_meta(&s, "mean_loss"),
           sample_meta(&s, "perplexity"), sample_meta(&s, "top1_accuracy"));
    check_vec("loss (none) vs ref_loss", loss, ref_loss, T, TOL_ATOL, TOL_RTOL);
    check_vec("lse vs ref_lse", lse, ref_lse, T, TOL_ATOL, TOL_RTOL);
    check_scalar("loss (mean) vs mean(ref_loss)", mean_loss, ref_mean, TOL_ATOL, TOL_RTOL);
    check_argmax("argmax vs ref_argmax", amax, ref_argmax, T, hidden, W, D);
  }

  /* ---- 1b. linear cross-entropy, bf16 ------------------------------------------------------------ */
  printf("  bf16 (hidden rounded to bf16, lm_head as stored: the dtypes must match)\n");
  {
    float* loss16 = xmalloc((size_t)T * 4);
    float* lse16 = xmalloc((size_t)T * 4);
    int32_t* amax16 = xmalloc((size_t)T * 4);
    float mean16 = 0;
    Buf* bh = buf_new(hidden16, kBF16, 2, T, D, 0);
    Buf* bw = buf_new(W, kBF16, 2, V, D, 0);
    Buf* bt = buf_new(targets, kI32, 1, T, 0, 0);
    Buf* bl = buf_new(loss16, kF32, 1, T, 0, 1);
    Buf* bs = buf_new(lse16, kF32, 1, T, 0, 1);
    Buf* ba = buf_new(amax16, kI32, 1, T, 0, 1);
    Buf* bm = buf_new(&mean16, kF32, 0, 0, 0, 1);
    LceArgs a = {bh, bw, bt, bl, bs, ba, FCE_REDUCTION_NONE};
    Buf* l1[] = {bh, bw, bt, bl, bs, ba};
    const double ms = run_op("linear CE bf16, none + lse + argmax", op_linear_ce, &a, l1, 6, lce_flops, 1);
    LceArgs m = {bh, bw, bt, bm, NULL, NULL, FCE_REDUCTION_MEAN};
    Buf* l2[] = {bh, bw, bt, bm};
    const double ms2 = run_op("linear CE bf16, mean", op_linear_ce, &m, l2, 4, lce_flops, 1);
    int64_t hits = 0;
    for (int64_t i = 0; i < T; ++i) hits += amax16[i] == targets[i];
    printf("    mean loss %.6f nats, perplexity %.4f, top-1 accuracy %.4f   [%.0f ms, %.0f ms]\n", mean16,
           d_exp(mean16), (double)hits / (double)T, ms, ms2);

    /* Own float64 reference for the rounded inputs, on S evenly spaced rows. */
    enum { S = 32 };
    float got_l[S], got_s[S];
    double rl[S], rs[S];
    int32_t got_a[S], ra[S];
    float hrow[S][1024];
    if (D > 1024) bad_file(path, "D > 1024");
    double* z = xmalloc((size_t)V * 8);
    double zmax_abs = 0;
    t0 = now_ms();
    for (int i = 0; i < S; ++i) {
      const int64_t t = i * (T / S) + (T / S) / 2;
      for (int64_t k = 0; k < D; ++k) hrow[i][k] = bf16_to_f32(hidden16[t * D + k]);
      int64_t best = 0;
      for (int64_t v = 0; v < V; ++v) {
        /* The header's contract: logits of bf16 inputs are rounded to bf16 (as torch's linear). */
        z[v] = bf16_to_f32(f32_to_bf16((float)dot64(hrow[i], W + v * D, D)));
        if (d_abs(z[v]) > zmax_abs) zmax_abs = d_abs(z[v]);
        if (z[v] > z[best]) best = v;
      }
      rs[i] = lse64(z, V);
      rl[i] = rs[i] - z[targets[t]];
      ra[i] = (int32_t)best;
      got_l[i] = loss16[t];
      got_s[i] = lse16[t];
      got_a[i] = amax16[t];
    }
    free(z);
    const double ref_ms = now_ms() - t0;
    double d_tok = 0;
    for (int64_t i = 0; i < T; ++i)
      if (!(d_abs(loss16[i] - ref_loss[i]) <= d_tok)) d_tok = d_abs(loss16[i] - ref_loss[i]);
    printf("    float64 reference for the bf16-rounded hidden on %d evenly spaced rows (%.0f ms):\n", S, ref_ms);
    /* The library rounds an fp32 GEMM's logits to bf16, the reference a float64 dot: near a rounding
       boundary the two land one bf16 ulp apart (|z|/256), which moves a loss or lse by up to that much. */
    check_vec("loss (none) vs own float64, bf16 inputs", got_l, rl, S, TOL_ATOL + zmax_abs / 256, TOL_RTOL);
    check_vec("lse vs own float64, bf16 inputs", got_s, rs, S, TOL_ATOL + zmax_abs / 256, TOL_RTOL);
    {
      /* argmax against own reference: same near-tie rule, logits from the rounded hidden rows. */
      int differ = 0;
      double worst = 0;
      for (int i = 0; i < S; ++i)
        if (got_a[i] != ra[i]) {
          ++differ;
          const double gap = dot64(hrow[i], W + (int64_t)ra[i] * D, D) - dot64(hrow[i], W + (int64_t)got_a[i] * D, D);
          if (!(gap <= worst)) worst = gap;
        }
      char name[96], tol[32];
      snprintf(name, sizeof name, "argmax vs own float64: %d/%d agree", S - differ, S);
      snprintf(tol, sizeof tol, "tie <= %.0e", TOL_ARGMAX_TIE);
      report(name, worst, "", tol, worst <= TOL_ARGMAX_TIE);
    }
    printf("    against the file's references (fp32 hidden): the effect of rounding the input\n");
    {
      char tol[32];
      snprintf(tol, sizeof tol, "%.2g", TOL_BF16_TOKEN);
      report("loss (none) vs ref_loss, per token", d_tok, "", tol, d_tok <= TOL_BF16_TOKEN);
      snprintf(tol, sizeof tol, "%.2g", TOL_BF16_MEAN);
      const double dm = d_abs(mean16 - mean_f64(ref_loss, T));
      report("loss (mean) vs mean(ref_loss)", dm, "", tol, dm <= TOL_BF16_MEAN);
    }
    free(loss16), free(lse16), free(amax16);
  }

  /* ---- materialized logits ------------------------------------------------------------------------ */
  printf("\n    materializing fp32 logits for %lld of %lld tokens with %s ...\n", (long long)R, (long long)T, gemm_name);
  float* tlog = xmalloc((size_t)(R * V) * 4);
  float* slog = xmalloc((size_t)(R * V) * 4);
  t0 = now_ms();
  logits_f32(hidden, R, W32, V, D, tlog);
  const double gemm_t = now_ms() - t0;
  t0 = now_ms();
  logits_f32(student_hidden, R, W32, V, D, slog);
  const double gemm_s = now_ms() - t0;
  record_time("teacher logits (demo's sgemm)", "cpu", gemm_t, 2.0 * R * D * V, 1);
  record_time("student logits (demo's sgemm)", "cpu", gemm_s, 2.0 * R * D * V, 1);
  printf("    teacher [%lld,%lld] in %.0f ms, student in %.0f ms (%.1f GFLOP each)\n", (long long)R, (long long)V, gemm_t,
         gemm_s, 2e-9 * R * D * V);
  const double logit_bytes = 4.0 * (double)R * (double)V;

  /* ---- 2. cross-entropy on materialized logits --------------------------------------------------- */
  printf("\n[2] fce_cross_entropy_fwd on materialized fp32 logits [%lld,%lld]\n", (long long)R, (long long)V);
  {
    Buf* bx = buf_new(tlog, kF32, 2, R, V, 0);
    Buf* bt = buf_new(targets, kI32, 1, R, 0, 0);
    Buf* bl = buf_new(loss, kF32, 1, R, 0, 1);
    Buf* bs = buf_new(lse, kF32, 1, R, 0, 1);
    Buf* ba = buf_new(amax, kI32, 1, R, 0, 1);
    Buf* bm = buf_new(&mean_loss, kF32, 0, 0, 0, 1);
    CeArgs a = {bx, bt, bl, bs, ba, FCE_REDUCTION_NONE};
    Buf* l1[] = {bx, bt, bl, bs, ba};
    const double ms = run_op("CE, none + lse + argmax", op_ce, &a, l1, 5, logit_bytes, 0);
    CeArgs m = {bx, bt, bm, NULL, NULL, FCE_REDUCTION_MEAN};
    Buf* l2[] = {bx, bt, bm};
    const double ms2 = run_op("CE, mean", op_ce, &m, l2, 3, logit_bytes, 0);
    int64_t hits = 0;
    for (int64_t i = 0; i < R; ++i) hits += amax[i] == targets[i];
    printf("    mean loss %.6f nats, perplexity %.4f, top-1 accuracy %.4f over %lld tokens   [%.0f ms, %.0f ms]\n",
           mean_loss, d_exp(mean_loss), (double)hits / (double)R, (long long)R, ms, ms2);
    check_vec("loss (none) vs ref_loss", loss, ref_loss, R, TOL_ATOL, TOL_RTOL);
    check_vec("lse vs ref_lse", lse, ref_lse, R, TOL_ATOL, TOL_RTOL);
    check_scalar("loss (mean) vs mean(ref_loss)", mean_loss, mean_f64(ref_loss, R), TOL_ATOL, TOL_RTOL);
    check_argmax("argmax vs ref_argmax", amax, ref_argmax, R, hidden, W, D);
  }

  /* ---- 3. knowledge distillation ------------------------------------------------------------------ */
  printf("\n[3] fce_kd_loss: student = layer-%s logit lens, teacher = final layer, T=1\n", sample_meta(&s, "student_layer"));
  {
    static const char* names[4] = {"forward KL", "reverse KL", "JSD(0.5)", "fwd KL renorm"};
    const double* refs[3] = {ref_kl_fwd, ref_kl_rev, ref_jsd};
    /* Two references per value (docs/demo.md):
     * (a) float64 from float64 logits: the file's ref_kl_*, and for the top-K teacher one computed here
     *     from ref_student_lse and float64 student logits at the K ids. The fp32 logits the library is
     *     given differ from those by up to ~4e-5, and a divergence amplifies that by up to |log p/q|
     *     (~100 here): tolerance TOL_KD_*.
     * (b) float64 math on the very fp32 logits the library is given, on KD_SUB evenly spaced rows: only
     *     the kernel's own rounding is left: tolerance TOL_KERNEL_*. */
    double* topk_ref[4];
    for (int d = 0; d < 4; ++d) topk_ref[d] = xmalloc((size_t)R * 8);
    t0 = now_ms();
    {
      double* zs = xmalloc((size_t)K * 8);
      for (int64_t t = 0; t < R; ++t) {
        double out[4];
        for (int64_t k = 0; k < K; ++k) zs[k] = dot64(student_hidden + t * D, W + (int64_t)topk_ids[t * K + k] * D, D);
        kd_topk_f64(zs, ref_student_lse[t], topk_lp + t * K, K, out);
        for (int d = 0; d < 4; ++d) topk_ref[d][t] = out[d];
      }
      free(zs);
    }
    const int64_t nsub = R < KD_SUB ? R : KD_SUB, stride = R / nsub;
    int64_t sub_rows[KD_SUB];
    double sub_full[3][KD_SUB], sub_topk[4][KD_SUB];
    {
      double* zs = xmalloc((size_t)K * 8);
      for (int64_t i = 0; i < nsub; ++i) {
        const int64_t t = sub_rows[i] = i * stride + stride / 2;
        const float* srow = slog + t * V;
        double out[4];
        kd_full_f64(srow, tlog + t * V, V, out);
        for (int d = 0; d < 3; ++d) sub_full[d][i] = out[d];
        for (int64_t k = 0; k < K; ++k) zs[k] = srow[topk_ids[t * K + k]];
        kd_topk_f64(zs, lse64f(srow, V), topk_lp + t * K, K, out);
        for (int d = 0; d < 4; ++d) sub_topk[d][i] = out[d];
      }
      free(zs);
    }
    printf("  float64 references computed here in %.0f ms: top-K on %lld rows from float64 logits; every\n"
           "  divergence on %lld evenly spaced rows from the same fp32 logits as the library gets\n",
           now_ms() - t0, (long long)R, (long long)nsub);

    float* kl = xmalloc((size_t)R * 4);
    float kmean = 0, got_sub[KD_SUB];
    Buf* bs = buf_new(slog, kF32, 2, R, V, 0);
    Buf* bt = buf_new(tlog, kF32, 2, R, V, 0);
    Buf* bi = buf_new(topk_ids, kI32, 2, R, K, 0);
    Buf* bp = buf_new(topk_lp, kF32, 2, R, K, 0);
    Buf* bl = buf_new(kl, kF32, 1, R, 0, 1);
    Buf* bm = buf_new(&kmean, kF32, 0, 0, 0, 1);
    for (int d = 0; d < 7; ++d) {
      const int topk = d >= 3, dv = topk ? d - 3 : d; /* dv 3: forward KL, renormalized */
      char label[96], what[96];
      if (d == 0) printf("  full vocabulary, materialized student and teacher logits [%lld,%lld]\n", (long long)R, (long long)V);
      if (d == 3)
        printf("  top-%lld teacher (teacher_topk_ids/logprobs, renormalized over the K); student log-probs over the\n"
               "  full vocabulary, or renormalized over the K (FCE_KD_TOPK_RENORMALIZE)\n", (long long)K);
      KdArgs a = {bs, topk ? NULL : bt, topk ? bi : NULL, topk ? bp : NULL, bl, dv == 3 ? FCE_KD_FORWARD_KL : dv,
                  FCE_REDUCTION_NONE, dv == 3 ? FCE_KD_TOPK_RENORMALIZE : FCE_KD_TOPK_FULL_VOCAB};
      Buf* l1[4] = {bs, bt, bl, NULL};
      Buf* l2[4] = {bs, bt, bm, NULL};
      if (topk) l1[1] = l2[1] = bi, l1[2] = l2[2] = bp, l1[3] = bl, l2[3] = bm;
      /* bytes read: both [R,V] logits; or the student's and the top-K data; renormalized: the K only */
      const double kbytes = (double)R * (double)K * 8.0;
      const double bytes = !topk ? 2 * logit_bytes : dv == 3 ? 1.5 * kbytes : logit_bytes + kbytes;
      snprintf(label, sizeof label, "KD %s, %s, none", names[dv], topk ? "top-K" : "full vocab");
      const double ms = run_op(label, op_kd, &a, l1, topk ? 4 : 3, bytes, 0);
      KdArgs m = a;
      m.loss = bm;
      m.reduction = FCE_REDUCTION_MEAN;
      snprintf(label, sizeof label, "KD %s, %s, mean", names[dv], topk ? "top-K" : "full vocab");
      const double ms2 = run_op(label, op_kd, &m, l2, topk ? 4 : 3, bytes, 0);
      printf("    %-13s mean %.6f nats   [%.0f ms, %.0f ms]\n", names[dv], kmean, ms, ms2);
      const double* ref = topk ? topk_ref[dv] : refs[dv];
      if (topk) snprintf(what, sizeof what, "%s (none) vs float64", names[dv]);
      else snprintf(what, sizeof what, "%s (none) vs ref_%s", names[dv], dv == 0 ? "kl_fwd" : dv == 1 ? "kl_rev" : "jsd");
      check_vec(what, kl, ref, R, TOL_KD_ATOL, TOL_KD_RTOL);
      snprintf(what, sizeof what, "%s (mean) vs mean of the above", names[dv]);
      check_scalar(what, kmean, mean_f64(ref, R), TOL_KD_ATOL, TOL_KD_RTOL);
      for (int64_t i = 0; i < nsub; ++i) got_sub[i] = kl[sub_rows[i]];
      snprintf(what, sizeof what, "%s (none) vs f64, same fp32 logits", names[dv]);
      check_vec(what, got_sub, topk ? sub_topk[dv] : sub_full[dv], nsub, TOL_KERNEL_ATOL, TOL_KERNEL_RTOL);
      if (d == 2)
        printf("    file (all %lld tokens): forward KL %s, reverse KL %s, JSD %s\n", (long long)T,
               sample_meta(&s, "mean_kl_fwd"), sample_meta(&s, "mean_kl_rev"), sample_meta(&s, "mean_jsd"));
    }
    for (int d = 0; d < 4; ++d) free(topk_ref[d]);
    free(kl);
  }

  /* ---- 4. next-token distribution after the prompt ----------------------------------------------- */
  printf("\n[4] fce_temp_softmax: next token after the prompt (teacher logits row %lld; actual next token ",
         (long long)(P - 1));
  print_token(&voc, targets[P - 1]);
  printf(")\n");
  {
    const float* row = tlog + (P - 1) * V;
    float* probs = xmalloc((size_t)V * 4);
    float* logprobs = xmalloc((size_t)V * 4);
    double* z = xmalloc((size_t)V * 8);
    double* rp = xmalloc((size_t)V * 8);
    double* rlp = xmalloc((size_t)V * 8);
    for (int64_t v = 0; v < V; ++v) z[v] = dot64(hidden + (P - 1) * D, W + v * D, D);
    Buf* bx = buf_new(row, kF32, 2, 1, V, 0);
    Buf* bp = buf_new(probs, kF32, 2, 1, V, 1);
    Buf* bl = buf_new(logprobs, kF32, 2, 1, V, 1);
    const float temps[2] = {0.7f, 0.0f};
    for (int ti = 0; ti < 2; ++ti) {
      char label[64];
      SoftmaxArgs a = {bx, bp, bl, temps[ti]};
      Buf* l[] = {bx, bp, bl};
      snprintf(label, sizeof label, "temp softmax T=%.1f, 1 row", temps[ti]);
      const double ms = run_op(label, op_softmax, &a, l, 3, 4.0 * V, 0);
      int64_t ids[5];
      top_k(probs, V, 5, ids);
      printf("  T = %.1f   [%.2f ms]\n", temps[ti], ms);
      if (temps[ti] > 0) {
        /* float64 reference: softmax(z / T) from float64 logits. */
        double m = z[0];
        for (int64_t v = 1; v < V; ++v)
          if (z[v] > m) m = z[v];
        double sum = 0;
        for (int64_t v = 0; v < V; ++v) sum += rp[v] = d_exp((z[v] - m) / temps[ti]);
        const double lsum = d_log(sum);
        double psum = 0;
        for (int64_t v = 0; v < V; ++v) {
          rlp[v] = (z[v] - m) / temps[ti] - lsum;
          rp[v] /= sum;
          psum += probs[v];
        }
        for (int k = 0; k < 5; ++k) {
          printf("    %d. p = %.6f (float64 %.6f)  id %5lld  ", k + 1, probs[ids[k]], rp[ids[k]], (long long)ids[k]);
          print_token(&voc, ids[k]);
          printf("\n");
        }
        check_vec_at("probs vs float64 softmax(z/T)", probs, rp, V, TOL_PROB_ATOL, TOL_PROB_RTOL, "id");
        check_vec_at("logprobs vs float64", logprobs, rlp, V, TOL_ATOL, TOL_RTOL, "id");
        check_scalar("sum of probs", psum, 1.0, 1e-5, 0);
      } else {
        int64_t ones = 0, bad = 0;
        for (int64_t v = 0; v < V; ++v) {
          if (probs[v] == 1.f && logprobs[v] == 0.f) ++ones;
          else if (!(probs[v] == 0.f && logprobs[v] == -INFINITY)) ++bad;
        }
        printf("    1. p = %.6f  id %5lld  ", probs[ids[0]], (long long)ids[0]);
        print_token(&voc, ids[0]);
        printf("   (greedy: every other token has p = 0 exactly)\n");
        char what[96];
        snprintf(what, sizeof what, "one-hot at ref_argmax[%lld] = %d", (long long)(P - 1), ref_argmax[P - 1]);
        report(what, (double)bad, "", "exact", ones == 1 && bad == 0 && probs[ref_argmax[P - 1]] == 1.f);
      }
    }
    free(probs), free(logprobs), free(z), free(rp), free(rlp);
  }

  /* ---- summary ----------------------------------------------------------------------------------- */
  printf("\n[5] wall time per call (%s)\n", g_dev.gpu ? "GPU: mean of 3 after a warm-up, without copies"
                                                      : "CPU: one call each, the handle's cached workspace");
  for (int i = 0; i < g_ntimes; ++i) {
    const Timing* t = &g_times[i];
    printf("    %-40s %-4s %10.2f ms", t->label, t->device, t->ms);
    if (t->work >= 1e8 && t->ms > 0)
      printf("   %8.1f %s", t->work / (t->ms * 1e-3) * 1e-9, t->is_flops ? "GFLOP/s" : "GB/s read");
    printf("\n");
  }
  printf("    total run time %.1f s\n", (now_ms() - t_start) * 1e-3);

  bufs_free();
  fce_handle_destroy(g_dev.gpu);
  fce_handle_destroy(g_dev.cpu);
  free(W32), free(hidden16), free(loss), free(lse), free(amax), free(tlog), free(slog);
  cJSON_Delete(s.header);
  free(s.bytes);

  printf("\n%d checks, %d failed", g_checks, g_failed);
  if (g_dev.fell_back) printf("; %d calls ran on the CPU because the CUDA backend lacks them", g_dev.fell_back);
  printf("\n");
  if (g_failed) {
    printf("FAIL: values beyond the tolerances of docs/demo.md\n");
    return 1;
  }
  if (g_dev.require_gpu && g_dev.fell_back) {
    printf("SKIP: --device cuda, but not every op ran on the GPU\n");
    return EXIT_SKIP;
  }
  printf("PASS\n");
  return 0;
}

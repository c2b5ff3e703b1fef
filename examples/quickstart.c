/*
 * quickstart.c: the README's short C example. Cross-entropy of a tiny batch on the CPU.
 *
 *   cc quickstart.c $(pkg-config --cflags --libs fusedce) && ./a.out
 *
 * Three rows of 5 logits, the last row ignored (target -100), mean over the two others.
 */
#include <stdio.h>

#include <fusedce/fusedce.h>

/* Prints what failed and returns 1: every call returns a status; the detail is per thread. */
static int fail(const char* what, fce_status_t st) {
  fprintf(stderr, "%s: %s (%s)\n", what, fce_status_string(st), fce_last_error_message());
  return 1;
}

int main(void) {
  float logits[3][5] = {{2.0f, 1.0f, 0.1f, -1.0f, 0.5f},
                        {0.0f, 3.0f, -2.0f, 1.5f, 0.2f},
                        {1.0f, 1.0f, 1.0f, 1.0f, 1.0f}};
  int64_t targets[3] = {0, 3, -100};
  float loss = 0.0f;

  /* Borrowed DLPack descriptors: host memory, row-major (strides NULL). */
  int64_t logits_shape[2] = {3, 5}, targets_shape[1] = {3};
  DLTensor x = {0};
  x.data = logits;
  x.device.device_type = kDLCPU;
  x.ndim = 2;
  x.dtype.code = kDLFloat, x.dtype.bits = 32, x.dtype.lanes = 1;
  x.shape = logits_shape;
  DLTensor t = {0};
  t.data = targets;
  t.device.device_type = kDLCPU;
  t.ndim = 1;
  t.dtype.code = kDLInt, t.dtype.bits = 64, t.dtype.lanes = 1;
  t.shape = targets_shape;
  DLTensor l = {0}; /* ndim 0: a scalar */
  l.data = &loss;
  l.device.device_type = kDLCPU;
  l.dtype.code = kDLFloat, l.dtype.bits = 32, l.dtype.lanes = 1;

  fce_handle_t h = NULL;
  fce_status_t st = fce_handle_create(kDLCPU, 0, &h);
  if (st != FCE_STATUS_SUCCESS) return fail("fce_handle_create", st);

  fce_ce_options_t opt = FCE_CE_OPTIONS_INIT; /* mean over non-ignored rows, ignore_index -100 */
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = &l;
  /* stream NULL (ignored on the CPU), workspace NULL: the handle allocates and caches one. */
  st = fce_cross_entropy_fwd(h, NULL, &x, &t, &opt, &out, NULL, 0);
  if (st != FCE_STATUS_SUCCESS) {
    fce_handle_destroy(h);
    return fail("fce_cross_entropy_fwd", st);
  }
  printf("libfusedce %s: mean cross-entropy %.6f nats\n", fce_version_string(), loss);

  /* Errors come back as a status and a message, never as a crash: V = 0 is a shape mismatch. */
  logits_shape[1] = 0;
  st = fce_cross_entropy_fwd(h, NULL, &x, &t, &opt, &out, NULL, 0);
  printf("with V = 0: %s: %s\n", fce_status_string(st), fce_last_error_message());
  fce_handle_destroy(h);

  /* float64: (log(sum exp row0) - 2.0 + log(sum exp row1) - 1.5) / 2 */
  const double expected = 1.1877182086987037, d = loss - expected;
  if (d > 1e-5 || d < -1e-5 || st == FCE_STATUS_SUCCESS) {
    fprintf(stderr, "unexpected result: loss %.7f (expected %.7f), status %d\n", loss, expected, (int)st);
    return 1;
  }
  return 0;
}

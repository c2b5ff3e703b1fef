/* F4 (docs/reliability.md): linear CE with an fp32 operand whose row stride is >= 2^31 elements (legal: any
 * row stride >= the row length) returns FCE_STATUS_SUCCESS with a wrong loss: the CPU backend narrows the
 * leading dimension to int for cblas_sgemm, OpenBLAS rejects the call ("** On entry to SGEMM parameter
 * number 10 had an illegal value") and nothing is computed. Needs 8 GiB of address space, touches 2 pages.
 *   cc -std=gnu99 -Iinclude tests/fuzz/repro/f4_linear_ce_ld.c -Lbuild -lfusedce -Wl,-rpath,$PWD/build -o /tmp/f4 */
#include <fusedce/fusedce.h>
#include <stdio.h>
#include <sys/mman.h>

static fce_status_t run(fce_handle_t h, float* hid, int64_t ld, float* loss) {
  static float w[3] = {0.5f, -1.f, 2.f};
  static int64_t tg[2] = {0, 2};
  static int64_t hs[2] = {2, 1}, ws[2] = {3, 1}, ns[1] = {2};
  int64_t hst[2] = {ld, 1};
  DLTensor H = {hid, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, hs, hst, 0};
  DLTensor W = {w, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, ws, NULL, 0};
  DLTensor T = {tg, {kDLCPU, 0}, 1, {kDLInt, 64, 1}, ns, NULL, 0};
  DLTensor L = {loss, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, ns, NULL, 0};
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_NONE;
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = &L;
  return fce_linear_cross_entropy_fwd(h, NULL, &H, &W, NULL, &T, &o, &out, NULL, 0);
}

int main(void) {
  fce_handle_t h;
  if (fce_handle_create(kDLCPU, 0, &h) != FCE_STATUS_SUCCESS) return 1;
  const int64_t LD = (int64_t)1 << 31;
  float* big = mmap(NULL, (size_t)(LD + 1) * 4, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (big == MAP_FAILED) { perror("mmap"); return 1; }
  big[0] = 1.f;
  big[LD] = 2.f; /* hidden [2,1] = {1, 2}, row stride 2^31 */
  float small[5] = {1, 0, 0, 0, 2}; /* the same hidden with row stride 4 */
  float a[2], b[2];
  fce_status_t sa = run(h, big, LD, a), sb = run(h, small, 4, b);
  printf("row stride 2^31: %s, loss %g %g\n", fce_status_string(sa), a[0], a[1]);
  printf("row stride 4:    %s, loss %g %g (correct)\n", fce_status_string(sb), b[0], b[1]);
  fce_handle_destroy(h);
  return sa == FCE_STATUS_SUCCESS && (a[0] != b[0] || a[1] != b[1]) ? 1 : 0; /* 1 = bug present */
}

/* F3 (docs/reliability.md): overlapping outputs are accepted. probs and logprobs both on the logits' memory:
 * the header says logprobs "may not overlap probs"; the call returns FCE_STATUS_SUCCESS and the probabilities
 * are overwritten by the log-probabilities.
 *   cc -std=c99 -Iinclude tests/fuzz/repro/f3_softmax_alias.c -Lbuild -lfusedce -Wl,-rpath,$PWD/build -o /tmp/f3 */
#include <fusedce/fusedce.h>
#include <stdio.h>

int main(void) {
  fce_handle_t h;
  if (fce_handle_create(kDLCPU, 0, &h) != FCE_STATUS_SUCCESS) return 1;
  float x[4] = {0, 1, 2, 3};
  int64_t shape[2] = {2, 2};
  DLTensor t = {x, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, NULL, 0};
  DLTensor probs = t, logprobs = t;
  fce_status_t s = fce_temp_softmax(h, NULL, &t, NULL, &probs, &logprobs, NULL, 0);
  printf("status: %s (want: %s)\n", fce_status_string(s), fce_status_string(FCE_STATUS_ALIASING));
  printf("memory: %g %g %g %g\n", x[0], x[1], x[2], x[3]); /* -1.31326 -0.313262 ...: log-probabilities */
  fce_handle_destroy(h);
  return s == FCE_STATUS_ALIASING ? 0 : 1;
}

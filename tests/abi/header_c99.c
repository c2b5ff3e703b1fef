/* The public header compiles as strict C99 (-std=c99 -pedantic -Werror) and its macros initialize. */
#include <fusedce/fusedce.h>
#include <stdio.h>

int main(void) {
  fce_ce_options_t ce = FCE_CE_OPTIONS_INIT;
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  fce_lse_options_t lse = FCE_LSE_OPTIONS_INIT;
  fce_softmax_options_t sm = FCE_SOFTMAX_OPTIONS_INIT;
  fce_kd_options_t kd = FCE_KD_OPTIONS_INIT;
  fce_kd_teacher_t t = FCE_KD_TEACHER_INIT;
  fce_kd_outputs_t ko = FCE_KD_OUTPUTS_INIT;
  fce_linear_ce_outputs_t lo = FCE_LINEAR_CE_OUTPUTS_INIT;
  if (ce.struct_size != sizeof ce || out.struct_size != sizeof out || lse.struct_size != sizeof lse ||
      sm.struct_size != sizeof sm || kd.struct_size != sizeof kd || t.struct_size != sizeof t ||
      ko.struct_size != sizeof ko || lo.struct_size != sizeof lo)
    return 1;
  if (ce.ignore_index != -100 || ce.logit_scale != 1.0f || ce.reduction != FCE_REDUCTION_MEAN) return 1;
  if (fce_version_number() != FCE_VERSION_NUMBER || fce_abi_version() != FCE_ABI_VERSION) return 1;
  printf("C99 header check: libfusedce %s\n", fce_version_string());
  return 0;
}

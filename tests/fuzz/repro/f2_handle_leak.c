/* F2 (docs/reliability.md): fce_handle_create(kDLCUDA, negative ordinal) leaks the handle it allocated.
 *   cc -std=c99 -Iinclude tests/fuzz/repro/f2_handle_leak.c -Lbuild -lfusedce -Wl,-rpath,$PWD/build -o /tmp/f2
 *   valgrind --leak-check=full /tmp/f2      -> "40 bytes in 1 blocks are definitely lost" (fce_handle_create) */
#include <fusedce/fusedce.h>
#include <stdio.h>

int main(void) {
  fce_handle_t h = NULL;
  fce_status_t s = fce_handle_create(kDLCUDA, -1, &h);
  printf("%s (handle %p)\n", fce_status_string(s), (void*)h); /* invalid argument (handle (nil)) */
  return 0;
}

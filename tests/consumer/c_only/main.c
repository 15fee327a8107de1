/* SPDX-License-Identifier: Apache-2.0 */
/* libterrace.so from C alone: configure a sim device, allocate, write, free. Exits 0 only if
 * every call does what terrace.h says. */
#include <stdio.h>
#include <string.h>

#include <terrace/terrace.h>

int main(void) {
  if (terrace_configure("device:sim,device_capacity:16MiB") != TERRACE_OK) {
    fprintf(stderr, "terrace_c_consumer: FAILED: terrace_configure: %s\n", terrace_last_error());
    return 1;
  }
  const size_t bytes = (size_t)1 << 20;
  void* p = terrace_malloc(bytes, 0, NULL);
  if (p == NULL) {
    fprintf(stderr, "terrace_c_consumer: FAILED: terrace_malloc: %s\n", terrace_last_error());
    return 1;
  }
  memset(p, 0x5a, bytes); /* the sim device's memory is host memory */
  terrace_free(p, bytes, 0, NULL);
  puts("terrace_c_consumer: ok");
  return 0;
}

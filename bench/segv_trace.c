/* A backtrace when a process dies of SIGSEGV/SIGBUS, for machines without gdb:
 *   gcc -shared -fPIC -o /tmp/segv_trace.so bench/segv_trace.c -ldl
 *   LD_PRELOAD=/tmp/segv_trace.so python -c "..."   (without -X faulthandler, which takes the signal)
 * Each frame is printed as file(symbol+offset) [address]; frames in a stripped or hidden-symbol
 * library show file(+offset), which `addr2line -f -e FILE OFFSET` or `nm` resolves afterwards. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void on_signal(int sig, siginfo_t *info, void *ctx) {
  (void)ctx;
  char line[160];
  int n = snprintf(line, sizeof line, "segv_trace: signal %d, fault address %p\n", sig, info->si_addr);
  if (write(2, line, n) < 0) _exit(128 + sig);
  void *frames[96];
  int depth = backtrace(frames, 96);
  backtrace_symbols_fd(frames, depth, 2);
  _exit(128 + sig);
}

__attribute__((constructor)) static void install(void) {
  static char altstack[1 << 16];
  stack_t ss = {.ss_sp = altstack, .ss_size = sizeof altstack, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  struct sigaction sa = {0};
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
}

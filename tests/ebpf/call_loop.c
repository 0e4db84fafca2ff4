/*
 * A tight loop over one hooked driver-API call, for the probe overhead benchmark.
 *
 *   call_loop LIBCUDA API CALLS [wait]   API: memcpy (cuMemcpyHtoDAsync_v2) or launch (cuLaunchKernel)
 *
 * With "wait" it loads the library, prints "ready" and waits for a line on stdin first.
 * Prints "api SYMBOL calls N wall_ns W cpu_ns C" on stdout: the function it called, how many
 * times, the loop's wall time and its CPU time (user + system, where the uprobe traps are charged).
 * Any other API name or a call count that is not a positive number is refused (exit 2).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static long long ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: %s LIBCUDA memcpy|launch CALLS [wait]\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 5; }
    char *end;
    long calls = strtol(argv[3], &end, 10);
    if (*end || calls <= 0 || (strcmp(argv[2], "launch") && strcmp(argv[2], "memcpy"))) {
        fprintf(stderr, "usage: %s LIBCUDA memcpy|launch CALLS [wait]\n", argv[0]);
        return 2;
    }
    static char host[64];
    CUresult (*memcpy_h2d)(CUdeviceptr, const void *, size_t, void *) =
        (CUresult (*)(CUdeviceptr, const void *, size_t, void *))dlsym(lib, "cuMemcpyHtoDAsync_v2");
    CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       void *, void **, void **) =
        (CUresult (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                      void *, void **, void **))dlsym(lib, "cuLaunchKernel");
    if (!memcpy_h2d || !launch) { fprintf(stderr, "missing symbols\n"); return 4; }
    int use_launch = strcmp(argv[2], "launch") == 0;
    if (argc == 5) {
        char line[16];
        printf("ready\n");
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin)) return 3;
    }
    long long w0 = ns(CLOCK_MONOTONIC), c0 = ns(CLOCK_PROCESS_CPUTIME_ID);
    if (use_launch) {
        for (long i = 0; i < calls; i++) launch((void *)host, 128, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL);
    } else {
        for (long i = 0; i < calls; i++) memcpy_h2d(0x7f0000000000ULL, host, 64, NULL);
    }
    long long w1 = ns(CLOCK_MONOTONIC), c1 = ns(CLOCK_PROCESS_CPUTIME_ID);
    printf("api %s calls %ld wall_ns %lld cpu_ns %lld\n", use_launch ? "cuLaunchKernel" : "cuMemcpyHtoDAsync_v2",
           calls, w1 - w0, c1 - c0);
    return 0;
}

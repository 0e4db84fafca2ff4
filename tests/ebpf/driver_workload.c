/*
 * A CUDA driver-API client with a known script of calls, for the eBPF probe tests.
 *
 *   driver_workload LIBCUDA [--late-ms N] [--wait-before-load] [--wait-before-calls] [--hold]
 *
 * It loads LIBCUDA with dlopen (after N ms, or after a line on stdin), makes the calls
 * listed in EXPECTED below, and exits (or, with --hold, waits for a line on stdin first).
 * It prints "pid N", "loaded" and "done" on stdout as it goes. Three 64 KiB allocations
 * made by leak_scratch_buffer() are never freed; everything else is.
 *
 * EXPECTED (per API: calls, errors by code, bytes):
 *   cuModuleGetFunction   2
 *   cuMemAlloc_v2        14, {2: 1}, 10 x (1..10 MiB) + 2 GiB + 3 x 64 KiB
 *   cuMemFree_v2         11, {1: 1}, 55 MiB (the bytes of the 10 known allocations freed)
 *   cuMemAllocAsync       1, 4096       cuMemFreeAsync 1, 4096
 *   cuMemcpyHtoDAsync_v2  5 x 1000      cuMemcpyDtoHAsync_v2 3 x 2000
 *   cuMemcpyDtoDAsync_v2  2 x 3000
 *   cuLaunchKernel       11, {1: 1}: gemm_kernel (128,8,1)x(256,1,1) 7 times,
 *                        flash_attn_bwd (1,1,1)x(128,1,1) shared 4096 3 times,
 *                        gemm_kernel (1,1,1)x(2048,1,1) once (too many threads: error 1)
 *   cuLaunchKernelEx      2: gemm_kernel (64,1,1)x(128,1,1)
 *   cuStreamSynchronize   5 (4 plain, 1 through cuStreamSynchronize_ptsz)   cuCtxSynchronize 1
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
typedef void *CUfunction;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

static CUresult (*cuModuleGetFunction)(CUfunction *, void *, const char *);
static CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
static CUresult (*cuMemFree_v2)(CUdeviceptr);
static CUresult (*cuMemAllocAsync)(CUdeviceptr *, size_t, CUstream);
static CUresult (*cuMemFreeAsync)(CUdeviceptr, CUstream);
static CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*cuMemcpyDtoHAsync_v2)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*cuMemcpyDtoDAsync_v2)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, unsigned, CUstream, void **, void **);
static CUresult (*cuLaunchKernelEx)(const CUlaunchConfig *, CUfunction, void **, void **);
static CUresult (*cuStreamSynchronize)(CUstream);
static CUresult (*cuStreamSynchronize_ptsz)(CUstream);
static CUresult (*cuCtxSynchronize)(void);

static void wait_line(void) {
    char buf[64];
    if (!fgets(buf, sizeof buf, stdin)) exit(3);
}

static void *must(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) { fprintf(stderr, "missing %s\n", name); exit(4); }
    return p;
}

static void load(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); exit(5); }
    *(void **)&cuModuleGetFunction = must(lib, "cuModuleGetFunction");
    *(void **)&cuMemAlloc_v2 = must(lib, "cuMemAlloc_v2");
    *(void **)&cuMemFree_v2 = must(lib, "cuMemFree_v2");
    *(void **)&cuMemAllocAsync = must(lib, "cuMemAllocAsync");
    *(void **)&cuMemFreeAsync = must(lib, "cuMemFreeAsync");
    *(void **)&cuMemcpyHtoDAsync_v2 = must(lib, "cuMemcpyHtoDAsync_v2");
    *(void **)&cuMemcpyDtoHAsync_v2 = must(lib, "cuMemcpyDtoHAsync_v2");
    *(void **)&cuMemcpyDtoDAsync_v2 = must(lib, "cuMemcpyDtoDAsync_v2");
    *(void **)&cuLaunchKernel = must(lib, "cuLaunchKernel");
    *(void **)&cuLaunchKernelEx = must(lib, "cuLaunchKernelEx");
    *(void **)&cuStreamSynchronize = must(lib, "cuStreamSynchronize");
    *(void **)&cuStreamSynchronize_ptsz = must(lib, "cuStreamSynchronize_ptsz");
    *(void **)&cuCtxSynchronize = must(lib, "cuCtxSynchronize");
}

__attribute__((noinline)) void leak_scratch_buffer(void) {
    CUdeviceptr scratch;
    for (int i = 0; i < 3; i++) cuMemAlloc_v2(&scratch, 64 << 10);
}

__attribute__((noinline)) void run_workload(void) {
    CUfunction gemm, attn;
    CUdeviceptr buffers[10], big, tmp;
    static char host[4096];
    CUstream stream = (CUstream)0x1;

    cuModuleGetFunction(&gemm, NULL, "gemm_kernel");
    cuModuleGetFunction(&attn, NULL, "flash_attn_bwd");

    for (int i = 0; i < 10; i++) cuMemAlloc_v2(&buffers[i], (size_t)(i + 1) << 20);
    cuMemAlloc_v2(&big, 2ULL << 30);                    /* past capacity: error 2 */
    leak_scratch_buffer();

    for (int i = 0; i < 5; i++) cuMemcpyHtoDAsync_v2(buffers[0], host, 1000, stream);
    for (int i = 0; i < 3; i++) cuMemcpyDtoHAsync_v2(host, buffers[1], 2000, stream);
    for (int i = 0; i < 2; i++) cuMemcpyDtoDAsync_v2(buffers[2], buffers[3], 3000, stream);

    for (int i = 0; i < 7; i++) cuLaunchKernel(gemm, 128, 8, 1, 256, 1, 1, 0, stream, NULL, NULL);
    for (int i = 0; i < 3; i++) cuLaunchKernel(attn, 1, 1, 1, 128, 1, 1, 4096, stream, NULL, NULL);
    cuLaunchKernel(gemm, 1, 1, 1, 2048, 1, 1, 0, stream, NULL, NULL);   /* error 1 */
    CUlaunchConfig cfg = {64, 1, 1, 128, 1, 1, 0, stream, NULL, 0};
    for (int i = 0; i < 2; i++) cuLaunchKernelEx(&cfg, gemm, NULL, NULL);

    for (int i = 0; i < 4; i++) cuStreamSynchronize(stream);
    cuStreamSynchronize_ptsz(stream);                   /* calls cuStreamSynchronize inside */
    cuCtxSynchronize();

    cuMemAllocAsync(&tmp, 4096, stream);
    cuMemFreeAsync(tmp, stream);
    for (int i = 0; i < 10; i++) cuMemFree_v2(buffers[i]);
    cuMemFree_v2(0xdeadbeef);                           /* unknown pointer: error 1 */
}

int main(int argc, char **argv) {
    int late_ms = 0, wait_before_load = 0, wait_before_calls = 0, hold = 0;
    if (argc < 2) { fprintf(stderr, "usage: %s LIBCUDA [options]\n", argv[0]); return 2; }
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--late-ms") && i + 1 < argc) late_ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--wait-before-load")) wait_before_load = 1;
        else if (!strcmp(argv[i], "--wait-before-calls")) wait_before_calls = 1;
        else if (!strcmp(argv[i], "--hold")) hold = 1;
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("pid %d\n", (int)getpid());
    if (late_ms) {
        struct timespec ts = {late_ms / 1000, (long)(late_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (wait_before_load) wait_line();
    load(argv[1]);
    printf("loaded\n");
    if (wait_before_calls) wait_line();
    run_workload();
    printf("done\n");
    if (hold) wait_line();
    return 0;
}

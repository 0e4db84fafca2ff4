/*
 * A stand-in for libcuda.so.1 on machines without an NVIDIA driver.
 *
 * It exports the CUDA driver API symbols that gpudiag's eBPF probes hook, with their
 * real signatures (cuda.h), and behaves like the driver where the probes can tell:
 * device pointers come from a bounded device heap, an allocation past the capacity
 * fails with CUDA_ERROR_OUT_OF_MEMORY, freeing an unknown pointer fails with
 * CUDA_ERROR_INVALID_VALUE, and a launch with more than 1024 threads per block or a
 * zero dimension fails with CUDA_ERROR_INVALID_VALUE. cuStreamSynchronize_ptsz, the
 * per-thread-default-stream variant, calls the plain function through its exported
 * symbol, as variants of one API may, then waits 5 ms: the probe must count such a call
 * once, with the latency of the outer call.
 */
#include <stddef.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUstream_st *CUstream;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUlaunchAttribute_st CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_FOUND 500

#define DEVICE_BASE 0x7f0000000000ULL
#define DEVICE_CAPACITY (1ULL << 30)
#define MAX_LIVE 4096

struct live_allocation { CUdeviceptr ptr; size_t bytes; };
static struct live_allocation live[MAX_LIVE];
static CUdeviceptr next_ptr = DEVICE_BASE;
static size_t used_bytes;

struct CUfunc_st { char name[64]; };
static struct CUfunc_st functions[64];
static int n_functions;

static CUresult device_alloc(CUdeviceptr *dptr, size_t bytesize) {
    if (dptr == NULL || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    if (used_bytes + bytesize > DEVICE_CAPACITY) return CUDA_ERROR_OUT_OF_MEMORY;
    for (int i = 0; i < MAX_LIVE; i++) {
        if (live[i].ptr == 0) {
            live[i].ptr = next_ptr;
            live[i].bytes = bytesize;
            *dptr = next_ptr;
            next_ptr += (bytesize + 511) & ~511ULL;
            used_bytes += bytesize;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult device_free(CUdeviceptr dptr) {
    for (int i = 0; i < MAX_LIVE; i++) {
        if (live[i].ptr == dptr && dptr != 0) {
            used_bytes -= live[i].bytes;
            live[i].ptr = 0;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult check_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                             unsigned bx, unsigned by, unsigned bz) {
    if (f == NULL) return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz) return CUDA_ERROR_INVALID_VALUE;
    if ((unsigned long long)bx * by * bz > 1024) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return device_alloc(dptr, bytesize); }
CUresult cuMemFree_v2(CUdeviceptr dptr) { return device_free(dptr); }
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    (void)hStream;
    return device_alloc(dptr, bytesize);
}
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { (void)hStream; return device_free(dptr); }

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                              CUstream hStream) {
    (void)hStream; (void)ByteCount;
    return (dstDevice == 0 || srcHost == NULL) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream) {
    (void)hStream; (void)ByteCount;
    return (dstHost == NULL || srcDevice == 0) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream) {
    (void)hStream; (void)ByteCount;
    return (dstDevice == 0 || srcDevice == 0) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    (void)hmod;
    if (hfunc == NULL || name == NULL) return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < n_functions; i++) {
        if (strcmp(functions[i].name, name) == 0) { *hfunc = &functions[i]; return CUDA_SUCCESS; }
    }
    if (n_functions == 64) return CUDA_ERROR_NOT_FOUND;
    strncpy(functions[n_functions].name, name, sizeof(functions[0].name) - 1);
    *hfunc = &functions[n_functions++];
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra) {
    (void)sharedMemBytes; (void)hStream; (void)kernelParams; (void)extra;
    return check_launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra) {
    (void)kernelParams; (void)extra;
    if (config == NULL) return CUDA_ERROR_INVALID_VALUE;
    return check_launch(f, config->gridDimX, config->gridDimY, config->gridDimZ,
                        config->blockDimX, config->blockDimY, config->blockDimZ);
}

CUresult cuStreamSynchronize(CUstream hStream) { (void)hStream; return CUDA_SUCCESS; }
CUresult cuStreamSynchronize_ptsz(CUstream hStream) {
    CUresult (*volatile plain)(CUstream) = cuStreamSynchronize;  /* through the GOT: the hooked address */
    CUresult result = plain(hStream);   /* not a tail call: work follows */
    struct timespec pause = {0, 5000000};
    nanosleep(&pause, NULL);
    return result;
}
CUresult cuCtxSynchronize(void) { return CUDA_SUCCESS; }

/* Stand-in for the driver's libcuda.so.1 (no GPU here): the real exported
 * names (the _v2 ABI of cuMemAlloc/cuMemFree) and C signatures. */
#include <stddef.h>
#include "stub_control.h"

typedef int CUresult;
typedef void *CUfunction, *CUstream;
typedef unsigned long long CUdeviceptr;
typedef struct CUlaunchConfig_st {        /* CUDA 12 layout */
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned sharedMem, CUstream stream, void **params, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)sharedMem; (void)stream; (void)params; (void)extra;
    return STUB_RC("cuLaunchKernel");
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
    (void)config; (void)f; (void)params; (void)extra; return STUB_RC("cuLaunchKernelEx");
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) { STUB_CALL("cuMemAlloc_v2"); *p = stub_fake_ptr(size); return 0; }
CUresult cuMemFree_v2(CUdeviceptr p) { (void)p; return STUB_RC("cuMemFree_v2"); }
/* Pinned (page-locked) host memory: host addresses, apart from device memory. */
CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags) {
    (void)flags; STUB_CALL("cuMemHostAlloc"); *pp = (void *)stub_fake_host_ptr(size); return 0;
}
CUresult cuMemAllocHost_v2(void **pp, size_t size) { STUB_CALL("cuMemAllocHost_v2"); *pp = (void *)stub_fake_host_ptr(size); return 0; }
CUresult cuMemFreeHost(void *p) { (void)p; return STUB_RC("cuMemFreeHost"); }
CUresult cuStreamSynchronize(CUstream s) { (void)s; return STUB_RC("cuStreamSynchronize"); }

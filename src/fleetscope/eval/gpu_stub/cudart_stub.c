/* Stand-in for libcudart.so.12 (this machine has no GPU): the real exported
 * names and C signatures, with durations and return codes set by the
 * environment (stub_control.h). Nothing here touches a device.
 *
 * Like the real runtime, it enters the driver: cudaLaunchKernel calls
 * cuLaunchKernel, cudaMalloc cuMemAlloc_v2, cudaMallocHost cuMemAllocHost_v2,
 * and so on, through libcuda.so.1's exported symbols (dlopen()ed from this
 * library's own folder on first use, as libcudart loads libcuda lazily). A
 * tracer probing both libraries must count such a call once.
 * GPU_STUB_RUNTIME_ENTERS_DRIVER=0 turns this off (the runtime then answers alone). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stub_control.h"
typedef int cudaError_t;
typedef struct { unsigned int x, y, z; } dim3;
typedef void *cudaStream_t, *cudaEvent_t, *cudaGraphExec_t;
typedef int cudaMemcpyKind;

/* Loaded once (pthread_once: a multi-threaded workload's first calls may race). */
static void *driver_lib;
static void load_driver(void) {
    const char *env = getenv("GPU_STUB_RUNTIME_ENTERS_DRIVER");
    Dl_info info;
    char path[PATH_MAX];
    if ((env && strcmp(env, "0") == 0) || !dladdr((void *)load_driver, &info) || !info.dli_fname) return;
    const char *slash = strrchr(info.dli_fname, '/');
    if (slash) snprintf(path, sizeof path, "%.*s/libcuda.so.1", (int)(slash - info.dli_fname), info.dli_fname);
    else snprintf(path, sizeof path, "libcuda.so.1");
    driver_lib = dlopen(path, RTLD_NOW);
    if (!driver_lib) fprintf(stderr, "cudart stand-in: cannot load %s: %s\n", path, dlerror());
}
/* libcuda's symbol `name`, or NULL when the runtime answers alone. */
static void *driver(const char *name) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, load_driver);
    return driver_lib ? dlsym(driver_lib, name) : NULL;
}
#define DRIVER(ret, name, ...) ret (*name##_)(__VA_ARGS__) = (ret (*)(__VA_ARGS__))driver(#name)

static cudaError_t launch(struct stub_ctl *ctl, const char *name, const void *func, dim3 g, dim3 b, void **args,
                          size_t shmem, cudaStream_t s) {
    int rc = stub_run(ctl, name);
    DRIVER(int, cuLaunchKernel, const void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
    if (rc == 0 && cuLaunchKernel_)  /* the driver names kernels by CUfunction; the host stub stands in for it */
        rc = cuLaunchKernel_(func, g.x, g.y, g.z, b.x, b.y, b.z, (unsigned)shmem, s, args, NULL);
    return rc;
}
cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t sharedMem, cudaStream_t stream) {
    static struct stub_ctl ctl;
    return launch(&ctl, "cudaLaunchKernel", func, grid, block, args, sharedMem, stream);
}
cudaError_t cudaLaunchCooperativeKernel(const void *func, dim3 grid, dim3 block, void **args, size_t sharedMem, cudaStream_t stream) {
    static struct stub_ctl ctl;
    return launch(&ctl, "cudaLaunchCooperativeKernel", func, grid, block, args, sharedMem, stream);
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) { (void)exec; (void)stream; return STUB_RC("cudaGraphLaunch"); }
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, cudaMemcpyKind kind) {
    (void)dst; (void)src; (void)count; (void)kind; return STUB_RC("cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
    (void)dst; (void)src; (void)count; (void)kind; (void)stream; return STUB_RC("cudaMemcpyAsync");
}
cudaError_t cudaMemset(void *p, int value, size_t count) { (void)p; (void)value; (void)count; return STUB_RC("cudaMemset"); }
cudaError_t cudaMalloc(void **p, size_t size) {
    STUB_CALL("cudaMalloc");
    DRIVER(int, cuMemAlloc_v2, unsigned long long *, size_t);
    if (cuMemAlloc_v2_) {
        unsigned long long d = 0;
        int rc = cuMemAlloc_v2_(&d, size);
        *p = (void *)d;
        return rc;
    }
    *p = (void *)stub_fake_ptr(size);
    return 0;
}
/* Pinned host memory: page-locked host pages the GPU can reach, not device memory. */
cudaError_t cudaMallocHost(void **p, size_t size) {
    STUB_CALL("cudaMallocHost");
    DRIVER(int, cuMemAllocHost_v2, void **, size_t);
    if (cuMemAllocHost_v2_) return cuMemAllocHost_v2_(p, size);
    *p = (void *)stub_fake_host_ptr(size);
    return 0;
}
cudaError_t cudaHostAlloc(void **p, size_t size, unsigned int flags) {
    STUB_CALL("cudaHostAlloc");
    DRIVER(int, cuMemHostAlloc, void **, size_t, unsigned);
    if (cuMemHostAlloc_) return cuMemHostAlloc_(p, size, flags);
    *p = (void *)stub_fake_host_ptr(size);
    return 0;
}
cudaError_t cudaFree(void *p) {
    STUB_CALL("cudaFree");
    DRIVER(int, cuMemFree_v2, unsigned long long);
    return cuMemFree_v2_ ? cuMemFree_v2_((unsigned long long)p) : 0;
}
cudaError_t cudaFreeHost(void *p) {
    STUB_CALL("cudaFreeHost");
    DRIVER(int, cuMemFreeHost, void *);
    return cuMemFreeHost_ ? cuMemFreeHost_(p) : 0;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    STUB_CALL("cudaStreamSynchronize");
    DRIVER(int, cuStreamSynchronize, void *);
    return cuStreamSynchronize_ ? cuStreamSynchronize_(s) : 0;
}
cudaError_t cudaDeviceSynchronize(void) { return STUB_RC("cudaDeviceSynchronize"); }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; return STUB_RC("cudaEventSynchronize"); }
/* Not a CUDA symbol: the runtime control's `knob NAME=VALUE` for the workload
 * (stub_control.h), e.g. how many bytes a leaking step allocates and keeps. */
long gpu_stub_knob(const char *name, long dflt) {
    stub_poll();
    return stub_file.knob[0] ? stub_lookup(stub_file.knob, name, dflt) : dflt;
}

/* Stand-in for libcudart.so.12 (this machine has no GPU): the real exported
 * names and C signatures, with durations and return codes set by the
 * environment (stub_control.h). Nothing here touches a device. */
#include <stddef.h>
#include "stub_control.h"

typedef int cudaError_t;
typedef struct { unsigned int x, y, z; } dim3;
typedef void *cudaStream_t, *cudaEvent_t, *cudaGraphExec_t;
typedef int cudaMemcpyKind;

cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t sharedMem, cudaStream_t stream) {
    (void)func; (void)grid; (void)block; (void)args; (void)sharedMem; (void)stream;
    return STUB_RC("cudaLaunchKernel");
}
cudaError_t cudaLaunchCooperativeKernel(const void *func, dim3 grid, dim3 block, void **args, size_t sharedMem, cudaStream_t stream) {
    (void)func; (void)grid; (void)block; (void)args; (void)sharedMem; (void)stream;
    return STUB_RC("cudaLaunchCooperativeKernel");
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) { (void)exec; (void)stream; return STUB_RC("cudaGraphLaunch"); }
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, cudaMemcpyKind kind) {
    (void)dst; (void)src; (void)count; (void)kind; return STUB_RC("cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
    (void)dst; (void)src; (void)count; (void)kind; (void)stream; return STUB_RC("cudaMemcpyAsync");
}
cudaError_t cudaMemset(void *p, int value, size_t count) { (void)p; (void)value; (void)count; return STUB_RC("cudaMemset"); }
cudaError_t cudaMalloc(void **p, size_t size) { STUB_CALL("cudaMalloc"); *p = (void *)stub_fake_ptr(size); return 0; }
cudaError_t cudaMallocHost(void **p, size_t size) { STUB_CALL("cudaMallocHost"); *p = (void *)stub_fake_ptr(size); return 0; }
cudaError_t cudaFree(void *p) { (void)p; return STUB_RC("cudaFree"); }
cudaError_t cudaFreeHost(void *p) { (void)p; return STUB_RC("cudaFreeHost"); }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; return STUB_RC("cudaStreamSynchronize"); }
cudaError_t cudaDeviceSynchronize(void) { return STUB_RC("cudaDeviceSynchronize"); }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; return STUB_RC("cudaEventSynchronize"); }

/* Not a CUDA symbol: the runtime control's `knob NAME=VALUE` for the workload
 * (stub_control.h), e.g. how many bytes a leaking step allocates and keeps. */
long gpu_stub_knob(const char *name, long dflt) {
    stub_poll();
    return stub_file.knob[0] ? stub_lookup(stub_file.knob, name, dflt) : dflt;
}

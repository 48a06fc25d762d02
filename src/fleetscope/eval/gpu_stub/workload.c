/* A known workload for the CUDA/NCCL stand-ins: it dlopen()s the libraries
 * (optionally late) and calls them in a fixed sequence at a known rate, so a
 * test can predict every call, argument and byte count.
 *
 *   workload MODE LIBDIR ITERS RATE_HZ LOAD [go]
 *     MODE      cuda | nccl | nccl_torch (communicators made as PyTorch makes them:
 *               ncclCommInitRankConfig, then ncclCommSplit, and ncclCommInitAll) |
 *               nccl_sync (libnccl and libcudart: syncs with and without a collective before them) |
 *               launch (a tight cudaLaunchKernel loop, for the benchmark)
 *     ITERS     iterations; -1 runs until killed
 *     RATE_HZ   iterations per second; 0 = as fast as possible
 *     LOAD      0: dlopen at once; wait: print "started", dlopen when a line arrives on
 *               stdin (the late-load test says when; a timer raced a loaded machine)
 *     go        after loading, wait for a line on stdin before calling
 * Prints "loaded" after dlopen and "done ITERS NS_PER_ITER CPU_NS_PER_ITER" at the end
 * (CPU: this thread's own time, probe handling included, preemption excluded). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { unsigned int x, y, z; } dim3;
typedef struct { unsigned int gx, gy, gz, bx, by, bz, shmem; void *stream; void *attrs; unsigned int nattrs; } CUlaunchConfig;
typedef struct { char internal[128]; } ncclUniqueId;

/* Host-side kernel stubs, as nvcc emits them: cudaLaunchKernel receives their
 * address, and the tracer names them from this binary's symbol table. */
__attribute__((noinline, used)) void k_vecadd(void) __asm__("_Z6vecAddPKfS0_Pfi");
__attribute__((noinline, used)) void k_vecadd(void) { __asm__ volatile("" ::: "memory"); }
__attribute__((noinline, used)) void k_relu(void) __asm__("_Z11relu_kernelPfi");
__attribute__((noinline, used)) void k_relu(void) { __asm__ volatile("nop" ::: "memory"); }

static void *lib(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    void *h = dlopen(path, RTLD_NOW);
    if (!h) { fprintf(stderr, "dlopen %s: %s\n", path, dlerror()); exit(2); }
    return h;
}
static void *sym(void *h, const char *name) {
    void *f = dlsym(h, name);
    if (!f) { fprintf(stderr, "dlsym %s: %s\n", name, dlerror()); exit(2); }
    return f;
}
static long clock_ns(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}
#define now_ns() clock_ns(CLOCK_MONOTONIC)

#define S ((void *)0x5a5a)   /* the stream every async call uses */
/* Looked up per iteration: a few dlsym calls, small next to a probe hit. */
#define F(ret, name, ...) ret (*name)(__VA_ARGS__) = sym(h, #name)

static void (*iteration)(long i);
static int torch_style;  /* nccl_torch mode */
static void *rt, *drv, *nc;

static void cuda_iter(long i) {
    void *h = rt;
    F(int, cudaMalloc, void **, size_t);
    F(int, cudaMallocHost, void **, size_t);
    F(int, cudaHostAlloc, void **, size_t, unsigned);
    F(int, cudaMemcpy, void *, const void *, size_t, int);
    F(int, cudaMemcpyAsync, void *, const void *, size_t, int, void *);
    F(int, cudaMemset, void *, int, size_t);
    F(int, cudaLaunchKernel, const void *, dim3, dim3, void **, size_t, void *);
    F(int, cudaLaunchCooperativeKernel, const void *, dim3, dim3, void **, size_t, void *);
    F(int, cudaGraphLaunch, void *, void *);
    F(int, cudaStreamSynchronize, void *);
    F(int, cudaDeviceSynchronize, void);
    F(int, cudaEventSynchronize, void *);
    F(int, cudaFree, void *);
    F(int, cudaFreeHost, void *);
    h = drv;
    F(int, cuMemAlloc_v2, unsigned long long *, size_t);
    F(int, cuMemFree_v2, unsigned long long);
    F(int, cuLaunchKernel, void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
    F(int, cuLaunchKernelEx, const CUlaunchConfig *, void *, void **, void **);
    F(int, cuStreamSynchronize, void *);
    void *d = 0, *host = 0, *mapped = 0, *args[1] = {0};
    cudaMalloc(&d, 1 << 20);
    cudaMallocHost(&host, 65536);                 /* pinned host memory, not device memory */
    cudaHostAlloc(&mapped, 32768, 2);             /* pinned too (cudaHostAllocMapped) */
    cudaMemcpy(d, host, 4096, 1);                 /* HtoD */
    cudaMemcpyAsync(host, d, 8192, 2, S);         /* DtoH */
    cudaMemcpy(d, d, 1000, 3);                    /* DtoD */
    cudaMemset(d, 0, 512);
    for (int k = 0; k < 3; k++)
        cudaLaunchKernel((void *)k_vecadd, (dim3){4, 2, 1}, (dim3){128, 1, 1}, args, 256, S);
    cudaLaunchKernel((void *)k_relu, (dim3){1, 1, 1}, (dim3){32, 8, 1}, args, 0, 0);
    cudaLaunchCooperativeKernel((void *)k_relu, (dim3){2, 1, 1}, (dim3){64, 1, 1}, args, 0, S);
    cudaGraphLaunch((void *)0x6000, S);
    cudaStreamSynchronize(S);
    cudaDeviceSynchronize();
    cudaEventSynchronize((void *)0x7000);
    if (i % 2 == 0) cudaFree(d);                  /* odd iterations leak 1 MiB */
    cudaFreeHost(host);
    if (i % 2 == 0) cudaFreeHost(mapped);         /* odd iterations leak 32 KiB of pinned memory */
    unsigned long long dd = 0;
    cuMemAlloc_v2(&dd, 2048);
    cuLaunchKernel((void *)0xf00d, 2, 3, 4, 64, 2, 1, 128, S, args, 0);
    CUlaunchConfig cfg = {8, 1, 1, 256, 1, 1, 0, S, 0, 0};
    cuLaunchKernelEx(&cfg, (void *)0xbeef, args, 0);
    cuStreamSynchronize(S);
    cuMemFree_v2(dd);
}

static void nccl_iter(long i) {
    void *h = nc;
    F(int, ncclCommInitRank, void **, int, ncclUniqueId, int);
    F(int, ncclAllReduce, const void *, void *, size_t, int, int, void *, void *);
    F(int, ncclAllGather, const void *, void *, size_t, int, void *, void *);
    F(int, ncclReduceScatter, const void *, void *, size_t, int, int, void *, void *);
    F(int, ncclBroadcast, const void *, void *, size_t, int, int, void *, void *);
    F(int, ncclReduce, const void *, void *, size_t, int, int, int, void *, void *);
    F(int, ncclSend, const void *, size_t, int, int, void *, void *);
    F(int, ncclRecv, void *, size_t, int, int, void *, void *);
    F(int, ncclGroupStart, void);
    F(int, ncclGroupEnd, void);
    F(int, ncclCommInitRankConfig, void **, int, ncclUniqueId, int, void *);
    F(int, ncclCommSplit, void *, int, int, void **, void *);
    F(int, ncclCommInitAll, void **, int, const int *);
    static void *comm, *p2p;
    static char buf[8192];
    if (i == 0) {
        ncclUniqueId id;
        memset(&id, 0x11, sizeof id);
        if (torch_style) {
            char config[64] = {0};                           /* an ncclConfig_t, as NCCL_CONFIG_INITIALIZER */
            void *left_out = (void *)1, *pair[2] = {0};
            ncclCommInitRankConfig(&comm, 4, id, 2, config);  /* rank 2 of 4 */
            ncclCommSplit(comm, 7, 1, &p2p, config);          /* a subgroup: rank 1 (the key) */
            ncclCommSplit(comm, -1, 0, &left_out, config);    /* NCCL_SPLIT_NOCOLOR: not a member */
            ncclCommInitAll(pair, 2, NULL);                   /* single-process: ranks 0 and 1 of 2 */
        } else {
            ncclCommInitRank(&comm, 4, id, 2);
            p2p = comm;
        }
    }
    ncclAllReduce(buf, buf, 1000, 7, 0, comm, S);     /* float32: 4000 B */
    ncclAllGather(buf, buf, 256, 6, comm, S);         /* float16: 512 B */
    ncclReduceScatter(buf, buf, 100, 8, 0, comm, S);  /* float64: 800 B */
    ncclBroadcast(buf, buf, 10, 0, 1, comm, S);       /* int8: 10 B, root 1 */
    ncclReduce(buf, buf, 50, 4, 2, 0, comm, S);       /* int64: 400 B, max, root 0 */
    ncclGroupStart();
    ncclSend(buf, 64, 2, 3, p2p, S);                  /* int32: 256 B to peer 3 */
    ncclRecv(buf, 32, 9, 1, p2p, S);                  /* bfloat16: 64 B from peer 1 */
    ncclGroupEnd();
}

/* Per iteration: a sync with no collective before it, an all-reduce, the sync
 * that waits for it, and a second sync (not the collective's). Set the syncs'
 * durations apart (GPU_STUB_DELAY_US) to tell which were counted. */
static void nccl_sync_iter(long i) {
    void *h = rt;
    F(int, cudaStreamSynchronize, void *);
    F(int, cudaDeviceSynchronize, void);
    F(int, cudaEventSynchronize, void *);
    h = nc;
    F(int, ncclCommInitRank, void **, int, ncclUniqueId, int);
    F(int, ncclAllReduce, const void *, void *, size_t, int, int, void *, void *);
    static void *comm;
    static char buf[4096];
    if (i == 0) {
        ncclUniqueId id;
        memset(&id, 0x11, sizeof id);
        ncclCommInitRank(&comm, 2, id, 0);
    }
    cudaEventSynchronize((void *)0x7000);
    ncclAllReduce(buf, buf, 1000, 7, 0, comm, S);
    cudaStreamSynchronize(S);
    cudaDeviceSynchronize();
}

static void launch_iter(long i) {
    static int (*launch)(const void *, dim3, dim3, void **, size_t, void *);
    if (!launch) launch = sym(rt, "cudaLaunchKernel");
    (void)i;
    launch((void *)k_vecadd, (dim3){4, 2, 1}, (dim3){128, 1, 1}, 0, 256, S);
}

int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage: workload cuda|nccl|launch LIBDIR ITERS RATE_HZ 0|wait [go]\n"); return 2; }
    const char *mode = argv[1], *dir = argv[2];
    long iters = atol(argv[3]), rate = atol(argv[4]);
    int go = argc > 6 && strcmp(argv[6], "go") == 0;
    if (strcmp(argv[5], "wait") == 0) {
        char line[64];
        printf("started\n");
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin)) return 3;
    }
    if (strncmp(mode, "nccl", 4) == 0) {
        nc = lib(dir, "libnccl.so.2");
        iteration = nccl_iter;
        torch_style = strcmp(mode, "nccl_torch") == 0;
        if (strcmp(mode, "nccl_sync") == 0) { rt = lib(dir, "libcudart.so.12"); iteration = nccl_sync_iter; }
    }
    else {
        rt = lib(dir, "libcudart.so.12");
        if (strcmp(mode, "cuda") == 0) { drv = lib(dir, "libcuda.so.1"); iteration = cuda_iter; }
        else iteration = launch_iter;
    }
    printf("loaded\n");
    fflush(stdout);
    if (go) {
        char line[64];
        if (!fgets(line, sizeof line, stdin)) return 3;
    }
    long cpu_start = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    long start = now_ns(), period = rate > 0 ? 1000000000L / rate : 0;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    long i;
    for (i = 0; iters < 0 || i < iters; i++) {
        iteration(i);
        if (period) {
            next.tv_nsec += period;
            while (next.tv_nsec >= 1000000000L) { next.tv_nsec -= 1000000000L; next.tv_sec++; }
            clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
        }
    }
    long ns = now_ns() - start, cpu = clock_ns(CLOCK_THREAD_CPUTIME_ID) - cpu_start;
    printf("done %ld %.1f %.1f\n", i, i ? (double)ns / i : 0.0, i ? (double)cpu / i : 0.0);
    fflush(stdout);
    return 0;
}

/* CUDA runtime (libcudart) and driver (libcuda) calls, by uprobe+uretprobe
 * pairs attached per traced pid as uprobe_multi links: per process, family and
 * library one link runs on_call at every entry and one runs on_return at every
 * return, each probe's BPF cookie naming its API. API_* and FAM_* ids come
 * from producers/tracers/cuda.py as -D flags, so the two can never disagree.
 *
 * Entry stores the arguments in `inflight` (key = pid_tgid; driver calls set
 * bit 63 so a runtime call that enters the driver inside it keeps its own
 * slot). Return pairs with it and aggregates into maps that user space reads
 * once per sample: nothing leaves the kernel per call unless DETAIL is set,
 * which adds one ring-buffer record per call while the detail gate
 * (detail_until in gpu_calls.bpf.c) is open.
 *
 * The runtime enters the driver through its exported symbols (cudaMalloc
 * calls cuMemAlloc_v2, cudaLaunchKernel cuLaunchKernel): a driver call made
 * while a runtime call of the same family is in flight on the thread is the
 * runtime call's own work and is not counted again (its probe still counts a
 * hit: it still costs). The runtime call's entry in `inflight` is the flag,
 * so no extra map and nothing to clear: its return takes it away. If a
 * runtime probe was detached mid-call the stale entry is overwritten by the
 * thread's next runtime call of any family.
 *
 * Pinned host memory (cudaMallocHost, cudaHostAlloc, cuMemHostAlloc,
 * cuMemAllocHost) is counted apart from device memory: `allocs` keys carry
 * the kind (ALLOC_DEVICE / ALLOC_PINNED) so a free finds its own kind. */
/* Prepended by producers/tracers/gpu_calls.py: bpf/gpu_calls.bpf.c (inflight,
 * stats, hits, lost, calls; count_lost, gpu_call_enter/take/record). */

#define DRIVER_TAG (1ULL << 63)
#define ALLOC_DEVICE 0
#define ALLOC_PINNED 1

BPF_HASH(launches, struct gpu_sub_key, u64, 16384);    /* (pid, api, host stub or CUfunction) -> calls */
BPF_HASH(memcpy_kind, struct gpu_sub_key, u64, 1024);  /* (pid, api, cudaMemcpyKind) -> bytes */
BPF_HASH(allocs, struct gpu_sub_key, u64, 262144);     /* (pid, ALLOC_*, pointer) -> size, live allocations */
BPF_HASH(mem, u32, struct cuda_mem_stats, 1024);       /* per pid */
struct nccl_sync_stats { u64 wait_ns, syncs; };        /* cumulative */
BPF_HASH(nccl_sync, u32, struct nccl_sync_stats, 1024); /* per pid: syncs that followed a collective */

/* bcc rewrites map calls only outside macros, and its increment() cannot
 * report a full map: these add with loss counting. */
static __always_inline void add_launch(struct gpu_sub_key *k) {
    u64 zero = 0, *p = launches.lookup_or_try_init(k, &zero);
    if (p)
        __sync_fetch_and_add(p, 1);
    else
        count_lost();
}

static __always_inline void add_copy(struct gpu_sub_key *k, u64 bytes) {
    u64 zero = 0, *p = memcpy_kind.lookup_or_try_init(k, &zero);
    if (p)
        __sync_fetch_and_add(p, bytes);
    else
        count_lost();
}

static __always_inline int enter(u32 api, u32 family, u64 tag, u64 a0, u64 a1, u64 a2, u64 a3, u64 a4, u64 a5) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    if (tag) {  /* a driver call: inside a runtime call of its family it is that call's own work */
        struct gpu_inflight *rt = inflight.lookup(&pid_tgid);
        if (rt && rt->family == family) {
            hits.increment(family);
            return 0;
        }
    }
    return gpu_call_enter(pid_tgid | tag, api, family, a0, a1, a2, a3, a4, a5);
}

static __always_inline void add_mem(u32 pid, u32 kind, u64 malloc_bytes, u64 free_bytes) {
    struct cuda_mem_stats z = {};
    struct cuda_mem_stats *m = mem.lookup_or_try_init(&pid, &z);
    if (!m) {
        count_lost();
        return;
    }
    if (kind == ALLOC_PINNED) {
        if (malloc_bytes) {
            __sync_fetch_and_add(&m->pinned_bytes, malloc_bytes);
            __sync_fetch_and_add(&m->pinned_allocs, 1);
        } else {
            __sync_fetch_and_add(&m->pinned_free_bytes, free_bytes);
            __sync_fetch_and_add(&m->pinned_frees, 1);
        }
    } else if (malloc_bytes) {
        __sync_fetch_and_add(&m->malloc_bytes, malloc_bytes);
        __sync_fetch_and_add(&m->mallocs, 1);
    } else {
        __sync_fetch_and_add(&m->free_bytes, free_bytes);
        __sync_fetch_and_add(&m->frees, 1);
    }
}

/* A successful allocation: the pointer from its out-parameter, remembered with its size and kind. */
static __always_inline void note_alloc(u32 pid, u32 kind, struct gpu_inflight *f, u64 bytes) {
    u64 ptr = 0;
    bpf_probe_read_user(&ptr, sizeof(ptr), (void *)f->arg[0]);
    f->arg[0] = ptr;  /* the detail record shows the allocation, not its out-parameter */
    struct gpu_sub_key ak = {.pid = pid, .api = kind, .sub = ptr};
    if (allocs.update(&ak, &bytes) != 0)
        count_lost();
    else
        add_mem(pid, kind, bytes, 0);
}

/* A successful free: its size if the allocation was seen (those made before tracing began were not). */
static __always_inline u64 note_free(u32 pid, u32 kind, u64 ptr) {
    struct gpu_sub_key ak = {.pid = pid, .api = kind, .sub = ptr};
    u64 *size = allocs.lookup(&ak);
    if (!size)
        return 0;
    u64 bytes = *size;
    allocs.delete(&ak);
    add_mem(pid, kind, 0, bytes);
    return bytes;
}

/* A sync call's time is the host's wait for what it waits on. The first sync a
 * thread makes after an NCCL call that enqueued work (the NCCL program's mark
 * in nccl_enqueued, see gpu_calls.bpf.c) waits for that collective, which the
 * NCCL call itself only enqueued: its wait counts, and the mark is cleared (to
 * 0, in place: no map churn per step), so later syncs and syncs with no
 * collective before them do not. */
static __always_inline void note_sync(u32 pid, u64 pid_tgid, struct gpu_inflight *f, u64 dur) {
    u64 *done = nccl_enqueued.lookup(&pid_tgid);
    if (!done || !*done || *done > f->ts)
        return;
    *done = 0;
    struct nccl_sync_stats z = {};
    struct nccl_sync_stats *s = nccl_sync.lookup_or_try_init(&pid, &z);
    if (!s) {
        count_lost();
        return;
    }
    __sync_fetch_and_add(&s->wait_ns, dur);
    __sync_fetch_and_add(&s->syncs, 1);
}

static __always_inline int leave(struct pt_regs *ctx, u64 tag) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    struct gpu_inflight f;
    u64 dur;
    if (!gpu_call_take(pid_tgid | tag, &f, &dur))
        return 0;
    s32 rc = PT_REGS_RC(ctx);
    u32 pid = pid_tgid >> 32;
    u64 bytes = 0;
    struct gpu_sub_key sk = {.pid = pid, .api = f.api};
    switch (f.api) {
    case API_cudaLaunchKernel: case API_cudaLaunchCooperativeKernel:
    case API_cuLaunchKernel: case API_cuLaunchKernelEx:
        sk.sub = f.arg[0];
        add_launch(&sk);
        break;
    case API_cudaMemcpy: case API_cudaMemcpyAsync:
        bytes = f.arg[2];
        sk.sub = f.arg[3];
        if (rc == 0)
            add_copy(&sk, bytes);
        break;
    case API_cudaMemset:
        bytes = f.arg[2];
        break;
    case API_cudaMalloc: case API_cuMemAlloc_v2:
        bytes = f.arg[1];
        if (rc == 0)
            note_alloc(pid, ALLOC_DEVICE, &f, bytes);
        break;
    case API_cudaMallocHost: case API_cudaHostAlloc: case API_cuMemHostAlloc: case API_cuMemAllocHost_v2:
        bytes = f.arg[1];
        if (rc == 0)
            note_alloc(pid, ALLOC_PINNED, &f, bytes);
        break;
    case API_cudaFree: case API_cuMemFree_v2:
        if (rc == 0)
            bytes = note_free(pid, ALLOC_DEVICE, f.arg[0]);
        f.arg[1] = bytes;
        break;
    case API_cudaFreeHost: case API_cuMemFreeHost:
        if (rc == 0)
            bytes = note_free(pid, ALLOC_PINNED, f.arg[0]);
        f.arg[1] = bytes;
        break;
    }
    if (f.family == FAM_sync)
        note_sync(pid, pid_tgid, &f, dur);
    gpu_call_record(pid_tgid, &f, dur, rc, bytes);
    return 0;
}

/* The one return program: the cookie is the entry's (API id, bit 63 for driver calls). */
int on_return(struct pt_regs *ctx) { return leave(ctx, bpf_get_attach_cookie(ctx) & DRIVER_TAG); }

/* Stack arguments: at a uprobe on the first instruction, [sp] is the return
 * address and the 7th, 8th, ... integer arguments follow. Read only in DETAIL,
 * whether the detail gate is open or not: a call that enters while it is
 * closed and returns once it is open still gets its full record. */
static __always_inline void stack_args(struct pt_regs *ctx, u64 *out, int n) {
#ifdef DETAIL
    bpf_probe_read_user(out, n * sizeof(u64), (void *)(PT_REGS_SP(ctx) + 8));
#endif
}

/* cudaLaunchKernel(func, dim3 grid, dim3 block, args, sharedMem, stream): each
 * 12-byte dim3 travels in two registers (x|y<<32, z). Recorded as
 * [func, grid x|y<<32, grid z|block z<<32, block x|y<<32, sharedMem, stream]. */
static __always_inline int enter_launch(struct pt_regs *ctx, u32 api) {
    u64 st[2] = {};
    stack_args(ctx, st, 2);
    return enter(api, FAM_launch, 0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx),
                 (PT_REGS_PARM3(ctx) & 0xffffffff) | (PT_REGS_PARM5(ctx) << 32), PT_REGS_PARM4(ctx), st[0], st[1]);
}
static __always_inline int on_cudaLaunchKernel(struct pt_regs *ctx) { return enter_launch(ctx, API_cudaLaunchKernel); }
static __always_inline int on_cudaLaunchCooperativeKernel(struct pt_regs *ctx) { return enter_launch(ctx, API_cudaLaunchCooperativeKernel); }
static __always_inline int on_cudaGraphLaunch(struct pt_regs *ctx) {
    return enter(API_cudaGraphLaunch, FAM_launch, 0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, 0, 0, 0);
}
/* cudaMemcpy(dst, src, count, kind), cudaMemcpyAsync(..., stream) */
static __always_inline int on_cudaMemcpy(struct pt_regs *ctx) {
    return enter(API_cudaMemcpy, FAM_memory, 0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                 PT_REGS_PARM4(ctx), 0, 0);
}
static __always_inline int on_cudaMemcpyAsync(struct pt_regs *ctx) {
    return enter(API_cudaMemcpyAsync, FAM_memory, 0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                 PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), 0);
}
/* cudaMemset(ptr, value, count) */
static __always_inline int on_cudaMemset(struct pt_regs *ctx) {
    return enter(API_cudaMemset, FAM_memory, 0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), 0, 0, 0);
}
/* Allocators (void **out, size) and frees (ptr). */
static __always_inline int on_cudaMalloc(struct pt_regs *ctx) {
    return enter(API_cudaMalloc, FAM_memory, 0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, 0, 0, 0);
}
static __always_inline int on_cudaMallocHost(struct pt_regs *ctx) {
    return enter(API_cudaMallocHost, FAM_memory, 0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, 0, 0, 0);
}
static __always_inline int on_cudaHostAlloc(struct pt_regs *ctx) {  /* (void **out, size, flags) */
    return enter(API_cudaHostAlloc, FAM_memory, 0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), 0, 0, 0);
}
static __always_inline int on_cudaFree(struct pt_regs *ctx) { return enter(API_cudaFree, FAM_memory, 0, PT_REGS_PARM1(ctx), 0, 0, 0, 0, 0); }
static __always_inline int on_cudaFreeHost(struct pt_regs *ctx) {
    return enter(API_cudaFreeHost, FAM_memory, 0, PT_REGS_PARM1(ctx), 0, 0, 0, 0, 0);
}
/* Synchronization: the stream or event waited on (none for the device). */
static __always_inline int on_cudaStreamSynchronize(struct pt_regs *ctx) {
    return enter(API_cudaStreamSynchronize, FAM_sync, 0, PT_REGS_PARM1(ctx), 0, 0, 0, 0, 0);
}
static __always_inline int on_cudaDeviceSynchronize(struct pt_regs *ctx) { return enter(API_cudaDeviceSynchronize, FAM_sync, 0, 0, 0, 0, 0, 0, 0); }
static __always_inline int on_cudaEventSynchronize(struct pt_regs *ctx) {
    return enter(API_cudaEventSynchronize, FAM_sync, 0, PT_REGS_PARM1(ctx), 0, 0, 0, 0, 0);
}

/* Driver. cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sharedMem, stream, params, extra):
 * bz, sharedMem and stream are on the stack. Same record layout as the runtime launch. */
static __always_inline int on_cuLaunchKernel(struct pt_regs *ctx) {
    u64 st[3] = {};
    stack_args(ctx, st, 3);
    return enter(API_cuLaunchKernel, FAM_launch, DRIVER_TAG, PT_REGS_PARM1(ctx),
                 (PT_REGS_PARM2(ctx) & 0xffffffff) | (PT_REGS_PARM3(ctx) << 32),
                 (PT_REGS_PARM4(ctx) & 0xffffffff) | (st[0] << 32),
                 (PT_REGS_PARM5(ctx) & 0xffffffff) | (PT_REGS_PARM6(ctx) << 32), st[1] & 0xffffffff, st[2]);
}
/* cuLaunchKernelEx(const CUlaunchConfig *config, f, params, extra): dims,
 * sharedMem and stream come from the config struct (CUDA 12 layout). */
static __always_inline int on_cuLaunchKernelEx(struct pt_regs *ctx) {
    u32 c[8] = {};
    u64 stream = 0;
#ifdef DETAIL
    bpf_probe_read_user(c, 7 * sizeof(u32), (void *)PT_REGS_PARM1(ctx));
    bpf_probe_read_user(&stream, sizeof(stream), (void *)(PT_REGS_PARM1(ctx) + 32));
#endif
    return enter(API_cuLaunchKernelEx, FAM_launch, DRIVER_TAG, PT_REGS_PARM2(ctx),
                 c[0] | ((u64)c[1] << 32), c[2] | ((u64)c[5] << 32), c[3] | ((u64)c[4] << 32), c[6], stream);
}
static __always_inline int on_cuMemAlloc_v2(struct pt_regs *ctx) {
    return enter(API_cuMemAlloc_v2, FAM_memory, DRIVER_TAG, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, 0, 0, 0);
}
static __always_inline int on_cuMemFree_v2(struct pt_regs *ctx) {
    return enter(API_cuMemFree_v2, FAM_memory, DRIVER_TAG, PT_REGS_PARM1(ctx), 0, 0, 0, 0, 0);
}
/* cuMemHostAlloc(void **out, size, flags), cuMemAllocHost_v2(void **out, size), cuMemFreeHost(p) */
static __always_inline int on_cuMemHostAlloc(struct pt_regs *ctx) {
    return enter(API_cuMemHostAlloc, FAM_memory, DRIVER_TAG, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), 0, 0, 0);
}
static __always_inline int on_cuMemAllocHost_v2(struct pt_regs *ctx) {
    return enter(API_cuMemAllocHost_v2, FAM_memory, DRIVER_TAG, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, 0, 0, 0);
}
static __always_inline int on_cuMemFreeHost(struct pt_regs *ctx) {
    return enter(API_cuMemFreeHost, FAM_memory, DRIVER_TAG, PT_REGS_PARM1(ctx), 0, 0, 0, 0, 0);
}
static __always_inline int on_cuStreamSynchronize(struct pt_regs *ctx) {
    return enter(API_cuStreamSynchronize, FAM_sync, DRIVER_TAG, PT_REGS_PARM1(ctx), 0, 0, 0, 0, 0);
}

/* The one entry program of every link: the probe's BPF cookie names the API
 * (its id in the tracer's table; bit 63 marks a driver call). */
int on_call(struct pt_regs *ctx) {
    switch ((u32)bpf_get_attach_cookie(ctx)) {
    case API_cudaLaunchKernel: return on_cudaLaunchKernel(ctx);
    case API_cudaLaunchCooperativeKernel: return on_cudaLaunchCooperativeKernel(ctx);
    case API_cudaGraphLaunch: return on_cudaGraphLaunch(ctx);
    case API_cudaMemcpy: return on_cudaMemcpy(ctx);
    case API_cudaMemcpyAsync: return on_cudaMemcpyAsync(ctx);
    case API_cudaMemset: return on_cudaMemset(ctx);
    case API_cudaMalloc: return on_cudaMalloc(ctx);
    case API_cudaMallocHost: return on_cudaMallocHost(ctx);
    case API_cudaHostAlloc: return on_cudaHostAlloc(ctx);
    case API_cudaFree: return on_cudaFree(ctx);
    case API_cudaFreeHost: return on_cudaFreeHost(ctx);
    case API_cudaStreamSynchronize: return on_cudaStreamSynchronize(ctx);
    case API_cudaDeviceSynchronize: return on_cudaDeviceSynchronize(ctx);
    case API_cudaEventSynchronize: return on_cudaEventSynchronize(ctx);
    case API_cuLaunchKernel: return on_cuLaunchKernel(ctx);
    case API_cuLaunchKernelEx: return on_cuLaunchKernelEx(ctx);
    case API_cuMemAlloc_v2: return on_cuMemAlloc_v2(ctx);
    case API_cuMemFree_v2: return on_cuMemFree_v2(ctx);
    case API_cuMemHostAlloc: return on_cuMemHostAlloc(ctx);
    case API_cuMemAllocHost_v2: return on_cuMemAllocHost_v2(ctx);
    case API_cuMemFreeHost: return on_cuMemFreeHost(ctx);
    case API_cuStreamSynchronize: return on_cuStreamSynchronize(ctx);
    }
    return 0;
}

/* Structs shared by bpf/kernel.bpf.c and producers/tracers/kernel.py.
 * bcc derives the Python ctypes for map keys and values from these, so user
 * space never restates a layout by hand. */
#ifndef FLEETSCOPE_EVENTS_H
#define FLEETSCOPE_EVENTS_H

/* A thread that left the CPU: when, and which process it belongs to (the
 * switch-in side only knows the thread id). */
struct offcpu_start {
    u64 ts;
    u32 tgid;
    u32 preempted;  /* left while still runnable: waiting for a CPU, not for I/O or a lock */
};

/* One TCP connection. Addresses are raw network-order bytes; IPv4 uses the
 * first 4. Ports are host order (the tracepoint converts them). */
struct tcp_conn {
    u8 saddr[16];
    u8 daddr[16];
    u16 sport;
    u16 dport;
    u16 family;
    u16 pad;
};

/* ---- Python VM (bpf/python.bpf.c, producers/tracers/python_vm.py) ----
 * A Python function is keyed by the addresses of its file and function name
 * strings (the UTF-8 buffers of the interned co_filename / co_name), so the
 * hot path hashes three integers and never copies a string; the strings are
 * read once, when a key is first seen. */
#define PY_STACK_MAX 32
#define PY_FILE_LEN 160
#define PY_NAME_LEN 64
#define PY_PREFIX_MAX 8

struct py_func_key {
    u32 pid;
    u32 pad;
    u64 file;
    u64 name;
};

struct py_func_stats {
    u64 calls;      /* function__entry hits, cumulative */
    u64 returns;    /* function__return hits, cumulative */
    u64 ns;         /* inclusive time of matched entry/return pairs */
    u32 skip;       /* 1: file outside the configured prefixes (not counted) */
    u32 pad;
};

struct py_func_name {
    char file[PY_FILE_LEN];
    char name[PY_NAME_LEN];
};

/* Per-thread call stack of traced frames, for inclusive time. */
struct py_stack {
    u32 depth;      /* true depth; only the first PY_STACK_MAX frames are timed */
    u32 pad;
    u64 ts[PY_STACK_MAX];
    u64 file[PY_STACK_MAX];
    u64 name[PY_STACK_MAX];
};

struct py_prefix {
    u32 len;
    u32 pad;
    char text[PY_FILE_LEN];
};

struct py_gc_stats {
    u64 count;
    u64 ns;
};

/* ---- PyTorch ops (bpf/torch.bpf.c, producers/tracers/torch_ops.py) ----
 * One uprobe per op wrapper symbol; the op is the probe's BPF cookie. */
struct torch_op_key {
    u32 pid;
    u32 op;         /* index into the tracer's op names (the attach cookie) */
};

struct torch_op_stats {
    u64 calls;
    u64 ns;
};

struct torch_frame {
    u64 ts;
    u64 op;
};

/* ---- GPU calls: CUDA runtime/driver and NCCL (bpf/cuda.bpf.c, bpf/nccl.bpf.c,
 * producers/tracers/cuda.py, nccl.py, gpu_calls.py) ----
 * Entry saves the arguments in a per-thread hash (key = pid_tgid); return
 * pairs with it and adds duration, return code and bytes to per-(pid, api)
 * stats, so the hot path never leaves the kernel. Latency goes into a
 * quarter-octave histogram: bucket = 4*log2(ns) + the next two bits
 * (values < 4 ns: bucket = ns), so a bucket spans at most 25% of its value. */
#define GPU_LAT_BUCKETS 128
#define GPU_CALL_ARGS 6

struct gpu_call_key {
    u32 pid;
    u32 api;        /* the tracer's API id (cuda.py / nccl.py tables) */
};

/* A finer key: (pid, api, something), e.g. kernel function, memcpy kind, peer, comm. */
struct gpu_sub_key {
    u32 pid;
    u32 api;
    u64 sub;
};

struct gpu_call_stats {  /* cumulative */
    u64 calls;
    u64 dur_ns;
    u64 errors;     /* return code != 0 */
    u64 bytes;
    u64 lat[GPU_LAT_BUCKETS];
};

struct gpu_inflight {
    u64 ts;
    u32 api;
    u32 family;     /* a driver call inside a runtime call of the same family is not counted again */
    u64 arg[GPU_CALL_ARGS];
};

/* One decoded call, sent only in detail mode (a ring buffer), for tests and debugging. */
struct gpu_call_event {
    u64 ts;         /* entry, bpf_ktime_get_ns */
    u64 dur_ns;
    u32 pid;
    u32 tid;
    u32 api;
    s32 rc;
    u64 arg[GPU_CALL_ARGS];
};

struct cuda_mem_stats {  /* per pid, cumulative; live = malloc - free */
    u64 malloc_bytes;       /* device memory */
    u64 free_bytes;
    u64 mallocs;
    u64 frees;
    u64 pinned_bytes;       /* page-locked host memory (cudaMallocHost, cudaHostAlloc, cuMemHostAlloc) */
    u64 pinned_free_bytes;
    u64 pinned_allocs;
    u64 pinned_frees;
};

struct nccl_comm_info {
    s32 rank;
    s32 nranks;
    u64 uid;        /* the communicator's identity across ranks (bpf/nccl.bpf.c: comm_uid); 0: unknown */
};

/* A communicator's collective sequence (bpf/nccl.bpf.c): the n-th collective a process entered on it
 * since its init, the same n on every rank of it, and the entry times of the latest marked ones
 * (every 2^shift-th, in a ring of NCCL_SEQ_MARKS; the shift is user space's, in map seq_shift). */
#define NCCL_SEQ_MARKS 64
struct nccl_seq_mark {
    u64 seq;
    u64 ts;         /* entry, bpf_ktime_get_ns */
};

struct nccl_comm_seq {
    u64 uid;
    u64 seq;
    struct nccl_seq_mark marks[NCCL_SEQ_MARKS];
};

static __always_inline u32 gpu_lat_bucket(u64 ns) {
    if (ns < 4)
        return ns;
    if (ns >> 32)
        return GPU_LAT_BUCKETS - 1;
    u32 l = bpf_log2l(ns) - 1;  /* bcc's bpf_log2l is floor(log2) + 1 */
    return l * 4 + ((ns >> (l - 2)) & 3);
}

static __always_inline void gpu_event_fill(struct gpu_call_event *e, struct gpu_inflight *f, u64 dur,
                                           u64 pid_tgid, s32 rc) {
    e->ts = f->ts;
    e->dur_ns = dur;
    e->pid = pid_tgid >> 32;
    e->tid = (u32)pid_tgid;
    e->api = f->api;
    e->rc = rc;
    __builtin_memcpy(e->arg, f->arg, sizeof(e->arg));
}

static __always_inline void gpu_stats_add(struct gpu_call_stats *s, u64 dur, s32 rc, u64 bytes) {
    __sync_fetch_and_add(&s->calls, 1);
    __sync_fetch_and_add(&s->dur_ns, dur);
    __sync_fetch_and_add(&s->bytes, bytes);
    if (rc != 0)
        __sync_fetch_and_add(&s->errors, 1);
    u32 b = gpu_lat_bucket(dur) & (GPU_LAT_BUCKETS - 1);  /* a no-op mask the verifier can see */
    __sync_fetch_and_add(&s->lat[b], 1);
}

#endif

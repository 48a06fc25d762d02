/* NCCL calls (libnccl), by uprobe+uretprobe pairs attached per traced pid as
 * uprobe_multi links (entry program on_call, return program on_return; each
 * probe's BPF cookie is its API id).
 * API_* and FAM_* ids come from producers/tracers/nccl.py as -D flags.
 * Same pairing as bpf/cuda.bpf.c: entry saves the arguments per thread
 * (key = pid_tgid), return adds duration, return code and bytes to maps. */
/* Prepended by producers/tracers/gpu_calls.py: bpf/gpu_calls.bpf.c (inflight,
 * stats, hits, lost, calls; count_lost, gpu_call_enter/take/record). */

#define NONE ((u64)-1)
#define INIT_ALL_MAX 16  /* ncclCommInitAll: communicators read per call (one per local GPU) */

BPF_HASH(peer_bytes, struct gpu_sub_key, u64, 4096);        /* (pid, Send/Recv, peer) -> bytes */
BPF_HASH(comms, struct gpu_sub_key, struct nccl_comm_info, 1024);  /* (pid, 0, comm) -> rank, nranks, uid */
/* (pid, 0, comm) -> its collective sequence, for communicators whose init was traced (so every rank
 * counts from the same first collective); producers/tracers/nccl.py reads the marks. */
BPF_HASH(comm_seq, struct gpu_sub_key, struct nccl_comm_seq, 1024);
BPF_HASH(seq_shift, struct gpu_sub_key, u64, 1024);      /* (pid, 0, comm) -> mark every 2^shift-th; user space's */
BPF_ARRAY(zero_seq, struct nccl_comm_seq, 1);             /* an initial value too big for the stack */

/* ncclDataType_t -> bytes per element (NCCL 2.x numbering). */
static __always_inline u64 dtype_size(u64 dt) {
    switch (dt) {
    case 0: case 1: case 10: case 11: return 1;   /* int8, uint8, fp8 e4m3, fp8 e5m2 */
    case 6: case 9: return 2;                     /* float16, bfloat16 */
    case 2: case 3: case 7: return 4;             /* int32, uint32, float32 */
    case 4: case 5: case 8: return 8;             /* int64, uint64, float64 */
    }
    return 0;
}

/* Record layout: [count, datatype, op, peer or root, comm, stream]; NONE where the call has none. */
static __always_inline int enter(u32 api, u64 count, u64 dt, u64 op, u64 peer, u64 comm, u64 stream) {
    return gpu_call_enter(bpf_get_current_pid_tgid(), api, FAM_collectives, count, dt, op, peer, comm, stream);
}


static __always_inline u64 stack_arg(struct pt_regs *ctx, int n) {  /* the nth stack argument (7th integer arg = 0) */
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n + 1)));
    return v;
}

/* The communicator's identity across its ranks: ncclComm_t is a per-process pointer, but every rank
 * of one communicator was given the same ncclUniqueId, whose first 8 bytes are NCCL's random magic
 * (ncclBootstrapHandle). It is passed by value on the stack: at entry it starts just above the return
 * address. 0 (unknown) is never a uid. */
static __always_inline u64 comm_uid(struct pt_regs *ctx) {
    u64 magic = 0;
    bpf_probe_read_user(&magic, sizeof(magic), (void *)(PT_REGS_SP(ctx) + 8));
    return magic ? magic : 1;
}

/* A split's members share their parent's uid and their color (a hash of both; nonzero). */
static __always_inline u64 split_uid(u32 pid, u64 parent, s32 color) {
    struct gpu_sub_key pk = {.pid = pid, .sub = parent};
    struct nccl_comm_info *p = comms.lookup(&pk);
    if (!p || !p->uid)
        return 0;
    u64 h = (p->uid ^ (u64)(u32)color) * 0x9E3779B97F4A7C15ULL;
    return h ? h : 1;
}

static __always_inline void note_comm(u32 pid, u64 comm, s32 rank, s32 nranks, u64 uid) {
    struct gpu_sub_key ck = {.pid = pid, .sub = comm};
    struct nccl_comm_info info = {.rank = rank, .nranks = nranks, .uid = uid};
    if (comms.update(&ck, &info) != 0)
        count_lost();
    if (!uid)
        return;
    int z = 0;
    struct nccl_comm_seq *zero = zero_seq.lookup(&z);
    if (!zero)
        return;
    /* a new communicator (or a new one at a freed one's address) counts from 0 */
    if (comm_seq.update(&ck, zero) != 0) {
        count_lost();
        return;
    }
    struct nccl_comm_seq *s = comm_seq.lookup(&ck);
    if (s)
        s->uid = uid;
}

/* A collective entered on `comm`: its sequence number on the communicator, and every 2^shift-th one's
 * entry time in the ring. Communicators whose init was not traced have no entry: not counted. */
static __always_inline void count_collective(u32 pid, u64 comm) {
    struct gpu_sub_key ck = {.pid = pid, .sub = comm};
    struct nccl_comm_seq *s = comm_seq.lookup(&ck);
    if (!s)
        return;
    u64 seq = __sync_fetch_and_add(&s->seq, 1) + 1;
    u64 *shift = seq_shift.lookup(&ck);
    u64 every_mask = shift ? ((1ULL << (*shift & 15)) - 1) : 0;
    if (seq & every_mask)
        return;
    u32 slot = (seq >> (shift ? (*shift & 15) : 0)) & (NCCL_SEQ_MARKS - 1);
    s->marks[slot].ts = bpf_ktime_get_ns();
    s->marks[slot].seq = seq;
}

/* A collective (not point-to-point, group or init): counted in its communicator's sequence, then entered. */
static __always_inline int enter_collective(u32 api, u64 count, u64 dt, u64 op, u64 peer, u64 comm, u64 stream) {
    count_collective(bpf_get_current_pid_tgid() >> 32, comm);
    return enter(api, count, dt, op, peer, comm, stream);
}

int on_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct gpu_inflight f;
    u64 dur;
    if (!gpu_call_take(id, &f, &dur))
        return 0;
    s32 rc = PT_REGS_RC(ctx);
    u32 pid = id >> 32;
    u64 bytes = 0;
    if (f.api == API_ncclCommInitRank || f.api == API_ncclCommInitRankConfig || f.api == API_ncclCommSplit) {
        u64 comm = 0;  /* a split with NCCL_SPLIT_NOCOLOR gives no communicator */
        if (rc == 0 && bpf_probe_read_user(&comm, sizeof(comm), (void *)f.arg[0]) == 0 && comm) {
            u64 uid = f.api == API_ncclCommSplit ? split_uid(pid, f.arg[5], (s32)f.arg[2]) : f.arg[5];
            note_comm(pid, comm, (s32)f.arg[3], (s32)f.arg[1], uid);
        }
        f.arg[4] = comm;
    } else if (f.api == API_ncclCommInitAll) {
        u64 comm = 0, first = 0;
        s32 ndev = (s32)f.arg[1];
        for (int i = 0; i < INIT_ALL_MAX; i++) {
            if (rc != 0 || i >= ndev || bpf_probe_read_user(&comm, sizeof(comm), (void *)(f.arg[0] + 8 * i)) != 0)
                break;
            if (i == 0)
                first = comm;
            if (comm)  /* one process holds every rank: no cross-process order to compare */
                note_comm(pid, comm, i, ndev, 0);
        }
        f.arg[4] = first;
    } else if (f.api != API_ncclGroupStart && f.api != API_ncclGroupEnd) {
        bytes = f.arg[0] * dtype_size(f.arg[1]);
        if (f.api == API_ncclSend || f.api == API_ncclRecv) {
            struct gpu_sub_key pk = {.pid = pid, .api = f.api, .sub = f.arg[3]};
            u64 zero = 0, *p = peer_bytes.lookup_or_try_init(&pk, &zero);
            if (p)
                __sync_fetch_and_add(p, bytes);
            else
                count_lost();
        }
    }
    if (rc == 0 && f.api != API_ncclGroupStart && f.api != API_ncclCommInitRank && f.api != API_ncclCommInitRankConfig
        && f.api != API_ncclCommSplit && f.api != API_ncclCommInitAll) {
        /* work enqueued: the thread's next sync waits for it (bpf/cuda.bpf.c). Written in place once the
         * thread has its entry: no map insert per call. */
        u64 done = f.ts + dur, *mark = nccl_enqueued.lookup(&id);
        if (mark)
            *mark = done;
        else if (nccl_enqueued.update(&id, &done) != 0)
            count_lost();
    }
    gpu_call_record(id, &f, dur, rc, bytes);
    return 0;
}

/* ncclAllReduce(send, recv, count, dt, op, comm, stream@stack) */
static __always_inline int on_ncclAllReduce(struct pt_regs *ctx) {
    return enter_collective(API_ncclAllReduce, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), NONE,
                 PT_REGS_PARM6(ctx), stack_arg(ctx, 0));
}
/* ncclReduceScatter(send, recv, recvcount, dt, op, comm, stream@stack) */
static __always_inline int on_ncclReduceScatter(struct pt_regs *ctx) {
    return enter_collective(API_ncclReduceScatter, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), NONE,
                 PT_REGS_PARM6(ctx), stack_arg(ctx, 0));
}
/* ncclAllGather(send, recv, sendcount, dt, comm, stream) */
static __always_inline int on_ncclAllGather(struct pt_regs *ctx) {
    return enter_collective(API_ncclAllGather, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), NONE, NONE, PT_REGS_PARM5(ctx),
                 PT_REGS_PARM6(ctx));
}
/* ncclBroadcast(send, recv, count, dt, root, comm, stream@stack) */
static __always_inline int on_ncclBroadcast(struct pt_regs *ctx) {
    return enter_collective(API_ncclBroadcast, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), NONE, (s32)PT_REGS_PARM5(ctx),
                 PT_REGS_PARM6(ctx), stack_arg(ctx, 0));
}
/* ncclReduce(send, recv, count, dt, op, root, comm@stack, stream@stack) */
static __always_inline int on_ncclReduce(struct pt_regs *ctx) {
    return enter_collective(API_ncclReduce, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), (s32)PT_REGS_PARM6(ctx),
                 stack_arg(ctx, 0), stack_arg(ctx, 1));
}
/* ncclSend(buf, count, dt, peer, comm, stream), ncclRecv(same) */
static __always_inline int on_ncclSend(struct pt_regs *ctx) {
    return enter(API_ncclSend, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), NONE, (s32)PT_REGS_PARM4(ctx),
                 PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}
static __always_inline int on_ncclRecv(struct pt_regs *ctx) {
    return enter(API_ncclRecv, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), NONE, (s32)PT_REGS_PARM4(ctx),
                 PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}
static __always_inline int on_ncclGroupStart(struct pt_regs *ctx) { return enter(API_ncclGroupStart, 0, NONE, NONE, NONE, NONE, NONE); }
static __always_inline int on_ncclGroupEnd(struct pt_regs *ctx) { return enter(API_ncclGroupEnd, 0, NONE, NONE, NONE, NONE, NONE); }
/* ncclCommInitRank(comm *out, nranks, ncclUniqueId (128 bytes, by value: on
 * the stack, so it takes no register), rank). Record: [out, nranks, -, rank, comm at return, uid]. */
static __always_inline int on_ncclCommInitRank(struct pt_regs *ctx) {
    return enter(API_ncclCommInitRank, PT_REGS_PARM1(ctx), (s32)PT_REGS_PARM2(ctx), NONE, (s32)PT_REGS_PARM3(ctx),
                 0, comm_uid(ctx));
}

/* ncclCommInitRankConfig(comm *out, nranks, ncclUniqueId (stack), rank, config): as ncclCommInitRank. */
static __always_inline int on_ncclCommInitRankConfig(struct pt_regs *ctx) {
    return enter(API_ncclCommInitRankConfig, PT_REGS_PARM1(ctx), (s32)PT_REGS_PARM2(ctx), NONE,
                 (s32)PT_REGS_PARM3(ctx), 0, comm_uid(ctx));
}
/* ncclCommSplit(parent, color, key, comm *out, config). NCCL orders the new ranks by key, and
 * PyTorch passes the rank in the new group as the key, so the key is the new rank; the size is
 * not an argument (-1: unknown). Record: [out, -1, color, key, comm at return, parent]. */
static __always_inline int on_ncclCommSplit(struct pt_regs *ctx) {
    return enter(API_ncclCommSplit, PT_REGS_PARM4(ctx), (u64)-1, (s32)PT_REGS_PARM2(ctx), (s32)PT_REGS_PARM3(ctx),
                 0, PT_REGS_PARM1(ctx));
}
/* ncclCommInitAll(comm *comms, ndev, devlist): comms[i] is rank i of ndev. Record: [comms, ndev, ..., comms[0]]. */
static __always_inline int on_ncclCommInitAll(struct pt_regs *ctx) {
    return enter(API_ncclCommInitAll, PT_REGS_PARM1(ctx), (s32)PT_REGS_PARM2(ctx), NONE, NONE, 0, NONE);
}

/* The one entry program of every link: the probe's BPF cookie names the API
 * (its id in the tracer's table; bit 63 marks a driver call). */
int on_call(struct pt_regs *ctx) {
    switch ((u32)bpf_get_attach_cookie(ctx)) {
    case API_ncclAllReduce: return on_ncclAllReduce(ctx);
    case API_ncclReduceScatter: return on_ncclReduceScatter(ctx);
    case API_ncclAllGather: return on_ncclAllGather(ctx);
    case API_ncclBroadcast: return on_ncclBroadcast(ctx);
    case API_ncclReduce: return on_ncclReduce(ctx);
    case API_ncclSend: return on_ncclSend(ctx);
    case API_ncclRecv: return on_ncclRecv(ctx);
    case API_ncclGroupStart: return on_ncclGroupStart(ctx);
    case API_ncclGroupEnd: return on_ncclGroupEnd(ctx);
    case API_ncclCommInitRank: return on_ncclCommInitRank(ctx);
    case API_ncclCommInitRankConfig: return on_ncclCommInitRankConfig(ctx);
    case API_ncclCommSplit: return on_ncclCommSplit(ctx);
    case API_ncclCommInitAll: return on_ncclCommInitAll(ctx);
    }
    return 0;
}

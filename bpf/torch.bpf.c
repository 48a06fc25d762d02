/* PyTorch operators from uprobes on libtorch_python's per-op Python binding
 * wrappers (torch::autograd::THPVariable_<op>, one function per op; see
 * producers/tracers/torch_ops.py for why these symbols).
 *
 * All wrappers of a process are attached as one uprobe_multi link for entry
 * and one for return (one kernel grace period to detach, not one per probe).
 * Each probe's BPF cookie is its op's index, so one program serves every op
 * and copies nothing. Entry and return pair through a small per-thread stack;
 * counters are cumulative per (pid, op) and user space diffs them.
 *
 * Family "waits" (duty-cycled): where gloo's algorithms and the c10d
 * caller block for peers (gloo UnboundBuffer::waitRecv/waitSend on gloo's
 * worker threads, c10d::Work::wait on the caller). The cookie is the kind
 * (0 recv, 1 send, 2 work); a kind never nests on one thread, so entry and
 * return pair by (thread, kind). These functions throw, so their return is
 * not a uretprobe (it would make an unwinding exception call std::terminate)
 * but plain uprobes on each of their `ret` instructions running comm_return.
 * A wait left by an exception never reaches one: its start stays behind and
 * the thread's next entry of that kind counts it as unpaired. Calls and ns are cumulative per (pid, kind);
 * the longest wait goes to comm_max, which user space reads and empties each
 * sample (a per-interval maximum).
 *
 * With DETAIL (the tracer's detail mode) each op's return (op_return) and each wait's return (comm_return)
 * also sends one ring-buffer record (pid, tid, op index or wait kind, start, duration) while the detail gate
 * is open: bpf_ktime_get_ns() (CLOCK_MONOTONIC) before detail_until[0], as in bpf/gpu_calls.bpf.c. Closed
 * (0) it costs one array lookup per return; the counters above count either way. A record the ring cannot
 * take is counted in `lost`. No probe is added for it: the waits' returns stay plain uprobes on `ret`.
 *
 * Arrival marks (family "collectives"): c10d::ProcessGroupGloo::nextTag() is called once per collective, on
 * the caller's thread as it issues the collective (allreduce, broadcast, barrier, ...), and returns the
 * group's collective counter, which every rank of the group holds in step (gloo matches its messages by
 * it). tag_entry keeps the group (`this`) and the time per thread; tag_return, a plain uprobe on nextTag's
 * `ret` (it throws nothing, but no uretprobe is needed either), reads the returned tag from the return
 * register and records (pid, group, tag) -> entry time in coll_marks, which user space reads and empties
 * each sample. No memory of the process is read. */
#include <uapi/linux/ptrace.h>
#include "events.h"

#define TORCH_STACK_MAX 8

struct torch_stack {
    u32 depth;
    u32 pad;
    struct torch_frame f[TORCH_STACK_MAX];
};

BPF_HASH(ops, struct torch_op_key, struct torch_op_stats, 8192);
BPF_TABLE("lru_hash", u32, struct torch_stack, stacks, 4096);  /* per thread */
BPF_HASH(lost, u32, u64, 1024);                                /* per pid */
BPF_PERCPU_ARRAY(hits, u64, 3);  /* per family: 0 ops, 1 collectives (the marks), 2 waits */

/* family "waits" (struct names are local: no other program shares them) */
struct comm_key {
    u32 pid;
    u32 kind;       /* the attach cookie: index into the tracer's COMM_KINDS */
};

struct comm_stats {
    u64 calls;
    u64 ns;
    u64 unpaired;   /* entries whose call left without reaching a ret probe (exception, tail call) */
};

BPF_HASH(comm_waits, struct comm_key, struct comm_stats, 4096);
BPF_HASH(comm_max, struct comm_key, u64, 4096);
BPF_TABLE("lru_hash", u64, u64, comm_starts, 8192);  /* (tid << 32 | kind) -> entry time */

/* arrival marks: see the head of this file */
struct tag_call {
    u64 group;      /* the ProcessGroupGloo (`this`): per process, never compared across ranks */
    u64 ts;
};

struct mark_key {
    u32 pid;
    u32 tag;        /* nextTag's return: the group's collective counter, the same on every rank */
    u64 group;
};

BPF_TABLE("lru_hash", u32, struct tag_call, tag_calls, 4096);  /* per thread, between entry and ret */
BPF_HASH(coll_marks, struct mark_key, u64, 8192);

#ifdef DETAIL
struct torch_call_event {
    u64 ts;         /* entry, bpf_ktime_get_ns */
    u64 dur_ns;
    u32 pid;
    u32 tid;
    u32 what;       /* family 0: op index (the op's cookie); family 1: wait kind (index into COMM_KINDS) */
    u32 family;     /* 0 ops, 1 waits */
};

BPF_RINGBUF_OUTPUT(calls, RING_PAGES);
/* The detail gate: records are sent only while the return's clock reading is before detail_until[0]. User
 * space opens it (TorchTracer.set_detail_until): for the whole run (U64 max) or a live capture's span. */
BPF_ARRAY(detail_until, u64, 1);

/* One call's record, if the gate is open at `now` (the return's own clock reading: no extra clock read). */
static __always_inline void send_call(u64 pid_tgid, u32 family, u32 what, u64 ts, u64 now) {
    int z = 0;
    u64 *until = detail_until.lookup(&z);
    if (!until || now >= *until)   /* closed (0) or expired */
        return;
    u32 pid = pid_tgid >> 32;
    struct torch_call_event *e = calls.ringbuf_reserve(sizeof(*e));
    if (!e) {
        lost.increment(pid);
        return;
    }
    e->ts = ts;
    e->dur_ns = now - ts;
    e->pid = pid;
    e->tid = (u32)pid_tgid;
    e->what = what;
    e->family = family;
    calls.ringbuf_submit(e, 0);
}
#endif

static __always_inline void count_hit(int family) {
    u64 *h = hits.lookup(&family);
    if (h)
        (*h)++;
}

int op_entry(struct pt_regs *ctx) {
    count_hit(0);
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id, pid = id >> 32;
    struct torch_op_key k = {.pid = pid, .op = bpf_get_attach_cookie(ctx)};
    struct torch_op_stats init = {};
    struct torch_op_stats *s = ops.lookup_or_try_init(&k, &init);
    if (!s) {
        lost.increment(pid);
        return 0;
    }
    __sync_fetch_and_add(&s->calls, 1);
    struct torch_stack empty = {};   /* 136 bytes: fits the BPF stack */
    struct torch_stack *st = stacks.lookup_or_try_init(&tid, &empty);
    if (!st)
        return 0;
    u32 d = st->depth;
    if (d < TORCH_STACK_MAX) {
        st->f[d].ts = bpf_ktime_get_ns();
        st->f[d].op = k.op;
    }
    st->depth = d + 1;
    return 0;
}

int op_return(struct pt_regs *ctx) {
    count_hit(0);
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id;
    struct torch_stack *st = stacks.lookup(&tid);
    if (!st || st->depth == 0)
        return 0;                  /* entered before the probes were attached */
    u32 d = st->depth - 1;
    st->depth = d;
    if (d >= TORCH_STACK_MAX)
        return 0;
    if (st->f[d].op != bpf_get_attach_cookie(ctx)) {
        st->depth = 0;             /* unbalanced: start over */
        return 0;
    }
    u64 ts = st->f[d].ts;
    struct torch_op_key k = {.pid = id >> 32, .op = st->f[d].op};
    struct torch_op_stats *s = ops.lookup(&k);
    if (s)
        __sync_fetch_and_add(&s->ns, now - ts);
#ifdef DETAIL
    send_call(id, 0, k.op, ts, now);
#endif
    return 0;
}

int comm_entry(struct pt_regs *ctx) {
    count_hit(2);
    u64 id = bpf_get_current_pid_tgid();
    u32 kind = bpf_get_attach_cookie(ctx);
    u64 key = (id << 32) | kind;
    u64 now = bpf_ktime_get_ns();
    if (comm_starts.lookup(&key)) {   /* the previous wait of this kind never reached a ret */
        struct comm_key k = {.pid = id >> 32, .kind = kind};
        struct comm_stats init = {};
        struct comm_stats *s = comm_waits.lookup_or_try_init(&k, &init);
        if (s)
            __sync_fetch_and_add(&s->unpaired, 1);
    }
    comm_starts.update(&key, &now);
    return 0;
}

int comm_return(struct pt_regs *ctx) {
    count_hit(2);
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    u32 kind = bpf_get_attach_cookie(ctx);
    u64 key = (id << 32) | kind;
    u64 *start = comm_starts.lookup(&key);
    if (!start)
        return 0;                  /* entered before the probes were attached */
    u64 ts = *start;
    u64 d = now - ts;
    comm_starts.delete(&key);
#ifdef DETAIL
    send_call(id, 1, kind, ts, now);
#endif
    struct comm_key k = {.pid = id >> 32, .kind = kind};
    struct comm_stats init = {};
    struct comm_stats *s = comm_waits.lookup_or_try_init(&k, &init);
    if (!s) {
        lost.increment(k.pid);
        return 0;
    }
    __sync_fetch_and_add(&s->calls, 1);
    __sync_fetch_and_add(&s->ns, d);
    u64 zero = 0;
    u64 *m = comm_max.lookup_or_try_init(&k, &zero);
    if (m && d > *m)
        *m = d;                    /* racy between threads of a pid: a maximum, not a count */
    return 0;
}

int tag_entry(struct pt_regs *ctx) {
    count_hit(1);
    u32 tid = bpf_get_current_pid_tgid();
    struct tag_call c = {.group = PT_REGS_PARM1(ctx), .ts = bpf_ktime_get_ns()};
    tag_calls.update(&tid, &c);
    return 0;
}

int tag_return(struct pt_regs *ctx) {
    count_hit(1);
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id;
    struct tag_call *c = tag_calls.lookup(&tid);
    if (!c)
        return 0;                  /* entered before the probes were attached */
    struct mark_key k = {.pid = id >> 32, .tag = (u32)PT_REGS_RC(ctx), .group = c->group};
    u64 ts = c->ts;
    tag_calls.delete(&tid);
    if (coll_marks.insert(&k, &ts) != 0)   /* full: user space has not read it for a long while */
        lost.increment(k.pid);
    return 0;
}

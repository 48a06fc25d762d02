/* The call pairing shared by bpf/cuda.bpf.c and bpf/nccl.bpf.c (user side:
 * producers/tracers/gpu_calls.py). It is not #included: bcc rewrites map
 * calls (x.lookup(), x.increment()) only in the program text it is given, so
 * gpu_calls.py puts this text in front of the family's file.
 *
 * Entry saves the call's arguments per thread in `inflight`; return takes
 * them back, adds duration, return code and bytes to the (pid, API) stats,
 * and, with DETAIL, sends one ring-buffer record per call while the detail
 * gate is open. */
#include <uapi/linux/ptrace.h>
#include "events.h"

/* LRU: an entry whose return never comes (the uretprobe was detached while
 * the call ran, or the thread died inside it) ages out instead of filling the map. */
BPF_TABLE("lru_hash", u64, struct gpu_inflight, inflight, 65536);
BPF_HASH(stats, struct gpu_call_key, struct gpu_call_stats, 4096);
BPF_ARRAY(zero_stats, struct gpu_call_stats, 1);  /* an initial value too big for the stack */
BPF_ARRAY(hits, u64, N_FAMILIES);                 /* probe-pair hits per family */
BPF_ARRAY(lost, u64, 1);                          /* map-full and ring-buffer-full failures */
#ifdef DETAIL
BPF_RINGBUF_OUTPUT(calls, RING_PAGES);
/* The detail gate: records are sent only while bpf_ktime_get_ns() (CLOCK_MONOTONIC) is before
 * detail_until[0]. User space opens it (GpuCallTracer.set_detail_until): for the whole run when the
 * agent captures around anomalies (U64 max), or for a live capture request's span. Closed (0) it costs one
 * array lookup per call; the stats count either way. */
BPF_ARRAY(detail_until, u64, 1);
#endif
/* Per thread (pid_tgid): when its latest NCCL call that enqueued work
 * returned, 0 once taken. The NCCL program writes it, the CUDA program takes
 * it (sets 0) at the thread's next sync call, whose duration is then the
 * host's wait for the collective. One map for both programs: producers/tracers/
 * gpu_calls.py owns it (BPF_TABLE_SHARED in a module kept for the process's
 * life), each program names it "extern", so load order does not matter. */
BPF_TABLE("extern", u64, u64, nccl_enqueued, NCCL_ENQUEUED_MAX);

static __always_inline void count_lost(void) {
    int z = 0;
    lost.increment(z);
}

/* Save an entry under `id` (a thread's pid_tgid, possibly tagged) and count the family's hit. */
static __always_inline int gpu_call_enter(u64 id, u32 api, u32 family, u64 a0, u64 a1, u64 a2, u64 a3, u64 a4,
                                          u64 a5) {
    struct gpu_inflight f = {.ts = bpf_ktime_get_ns(), .api = api, .family = family, .arg = {a0, a1, a2, a3, a4, a5}};
    if (inflight.update(&id, &f) != 0)
        count_lost();
    hits.increment(family);
    return 0;
}

/* Take back the entry saved under `id`, with the call's duration: 0 if there is
 * none (the call entered before the probes were attached). */
static __always_inline int gpu_call_take(u64 id, struct gpu_inflight *f, u64 *dur) {
    struct gpu_inflight *fp = inflight.lookup(&id);
    if (!fp)
        return 0;
    *f = *fp;
    inflight.delete(&id);
    *dur = bpf_ktime_get_ns() - f->ts;
    return 1;
}

/* Add a finished call to its (pid, API) stats, and with DETAIL send its record while the gate is open. */
static __always_inline void gpu_call_record(u64 pid_tgid, struct gpu_inflight *f, u64 dur, s32 rc, u64 bytes) {
    struct gpu_call_key k = {.pid = pid_tgid >> 32, .api = f->api};
    int z = 0;
    struct gpu_call_stats *init = zero_stats.lookup(&z);
    if (!init)
        return;
    struct gpu_call_stats *s = stats.lookup_or_try_init(&k, init);
    if (s)
        gpu_stats_add(s, dur, rc, bytes);
    else
        count_lost();
#ifdef DETAIL
    u64 *until = detail_until.lookup(&z);
    if (!until || !*until || bpf_ktime_get_ns() >= *until)  /* 0: closed, no clock read */
        return;
    struct gpu_call_event *e = calls.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost();
        return;
    }
    gpu_event_fill(e, f, dur, pid_tgid, rc);
    calls.ringbuf_submit(e, 0);
#endif
}

/* Kernel-side signals from tracepoints (our kernels have no kprobes).
 * Everything aggregates in maps that user space reads once per tick; no
 * per-event output. Counters are cumulative: user space diffs them, so no
 * increment is lost between a read and a reset. */
#include "events.h"

/* Processes (tgids) to trace; user space fills it. An untraced thread costs
 * one lookup here on switch-out and one miss in `start` on switch-in. */
BPF_HASH(targets, u32, u8, 1024);
/* Per-thread switch-out time. LRU so threads that exit while off-CPU (they
 * never switch back in) cannot fill the map. */
BPF_TABLE("lru_hash", u32, struct offcpu_start, start, 16384);
BPF_HASH(offcpu_ns, u32, u64, 1024);      /* per tgid, cumulative */
BPF_HASH(switches, u32, u64, 1024);       /* per tgid switch-outs, cumulative */
BPF_HASH(runq_ns, u32, u64, 1024);        /* per tgid: the part of offcpu_ns spent runnable, waiting for a CPU */
/* Per connection: tcp_retransmit_skb fires in softirq (timer) context, where
 * the current task is unrelated to the socket's owner. */
BPF_TABLE("lru_hash", struct tcp_conn, u64, retransmits, 10240);
BPF_PERCPU_ARRAY(irqs, u64, 1);           /* one slot, one count per CPU */

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();
    /* The probe runs as prev, so current's tgid is prev's process. */
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 prev = args->prev_pid;
    if (prev != 0 && targets.lookup(&tgid)) {
        /* Preempted tasks report TASK_RUNNING (0) or, since 4.14, TASK_REPORT_MAX (0x100). */
        struct offcpu_start s = {.ts = now, .tgid = tgid, .preempted = (args->prev_state & 0xff) == 0};
        start.update(&prev, &s);
        switches.increment(tgid);
    }
    u32 next = args->next_pid;
    struct offcpu_start *s = start.lookup(&next);
    if (s == 0)
        return 0;
    u32 owner = s->tgid;
    u64 delta = now - s->ts;
    u32 preempted = s->preempted;
    start.delete(&next);
    /* Re-check: the process may have been untraced while this thread slept. */
    if (targets.lookup(&owner)) {
        offcpu_ns.increment(owner, delta);
        if (preempted)
            runq_ns.increment(owner, delta);
    }
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb) {
    struct tcp_conn k = {};
    k.family = args->family;
    k.sport = args->sport;
    k.dport = args->dport;
    if (k.family == 2) {            /* AF_INET */
        __builtin_memcpy(k.saddr, args->saddr, 4);
        __builtin_memcpy(k.daddr, args->daddr, 4);
    } else {                        /* AF_INET6 */
        __builtin_memcpy(k.saddr, args->saddr_v6, 16);
        __builtin_memcpy(k.daddr, args->daddr_v6, 16);
    }
    retransmits.increment(k);
    return 0;
}

TRACEPOINT_PROBE(irq, irq_handler_entry) {
    int zero = 0;
    irqs.increment(zero);
    return 0;
}

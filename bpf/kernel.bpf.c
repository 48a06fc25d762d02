/* Kernel-side signals from tracepoints (our kernels have no kprobes).
 * Everything aggregates in maps that user space reads once per tick; no
 * per-event output. Counters are cumulative: user space diffs them, so no
 * increment is lost between a read and a reset. The one non-counter is how a
 * traced process ended (`exits`), which user space reads and deletes. */
#include <linux/sched.h>
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
/* Per tgid: how the process ended, as task->exit_code (wait-status form: low
 * 7 bits the terminating signal, 0x80 core dumped, bits 8..15 the exit
 * status). This tells a crashed rank (SIGKILL from the OOM killer, SIGSEGV,
 * SIGABRT, a non-zero exit) from one its launcher stopped (SIGTERM) or one
 * that finished (exit 0). User space deletes an entry once read. */
BPF_HASH(exits, u32, u32, 1024);

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

#ifdef PROCESS_EXIT_PROBE  /* user space leaves it out where sched_process_exit has no group_dead */
/* Where task_struct keeps exit_code in the running kernel. The installed
 * headers can be an older kernel's (a plain task->exit_code read 0 here: 6.12
 * headers on a 6.18 kernel), so user space passes the offset it found in the
 * kernel's BTF; the headers' offset is the fallback when there is no BTF. */
#ifndef TASK_EXIT_CODE_OFFSET
#define TASK_EXIT_CODE_OFFSET offsetof(struct task_struct, exit_code)
#endif

/* Fires in do_exit for every exiting thread, after tsk->exit_code is set and
 * before the thread's last teardown (mm, files) and final switch-out, so its
 * off-CPU time keeps being counted above until user space sees the process
 * reaped or a zombie. group_dead marks the last live thread of the process:
 * one entry per process, whichever thread goes last. */
TRACEPOINT_PROBE(sched, sched_process_exit) {
    if (!args->group_dead)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!targets.lookup(&tgid))
        return 0;
    u32 code = 0;
    bpf_probe_read_kernel(&code, sizeof(code), (char *)bpf_get_current_task() + TASK_EXIT_CODE_OFFSET);
    exits.update(&tgid, &code);
    return 0;
}
#endif

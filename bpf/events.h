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
    u32 pad;
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

#endif

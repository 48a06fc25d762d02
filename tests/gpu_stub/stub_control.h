/* How long a stand-in call takes and what it returns, from the environment.
 *
 *   GPU_STUB_DELAY_US="cudaStreamSynchronize=2000,ncclAllReduce=300,*=0"
 *   GPU_STUB_RC="cudaMalloc=2,ncclSend=5"
 *
 * Each exported function resolves its own entry once (STUB_CALL caches it in
 * a static), so a call costs a clock read plus the requested busy-wait. */
#ifndef GPU_STUB_CONTROL_H
#define GPU_STUB_CONTROL_H
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct stub_ctl { int ready; long delay_ns; int rc; };

/* The value for `name` in a "a=1,b=2,*=3" list, else the "*" value, else dflt. */
static long stub_lookup(const char *list, const char *name, long dflt) {
    if (!list) return dflt;
    size_t n = strlen(name);
    long star = dflt;
    for (const char *p = list; *p;) {
        const char *eq = strchr(p, '='), *comma = strchr(p, ',');
        if (!eq) break;
        if ((size_t)(eq - p) == n && strncmp(p, name, n) == 0) return strtol(eq + 1, NULL, 10);
        if (eq - p == 1 && *p == '*') star = strtol(eq + 1, NULL, 10);
        if (!comma) break;
        p = comma + 1;
    }
    return star;
}

static long stub_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static int stub_run(struct stub_ctl *c, const char *name) {
    if (!c->ready) {
        c->delay_ns = stub_lookup(getenv("GPU_STUB_DELAY_US"), name, 0) * 1000;
        c->rc = (int)stub_lookup(getenv("GPU_STUB_RC"), name, 0);
        c->ready = 1;
    }
    if (c->delay_ns >= 1000000) {           /* long waits sleep, short ones spin */
        struct timespec t = {c->delay_ns / 1000000000L, c->delay_ns % 1000000000L};
        nanosleep(&t, NULL);
    } else if (c->delay_ns > 0) {
        long end = stub_now_ns() + c->delay_ns;
        while (stub_now_ns() < end) {}
    }
    return c->rc;
}

#define STUB_CALL(name) do { static struct stub_ctl ctl; int rc_ = stub_run(&ctl, name); if (rc_) return rc_; } while (0)
#define STUB_RC(name) ({ static struct stub_ctl ctl; stub_run(&ctl, name); })

/* Stand-in device pointers: distinct, page aligned, never dereferenced. */
static unsigned long stub_next_ptr = 0x700000000000UL;
static unsigned long stub_fake_ptr(size_t size) {
    unsigned long p = __atomic_fetch_add(&stub_next_ptr, (size + 4095) & ~4095UL, __ATOMIC_RELAXED);
    return p;
}
#endif

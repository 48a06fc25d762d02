/* How long a stand-in call takes and what it returns, from the environment,
 * and optionally changed while the process runs through a control file.
 *
 *   GPU_STUB_DELAY_US="cudaStreamSynchronize=2000,ncclAllReduce=300,*=0"
 *   GPU_STUB_RC="cudaMalloc=2,ncclSend=5"
 *
 * Runtime control (a fault that starts mid-run, no restart): when
 * GPU_STUB_CONTROL names a file, each library stats it at most every
 * GPU_STUB_CONTROL_MS milliseconds (default 100) and re-reads it when its
 * mtime, size or inode changed. While the file exists its lines
 *
 *   delay_us cudaMemcpy=26333,ncclAllReduce=900
 *   rc cudaMalloc=2
 *   knob leak_bytes=16777216
 *
 * take precedence over the environment, name by name ("*" too); a name the
 * file does not give keeps its environment value. `knob` values are for the
 * workload, which reads them with gpu_stub_knob() (exported by the libcudart
 * stand-in). Write the file atomically (write a temp file, rename it over):
 * a reader never sees half a file then. Unknown line kinds are ignored.
 *
 * Each exported function caches its own entry (STUB_CALL keeps it in a
 * static) and looks it up again only when the control generation moved, so
 * a call costs a clock read plus the requested busy-wait. */
#ifndef GPU_STUB_CONTROL_H
#define GPU_STUB_CONTROL_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

struct stub_ctl { unsigned gen; long delay_ns; int rc; };

#define STUB_NOT_FOUND (-0x7fffffffL)

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

/* -- runtime control file ------------------------------------------------ */
#define STUB_LINE 4096
static struct {
    int init;                 /* 0: not yet looked at the environment */
    const char *path;         /* GPU_STUB_CONTROL, or NULL: no runtime control */
    long period_ns, next_check_ns;
    unsigned gen;             /* bumped on every change; entries re-resolve */
    struct stat st;           /* of the version loaded (st_ino 0: absent) */
    char delay[STUB_LINE], rc[STUB_LINE], knob[STUB_LINE];
    long reloads;
} stub_file;

static void stub_copy_line(char *dst, const char *line) {
    size_t n = strcspn(line, "\r\n");
    if (n >= STUB_LINE) n = STUB_LINE - 1;
    memcpy(dst, line, n);
    dst[n] = 0;
}

static void stub_load(const struct stat *st) {
    char delay[STUB_LINE] = "", rc[STUB_LINE] = "", knob[STUB_LINE] = "", line[STUB_LINE];
    FILE *f = st ? fopen(stub_file.path, "r") : NULL;
    if (f) {
        while (fgets(line, sizeof line, f)) {
            if (strncmp(line, "delay_us ", 9) == 0) stub_copy_line(delay, line + 9);
            else if (strncmp(line, "rc ", 3) == 0) stub_copy_line(rc, line + 3);
            else if (strncmp(line, "knob ", 5) == 0) stub_copy_line(knob, line + 5);
        }
        fclose(f);
    }
    memcpy(stub_file.delay, delay, sizeof delay);
    memcpy(stub_file.rc, rc, sizeof rc);
    memcpy(stub_file.knob, knob, sizeof knob);
    if (st) stub_file.st = *st; else memset(&stub_file.st, 0, sizeof stub_file.st);
    stub_file.gen++;
    stub_file.reloads++;
}

static void stub_poll(void) {
    if (!stub_file.init) {
        stub_file.init = 1;
        stub_file.gen = 1;
        stub_file.path = getenv("GPU_STUB_CONTROL");
        const char *ms = getenv("GPU_STUB_CONTROL_MS");
        stub_file.period_ns = (ms ? atol(ms) : 100) * 1000000L;
        stub_file.next_check_ns = 0;
    }
    if (!stub_file.path) return;
    long now = stub_now_ns();
    if (now < stub_file.next_check_ns) return;
    stub_file.next_check_ns = now + stub_file.period_ns;
    struct stat st;
    if (stat(stub_file.path, &st) != 0) {
        if (stub_file.st.st_ino) stub_load(NULL);       /* the file went away: back to the environment */
        return;
    }
    if (st.st_ino != stub_file.st.st_ino || st.st_size != stub_file.st.st_size ||
        st.st_mtim.tv_sec != stub_file.st.st_mtim.tv_sec || st.st_mtim.tv_nsec != stub_file.st.st_mtim.tv_nsec)
        stub_load(&st);
}

/* The file's value for name, else the environment list's, else dflt. */
static long stub_setting(const char *file_list, const char *env, const char *name, long dflt) {
    long v = file_list[0] ? stub_lookup(file_list, name, STUB_NOT_FOUND) : STUB_NOT_FOUND;
    return v != STUB_NOT_FOUND ? v : stub_lookup(getenv(env), name, dflt);
}

static int stub_run(struct stub_ctl *c, const char *name) {
    stub_poll();
    if (c->gen != stub_file.gen) {
        c->delay_ns = stub_setting(stub_file.delay, "GPU_STUB_DELAY_US", name, 0) * 1000;
        c->rc = (int)stub_setting(stub_file.rc, "GPU_STUB_RC", name, 0);
        c->gen = stub_file.gen;
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
/* Stand-in pinned host pointers: a range of their own, so a test can tell them apart. */
static unsigned long stub_next_host_ptr = 0x7f0000000000UL;
static unsigned long stub_fake_host_ptr(size_t size) {
    return __atomic_fetch_add(&stub_next_host_ptr, (size + 4095) & ~4095UL, __ATOMIC_RELAXED);
}
#endif

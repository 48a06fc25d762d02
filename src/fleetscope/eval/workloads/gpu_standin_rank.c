/* One rank of the GPU-job stand-in (workload b; see gpu_standin.py, which builds,
 * starts and steers it). There is no GPU here: the CUDA and NCCL libraries it
 * loads are the stand-ins from tests/gpu_stub, found like a real application
 * finds libcudart: dlopen() of a file in a library directory.
 *
 *   gpu_standin_rank LIBDIR STEPS DURATION_S KERNELS BATCH_BYTES GRAD_BYTES STEP_SLEEP_US LISTEN_PORT NEXT_ADDR
 *
 * Identity comes from the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK),
 * as in a real job. Each step, like a data-parallel training step:
 *   cudaMemcpy HtoD (the input batch), KERNELS x cudaLaunchKernel (forward/backward,
 *   four mangled host stubs), cudaMalloc+cudaFree of a workspace, a leak allocation
 *   while the runtime control's knob leak_bytes is > 0 (never freed), ncclAllReduce
 *   of GRAD_BYTES of float32 gradients, cudaStreamSynchronize, a host sleep.
 * How long each call takes is the stand-ins' business (GPU_STUB_DELAY_US and the
 * runtime control file GPU_STUB_CONTROL, which the launcher rewrites when a fault
 * starts or stops): this program's code path never changes.
 *
 * With WORLD_SIZE > 1 the ranks form a real TCP ring on loopback: each listens on
 * LISTEN_PORT and connects to NEXT_ADDR (host:port of the next rank, or a delaying
 * relay in front of it). The all-reduce is a ring all-reduce of the gradient
 * buffer (reduce-scatter then all-gather, 2(n-1) chunk exchanges, sums computed),
 * run inside ncclAllReduce through the stand-in's collective hook: a slow rank or
 * a slow link holds every rank up, as in a real job.
 *
 * A run ends after STEPS steps (or DURATION_S when STEPS is 0); the first rank to end
 * closes its ring sockets, and a rank that finds the ring closed mid-step ends too,
 * without counting that step or an error.
 *
 * Prints "loaded" after dlopen and the ring are up; when GPU_STANDIN_GO_FILE is set,
 * waits for that file before the set-up calls (ncclCommInitRank, two cudaMalloc) and the
 * first step, so a tracer attached in between sees the whole job. SIGTERM/SIGINT end the run after the
 * current step. At the end prints one JSON line (also written to
 * $FLEETSCOPE_WORKLOAD_RESULT_DIR/rank<RANK>.json when set). With
 * $FLEETSCOPE_WORKLOAD_PROGRESS_DIR set, appends {"t": unix time, "steps": N, "pid": P} to
 * <dir>/progress-rank<RANK>.jsonl about every 0.25 s while it steps (the harness's step rate). */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct { unsigned int x, y, z; } dim3;
typedef struct { char internal[128]; } ncclUniqueId;
typedef int (*collective_fn)(const char *api, size_t count, int datatype, void *arg);

/* Host-side kernel stubs with nvcc-style mangled names; the tracer names launches from them. */
#define KSTUB(fn, mangled) \
    __attribute__((noinline, used)) void fn(void) __asm__(mangled); \
    __attribute__((noinline, used)) void fn(void) { __asm__ volatile("" ::: "memory"); }
KSTUB(k_gemm, "_Z12sgemm_kernelPKfS0_Pfiii")      /* sgemm_kernel(float const*, float const*, float*, int, int, int) */
KSTUB(k_relu, "_Z11relu_kernelPfi")               /* relu_kernel(float*, int) */
KSTUB(k_softmax, "_Z14softmax_kernelPfi")         /* softmax_kernel(float*, int) */
KSTUB(k_adam, "_Z9adam_stepPfPKfi")               /* adam_step(float*, float const*, int) */
static void (*const KERNELS[4])(void) = {k_gemm, k_relu, k_softmax, k_adam};

#define S ((void *)0x5a5a)   /* the compute stream */

static volatile sig_atomic_t stopping;
static void on_signal(int sig) { (void)sig; stopping = 1; }

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}
static void die(const char *what) { fprintf(stderr, "gpu_standin_rank: %s: %s\n", what, strerror(errno)); exit(2); }

static void *lib(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    void *h = dlopen(path, RTLD_NOW);
    if (!h) { fprintf(stderr, "gpu_standin_rank: dlopen %s: %s\n", path, dlerror()); exit(2); }
    return h;
}
static void *sym(void *h, const char *name) {
    void *f = dlsym(h, name);
    if (!f) { fprintf(stderr, "gpu_standin_rank: dlsym %s: %s\n", name, dlerror()); exit(2); }
    return f;
}

/* -- the TCP ring ------------------------------------------------------------ */
struct ring { int rank, world, next_fd, prev_fd, closed; float *buf, *tmp; size_t floats; long bytes_sent; };

static int ring_listen(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (fd < 0) die("socket");
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 4)) die("bind/listen on the ring port");
    return fd;
}

/* Join the ring: connect to NEXT_ADDR and accept the previous rank on `lfd`, both at
 * once. The accepting side sends one byte ('R'); a connection counts only once that byte
 * arrived, so a relay that accepted but could not reach the next rank yet (it connects
 * upstream only after accepting) is retried rather than mistaken for the ring. */
static void ring_join(struct ring *r, int lfd, const char *addr) {
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (!colon || (size_t)(colon - addr) >= sizeof host) { fprintf(stderr, "gpu_standin_rank: bad NEXT_ADDR %s\n", addr); exit(2); }
    memcpy(host, addr, colon - addr);
    host[colon - addr] = 0;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(colon + 1))};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) { fprintf(stderr, "gpu_standin_rank: bad host in %s\n", addr); exit(2); }
    int fd = -1;
    long deadline = now_ns() + 60000000000L, retry_at = 0;
    while (r->next_fd < 0 || r->prev_fd < 0) {
        if (now_ns() > deadline) die("joining the ring (60 s)");
        if (r->next_fd < 0 && fd < 0 && now_ns() >= retry_at) {
            fd = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) { close(fd); fd = -1; retry_at = now_ns() + 20000000L; }
        }
        struct pollfd p[2] = {{r->prev_fd < 0 ? lfd : -1, POLLIN, 0}, {fd, POLLIN, 0}};
        poll(p, 2, 20);
        if (p[0].revents & POLLIN) {
            int c = accept(lfd, NULL, NULL);
            if (c >= 0 && send(c, "R", 1, MSG_NOSIGNAL) == 1) r->prev_fd = c;
            else if (c >= 0) close(c);
        }
        if (fd >= 0 && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
            char hello = 0;
            if (recv(fd, &hello, 1, 0) == 1 && hello == 'R') r->next_fd = fd;
            else { close(fd); retry_at = now_ns() + 20000000L; }
            fd = -1;
        }
    }
}

static void tune(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

/* Send `out` to the next rank while receiving `in` from the previous one (both at once:
 * a blocking send of a chunk bigger than the socket buffers would deadlock the ring). */
static int exchange(struct ring *r, const char *out, size_t nout, char *in, size_t nin) {
    size_t sent = 0, got = 0;
    while (sent < nout || got < nin) {
        struct pollfd p[2] = {{r->next_fd, sent < nout ? POLLOUT : 0, 0}, {r->prev_fd, got < nin ? POLLIN : 0, 0}};
        int ready = poll(p, 2, 60000);
        if (ready < 0 && errno == EINTR) continue;  /* SIGTERM: finish this step first */
        if (ready <= 0) { fprintf(stderr, "gpu_standin_rank: ring stalled 60 s\n"); return 6; }
        if (p[0].revents & (POLLOUT | POLLERR | POLLHUP)) {
            ssize_t n = send(r->next_fd, out + sent, nout - sent, MSG_NOSIGNAL);
            if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) { r->closed = 1; return 6; }
            if (n < 0 && errno != EAGAIN) { perror("gpu_standin_rank: ring send"); return 6; }
            if (n > 0) sent += n;
        }
        if (p[1].revents & (POLLIN | POLLERR | POLLHUP)) {
            ssize_t n = recv(r->prev_fd, in + got, nin - got, 0);
            if (n == 0 || (n < 0 && errno == ECONNRESET)) { r->closed = 1; return 6; }  /* it ended its run */
            if (n < 0 && errno != EAGAIN) { perror("gpu_standin_rank: ring recv"); return 6; }
            if (n > 0) got += n;
        }
    }
    r->bytes_sent += nout;
    return 0;
}

/* Ring all-reduce (sum) of r->buf: reduce-scatter, then all-gather. ncclInternalError (3) on failure. */
static int ring_allreduce(const char *api, size_t count, int datatype, void *arg) {
    struct ring *r = arg;
    (void)api; (void)datatype;
    if (r->world < 2) return 0;
    size_t n = r->world, chunk = (count < r->floats ? count : r->floats) / n;
    for (size_t s = 0; s < n - 1; s++) {
        size_t send_c = (r->rank - s + n) % n, recv_c = (r->rank - s - 1 + n) % n;
        if (exchange(r, (char *)(r->buf + send_c * chunk), chunk * 4, (char *)r->tmp, chunk * 4)) return 3;
        for (size_t i = 0; i < chunk; i++) r->buf[recv_c * chunk + i] += r->tmp[i];
    }
    for (size_t s = 0; s < n - 1; s++) {
        size_t send_c = (r->rank + 1 - s + n) % n, recv_c = (r->rank - s + n) % n;
        if (exchange(r, (char *)(r->buf + send_c * chunk), chunk * 4, (char *)(r->buf + recv_c * chunk), chunk * 4)) return 3;
    }
    return 0;
}

static int env_int(const char *name, int dflt) { const char *v = getenv(name); return v ? atoi(v) : dflt; }

int main(int argc, char **argv) {
    if (argc < 10) {
        fprintf(stderr, "usage: gpu_standin_rank LIBDIR STEPS DURATION_S KERNELS BATCH_BYTES GRAD_BYTES "
                        "STEP_SLEEP_US LISTEN_PORT NEXT_ADDR\n");
        return 2;
    }
    const char *dir = argv[1], *next_addr = argv[9];
    long steps = atol(argv[2]), kernels = atol(argv[4]), step_sleep_us = atol(argv[7]);
    double duration_s = atof(argv[3]);
    size_t batch_bytes = strtoul(argv[5], NULL, 10), grad_bytes = strtoul(argv[6], NULL, 10);
    int listen_port = atoi(argv[8]);
    struct ring ring = {.rank = env_int("RANK", 0), .world = env_int("WORLD_SIZE", 1), .next_fd = -1, .prev_fd = -1};
    if (ring.world < 1 || ring.rank < 0 || ring.rank >= ring.world) { fprintf(stderr, "gpu_standin_rank: bad RANK/WORLD_SIZE\n"); return 2; }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);

    void *rt = lib(dir, "libcudart.so.12"), *nc = lib(dir, "libnccl.so.2");
    int (*cudaMemcpy)(void *, const void *, size_t, int) = sym(rt, "cudaMemcpy");
    int (*cudaLaunchKernel)(const void *, dim3, dim3, void **, size_t, void *) = sym(rt, "cudaLaunchKernel");
    int (*cudaMalloc)(void **, size_t) = sym(rt, "cudaMalloc");
    int (*cudaFree)(void *) = sym(rt, "cudaFree");
    int (*cudaStreamSynchronize)(void *) = sym(rt, "cudaStreamSynchronize");
    long (*knob)(const char *, long) = sym(rt, "gpu_stub_knob");
    int (*ncclCommInitRank)(void **, int, ncclUniqueId, int) = sym(nc, "ncclCommInitRank");
    int (*ncclAllReduce)(const void *, void *, size_t, int, int, void *, void *) = sym(nc, "ncclAllReduce");
    void (*set_hook)(collective_fn, void *) = sym(nc, "gpu_stub_set_collective_hook");

    ring.floats = grad_bytes / 4;
    ring.buf = calloc(ring.floats + 1, 4);
    ring.tmp = calloc(ring.floats / (ring.world) + 1, 4);
    char *host_batch = malloc(batch_bytes ? batch_bytes : 1);
    if (!ring.buf || !ring.tmp || !host_batch) die("malloc");
    memset(host_batch, 1, batch_bytes);
    if (ring.world > 1) {
        int lfd = ring_listen(listen_port);
        ring_join(&ring, lfd, next_addr);
        close(lfd);
        tune(ring.next_fd);
        tune(ring.prev_fd);
    }
    set_hook(ring_allreduce, &ring);

    printf("loaded\n");
    fflush(stdout);
    const char *go = getenv("GPU_STANDIN_GO_FILE");
    while (go && access(go, F_OK) != 0 && !stopping) usleep(10000);
    void *comm = 0, *d_in = 0, *d_grad = 0;                 /* set-up, as a job starts */
    ncclUniqueId id;
    memset(&id, 0x42, sizeof id);
    if (ncclCommInitRank(&comm, ring.world, id, ring.rank)) { fprintf(stderr, "gpu_standin_rank: ncclCommInitRank failed\n"); return 4; }
    if (cudaMalloc(&d_in, batch_bytes) || cudaMalloc(&d_grad, grad_bytes)) { fprintf(stderr, "gpu_standin_rank: cudaMalloc failed\n"); return 4; }

    FILE *progress = NULL;
    const char *progress_dir = getenv("FLEETSCOPE_WORKLOAD_PROGRESS_DIR");
    if (progress_dir) {
        char ppath[4096];
        snprintf(ppath, sizeof ppath, "%s/progress-rank%d.jsonl", progress_dir, ring.rank);
        progress = fopen(ppath, "a");  /* no progress file: the run goes on without it */
    }
    long next_progress = 0;
    long start = now_ns(), end = start + (long)(duration_s * 1e9), memcpy_ns = 0, allreduce_ns = 0, leaked = 0;
    int errors = 0;
    long step;
    void *args[1] = {0};
    for (step = 0; !stopping && (steps > 0 ? step < steps : now_ns() < end); step++) {
        long t0 = now_ns();
        errors += cudaMemcpy(d_in, host_batch, batch_bytes, 1) != 0;          /* HtoD */
        memcpy_ns += now_ns() - t0;
        for (long k = 0; k < kernels; k++)
            errors += cudaLaunchKernel((void *)KERNELS[k % 4], (dim3){(unsigned)(batch_bytes >> 16) + 1, 1, 1},
                                       (dim3){256, 1, 1}, args, k % 4 == 0 ? 49152 : 0, S) != 0;
        void *ws = 0;
        errors += cudaMalloc(&ws, 4 << 20) != 0;                              /* a workspace, freed */
        errors += cudaFree(ws) != 0;
        long leak = knob("leak_bytes", 0);
        if (leak > 0) {                                                      /* allocated, never freed */
            void *p = 0;
            errors += cudaMalloc(&p, (size_t)leak) != 0;
            leaked += leak;
        }
        for (size_t i = 0; i < ring.floats; i += 1024) ring.buf[i] = (float)(step + ring.rank);  /* "gradients" */
        t0 = now_ns();
        int rc = ncclAllReduce(d_grad, d_grad, grad_bytes / 4, 7 /* float32 */, 0 /* sum */, comm, S);
        if (rc && ring.closed) break;  /* a neighbour finished first: this step is not counted */
        errors += rc != 0;
        allreduce_ns += now_ns() - t0;
        errors += cudaStreamSynchronize(S) != 0;
        if (progress && now_ns() >= next_progress) {
            struct timespec wall;
            clock_gettime(CLOCK_REALTIME, &wall);
            fprintf(progress, "{\"t\": %.6f, \"steps\": %ld, \"pid\": %d}\n",
                    wall.tv_sec + wall.tv_nsec / 1e9, step + 1, (int)getpid());
            fflush(progress);
            next_progress = now_ns() + 250000000L;
        }
        if (step_sleep_us > 0) usleep(step_sleep_us);
    }
    if (progress) fclose(progress);
    double elapsed = (now_ns() - start) / 1e9;
    char line[1024];
    snprintf(line, sizeof line,
             "{\"workload\": \"gpu_standin\", \"rank\": %d, \"world_size\": %d, \"pid\": %d, \"steps\": %ld, "
             "\"elapsed_s\": %.3f, \"steps_per_s\": %.3f, \"memcpy_ms_mean\": %.3f, \"allreduce_ms_mean\": %.3f, "
             "\"leaked_bytes\": %ld, \"ring_bytes_sent\": %ld, \"errors\": %d}\n",
             ring.rank, ring.world, (int)getpid(), step, elapsed, step / (elapsed > 0 ? elapsed : 1),
             step ? memcpy_ns / 1e6 / step : 0.0, step ? allreduce_ns / 1e6 / step : 0.0, leaked, ring.bytes_sent, errors);
    fputs(line, stdout);
    fflush(stdout);
    const char *rdir = getenv("FLEETSCOPE_WORKLOAD_RESULT_DIR");
    if (rdir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/rank%d.json", rdir, ring.rank);
        FILE *f = fopen(path, "w");
        if (!f || fputs(line, f) < 0 || fclose(f)) die("writing the result file");
    }
    return errors ? 5 : 0;
}

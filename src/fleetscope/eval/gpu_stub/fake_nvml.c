/* A scripted stand-in for libnvidia-ml.so.1, for tests ONLY (CI has no GPU).
 *
 * It exports just the NVML entry points that producers/nvml calls, with
 * NVML's real return codes and struct layouts (matched to pynvml's ctypes
 * structs), and answers from a scenario file whose path is read from
 * $FAKE_NVML_SCENARIO when the first nvmlInit happens. A second file,
 * $FAKE_NVML_CONTROL, is watched while the library is in use: its lines
 * override the scenario's until it changes again (a fault that starts
 * mid-run). The grammar is in NVML_README.md next to this file. Build:
 *     gcc -shared -fPIC -O1 -o libnvidia-ml.so.1 fake_nvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* NVML return codes (nvmlReturn_t), the real numbers. */
enum { OK = 0, E_UNINITIALIZED = 1, E_INVALID_ARGUMENT = 2, E_NOT_SUPPORTED = 3, E_NO_PERMISSION = 4,
       E_NOT_FOUND = 6, E_INSUFFICIENT_SIZE = 7, E_DRIVER_NOT_LOADED = 9, E_TIMEOUT = 10,
       E_GPU_IS_LOST = 15, E_ARGUMENT_VERSION_MISMATCH = 25, E_UNKNOWN = 999 };

static const struct { const char *name; int code; } ERRORS[] = {
    {"SUCCESS", OK}, {"UNINITIALIZED", E_UNINITIALIZED}, {"INVALID_ARGUMENT", E_INVALID_ARGUMENT},
    {"NOT_SUPPORTED", E_NOT_SUPPORTED}, {"NO_PERMISSION", E_NO_PERMISSION}, {"NOT_FOUND", E_NOT_FOUND},
    {"INSUFFICIENT_SIZE", E_INSUFFICIENT_SIZE}, {"DRIVER_NOT_LOADED", E_DRIVER_NOT_LOADED},
    {"TIMEOUT", E_TIMEOUT}, {"GPU_IS_LOST", E_GPU_IS_LOST}, {"UNKNOWN", E_UNKNOWN}};

/* Scripted keys. Value keys hold a series; the last four only take `fail`. */
enum { K_GPU_UTIL, K_MEM_UTIL, K_MEM_TOTAL, K_MEM_USED, K_POWER_MW, K_ENERGY_MJ, K_TEMP_C, K_SM_CLOCK,
       K_SM_CLOCK_MAX, K_MEM_CLOCK, K_MEM_CLOCK_MAX, K_THROTTLE, K_PCIE_TX, K_PCIE_RX, K_PCIE_REPLAY,
       K_ECC_CV, K_ECC_UV, K_ECC_CA, K_ECC_UA, K_REMAP_CORR, K_REMAP_UNC, K_REMAP_PENDING, K_REMAP_FAILURE,
       K_GPM_SUPPORTED, K_EVENTS_SUPPORTED, K_PROCESSES, K_PROCESS_UTIL, K_FIELDS, K_GPM, K_COUNT };
static const char *KEYS[K_COUNT] = {
    "gpu_util", "mem_util", "mem_total", "mem_used", "power_mw", "energy_mj", "temp_c", "sm_clock",
    "sm_clock_max", "mem_clock", "mem_clock_max", "throttle", "pcie_tx", "pcie_rx", "pcie_replay",
    "ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate",
    "ecc_uncorrected_aggregate", "remapped_corr", "remapped_unc", "remapped_pending", "remapped_failure",
    "gpm_supported", "events_supported", "processes", "process_util", "fields", "gpm"};

#define MAX_GPUS 8
#define MAX_VALS 16
#define MAX_ITEMS 16
#define GPM_METRIC_MAX 477 /* pynvml's NVML_GPM_METRIC_MAX: sizes the metrics array */

typedef struct { int n, next; double v[MAX_VALS]; } series; /* successive calls step; the last repeats */
typedef struct { unsigned id; series s; } keyed_series;

struct nvmlDevice_st {
    int lost, lost_after, ticks;
    series val[K_COUNT];
    int fail[K_COUNT];
    int nproc; struct { unsigned pid; double mem; } proc[MAX_ITEMS];
    int nputil; struct { unsigned pid, sm, mem; } putil[MAX_ITEMS];
    int nfield; keyed_series field[MAX_ITEMS];
    int ngpm; keyed_series gpm[MAX_ITEMS];
    int nfield_fail; struct { unsigned id; int code; } field_fail[MAX_ITEMS];
    int nxid, next_xid; unsigned long long xid[MAX_ITEMS];
    unsigned long long registered;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

/* Layouts below mirror pynvml's c_nvml*_t structs field for field. */
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned pid; unsigned long long usedGpuMemory; unsigned gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
typedef struct { unsigned pid; unsigned long long timeStamp; unsigned smUtil, memUtil, encUtil, decUtil; } nvmlProcessUtilizationSample_t;
typedef union { double dVal; unsigned uiVal; unsigned long ulVal; unsigned long long ullVal; long long sllVal; int siVal; unsigned short usVal; } nvmlValue_t;
typedef struct { unsigned fieldId, scopeId; long long timestamp, latencyUsec; unsigned valueType, nvmlReturn; nvmlValue_t value; } nvmlFieldValue_t;
typedef struct { nvmlDevice_t device; unsigned long long eventType, eventData; unsigned gpuInstanceId, computeInstanceId; } nvmlEventData_t;
typedef struct { int unused; } *nvmlEventSet_t;
typedef struct { int device; } *nvmlGpmSample_t;
typedef struct { char *shortName, *longName, *unit; } nvmlGpmMetricInfo_t;
typedef struct { unsigned metricId, nvmlReturn; double value; nvmlGpmMetricInfo_t metricInfo; } nvmlGpmMetric_t;
typedef struct { unsigned version, numMetrics; nvmlGpmSample_t sample1, sample2; nvmlGpmMetric_t metrics[GPM_METRIC_MAX]; } nvmlGpmMetricsGet_t;
typedef struct { unsigned version, isSupportedDevice; } nvmlGpmSupport_t;

#define EVENT_XID 0x8ULL /* nvmlEventTypeXidCriticalError */

static struct nvmlDevice_st gpus[MAX_GPUS];
static struct nvmlDevice_st scripted[MAX_GPUS]; /* the scenario as read: what a control change starts from */
static int device_count, init_error, refcount;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* the control reload and the Xid queue */
static struct { int unused; } the_event_set;

static double next_value(series *s) { return s->v[s->next < s->n ? s->next++ : s->n - 1]; }

static int error_code(const char *name) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof *ERRORS; i++)
        if (!strcmp(ERRORS[i].name, name)) return ERRORS[i].code;
    return atoi(name) ? atoi(name) : E_UNKNOWN;
}

static int key_index(const char *name) {
    for (int k = 0; k < K_COUNT; k++) if (!strcmp(KEYS[k], name)) return k;
    return -1;
}

static void read_series(series *s, char *rest) {
    for (char *tok = strtok(rest, " \t\n"); tok && s->n < MAX_VALS; tok = strtok(NULL, " \t\n"))
        s->v[s->n++] = strtod(tok, NULL);
}

static void scenario_line(char *line) {
    char *word = strtok(line, " \t\n");
    if (!word || word[0] == '#') return;
    if (!strcmp(word, "device_count")) { device_count = atoi(strtok(NULL, " \t\n")); return; }
    if (!strcmp(word, "init_fail")) { init_error = error_code(strtok(NULL, " \t\n")); return; }
    if (strcmp(word, "gpu") != 0) { fprintf(stderr, "fake_nvml: unknown scenario line '%s'\n", word); return; }
    int i = atoi(strtok(NULL, " \t\n"));
    char *what = strtok(NULL, " \t\n");
    if (i < 0 || i >= MAX_GPUS || !what) return;
    struct nvmlDevice_st *d = &gpus[i];
    char *rest = strtok(NULL, "\n");
    if (!rest) rest = "";
    if (!strcmp(what, "lost_after")) d->lost_after = atoi(rest);
    else if (!strcmp(what, "field_fail") && d->nfield_fail < MAX_ITEMS) {
        char err[64];
        if (sscanf(rest, "%u %63s", &d->field_fail[d->nfield_fail].id, err) == 2)
            d->field_fail[d->nfield_fail++].code = error_code(err);
    } else if (!strcmp(what, "xid")) {
        if (d->next_xid == d->nxid) d->next_xid = d->nxid = 0; /* all delivered: the queue starts over */
        if (d->nxid < MAX_ITEMS) d->xid[d->nxid++] = strtoull(rest, NULL, 10);
    }
    else if (!strcmp(what, "proc") && d->nproc < MAX_ITEMS) {
        sscanf(rest, "%u %lf", &d->proc[d->nproc].pid, &d->proc[d->nproc].mem); d->nproc++;
    } else if (!strcmp(what, "putil") && d->nputil < MAX_ITEMS) {
        sscanf(rest, "%u %u %u", &d->putil[d->nputil].pid, &d->putil[d->nputil].sm, &d->putil[d->nputil].mem);
        d->nputil++;
    } else if ((!strcmp(what, "field") && d->nfield < MAX_ITEMS) || (!strcmp(what, "gpm") && d->ngpm < MAX_ITEMS)) {
        keyed_series *ks = what[0] == 'f' ? &d->field[d->nfield++] : &d->gpm[d->ngpm++];
        char *end;
        ks->id = (unsigned)strtoul(rest, &end, 10);
        read_series(&ks->s, end);
    } else if (!strcmp(what, "fail")) {
        char key[64], err[64];
        if (sscanf(rest, "%63s %63s", key, err) == 2 && key_index(key) >= 0) d->fail[key_index(key)] = error_code(err);
        else fprintf(stderr, "fake_nvml: bad fail line for gpu %d: %s\n", i, rest);
    } else if (key_index(what) >= 0) {
        series *v = &d->val[key_index(what)];
        v->n = v->next = 0; /* a later line for the same key replaces the earlier one */
        read_series(v, rest);
    }
    else fprintf(stderr, "fake_nvml: unknown key '%s' for gpu %d\n", what, i);
}

/* Reset and read the scenario; the first nvmlInit of a session calls this. */
static int load_scenario(void) {
    memset(gpus, 0, sizeof gpus);
    for (int i = 0; i < MAX_GPUS; i++) gpus[i].lost_after = -1;
    device_count = 0;
    init_error = OK;
    const char *path = getenv("FAKE_NVML_SCENARIO");
    if (!path) return OK; /* no scenario: a machine with no GPU */
    FILE *f = fopen(path, "r");
    if (!f) { fprintf(stderr, "fake_nvml: cannot read scenario %s\n", path); return E_UNKNOWN; }
    char line[1024];
    while (fgets(line, sizeof line, f)) scenario_line(line);
    fclose(f);
    if (device_count > MAX_GPUS) device_count = MAX_GPUS;
    memcpy(scripted, gpus, sizeof gpus);
    return init_error;
}

/* The control file, re-read when it changes (stat()ed at most every 100 ms). Each change starts again from
 * the scenario's values, process lists and failures, then applies the file's `gpu N ...` lines; its `xid`
 * lines are delivered once per change. A GPU's tick count, loss, registrations and Xid queue carry on. */
static struct { int exists; long long mtime_ns; long long size; long long checked_ns; } control;

static long long now_ns(int clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void reload_control(void) {
    const char *path = getenv("FAKE_NVML_CONTROL");
    if (!path) return;
    pthread_mutex_lock(&lock);
    long long now = now_ns(CLOCK_MONOTONIC);
    if (now - control.checked_ns < 100000000LL) { pthread_mutex_unlock(&lock); return; }
    control.checked_ns = now;
    struct stat st;
    int exists = stat(path, &st) == 0;
    long long mtime = exists ? (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec : 0;
    long long size = exists ? (long long)st.st_size : 0;
    if (exists == control.exists && mtime == control.mtime_ns && size == control.size) {
        pthread_mutex_unlock(&lock);
        return;
    }
    control.exists = exists; control.mtime_ns = mtime; control.size = size;
    for (int i = 0; i < MAX_GPUS; i++) {
        struct nvmlDevice_st *d = &gpus[i], *s = &scripted[i];
        memcpy(d->val, s->val, sizeof d->val);
        memcpy(d->fail, s->fail, sizeof d->fail);
        d->nproc = s->nproc; memcpy(d->proc, s->proc, sizeof d->proc);
        d->nputil = s->nputil; memcpy(d->putil, s->putil, sizeof d->putil);
    }
    FILE *f = exists ? fopen(path, "r") : NULL;
    if (f) {
        char line[1024];
        int saved_count = device_count, saved_error = init_error;
        while (fgets(line, sizeof line, f)) scenario_line(line);
        device_count = saved_count; init_error = saved_error; /* only per-GPU lines take effect here */
        fclose(f);
    }
    pthread_mutex_unlock(&lock);
}

int nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    if (refcount == 0) {
        memset(&control, 0, sizeof control); /* a new session applies the control file afresh */
        int r = load_scenario();
        if (r != OK) return r;
    }
    refcount++;
    return OK;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) { if (refcount == 0) return E_UNINITIALIZED; refcount--; return OK; }

const char *nvmlErrorString(int r) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof *ERRORS; i++) if (ERRORS[i].code == r) return ERRORS[i].name;
    return "UNKNOWN";
}

int nvmlDeviceGetCount_v2(unsigned *count) {
    if (!refcount) return E_UNINITIALIZED;
    *count = (unsigned)device_count;
    return OK;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *device) {
    if (!refcount) return E_UNINITIALIZED;
    if (index >= (unsigned)device_count) return E_INVALID_ARGUMENT;
    *device = &gpus[index];
    return OK;
}

/* Common checks for every per-device call, in NVML's order of precedence. */
static int check(nvmlDevice_t d, int key) {
    if (!refcount) return E_UNINITIALIZED;
    reload_control();
    if (d < gpus || d >= gpus + device_count) return E_INVALID_ARGUMENT;
    if (d->lost) return E_GPU_IS_LOST;
    return d->fail[key];
}

/* The next scripted value of `key`; an unscripted key is an unsupported feature. */
static int take(nvmlDevice_t d, int key, double *out) {
    int r = check(d, key);
    if (r != OK) return r;
    if (d->val[key].n == 0) return E_NOT_SUPPORTED;
    *out = next_value(&d->val[key]);
    return OK;
}

#define TAKE(d, key, var) do { int r_ = take(d, key, &var); if (r_ != OK) return r_; } while (0)

int nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    /* The sampler reads utilization first on every tick, so this counts ticks for lost_after. */
    if (refcount && d >= gpus && d < gpus + device_count && d->lost_after >= 0 && ++d->ticks > d->lost_after)
        d->lost = 1;
    double g, m;
    TAKE(d, K_GPU_UTIL, g);
    TAKE(d, K_MEM_UTIL, m);
    u->gpu = (unsigned)g; u->memory = (unsigned)m;
    return OK;
}

int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    double total, used;
    TAKE(d, K_MEM_TOTAL, total);
    TAKE(d, K_MEM_USED, used);
    m->total = (unsigned long long)total; m->used = (unsigned long long)used; m->free = m->total - m->used;
    return OK;
}

static int get_uint(nvmlDevice_t d, int key, unsigned *out) { double v; TAKE(d, key, v); *out = (unsigned)v; return OK; }
static int get_ull(nvmlDevice_t d, int key, unsigned long long *out) { double v; TAKE(d, key, v); *out = (unsigned long long)v; return OK; }

int nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *mw) { return get_uint(d, K_POWER_MW, mw); }
int nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *mj) { return get_ull(d, K_ENERGY_MJ, mj); }
int nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *r) { return get_ull(d, K_THROTTLE, r); }
int nvmlDeviceGetPcieReplayCounter(nvmlDevice_t d, unsigned *n) { return get_uint(d, K_PCIE_REPLAY, n); }

int nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *t) {
    return sensor == 0 ? get_uint(d, K_TEMP_C, t) : E_NOT_SUPPORTED; /* 0 = NVML_TEMPERATURE_GPU */
}
int nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned *mhz) { /* 1 = SM, 2 = MEM */
    return type == 1 ? get_uint(d, K_SM_CLOCK, mhz) : type == 2 ? get_uint(d, K_MEM_CLOCK, mhz) : E_NOT_SUPPORTED;
}
int nvmlDeviceGetMaxClockInfo(nvmlDevice_t d, int type, unsigned *mhz) {
    return type == 1 ? get_uint(d, K_SM_CLOCK_MAX, mhz) : type == 2 ? get_uint(d, K_MEM_CLOCK_MAX, mhz) : E_NOT_SUPPORTED;
}
int nvmlDeviceGetPcieThroughput(nvmlDevice_t d, int counter, unsigned *kbps) { /* 0 = TX, 1 = RX */
    return counter == 0 ? get_uint(d, K_PCIE_TX, kbps) : counter == 1 ? get_uint(d, K_PCIE_RX, kbps) : E_INVALID_ARGUMENT;
}
int nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int error_type, int counter_type, unsigned long long *n) {
    /* error_type 0 corrected / 1 uncorrected; counter_type 0 volatile / 1 aggregate */
    if ((unsigned)error_type > 1 || (unsigned)counter_type > 1) return E_INVALID_ARGUMENT;
    static const int key[2][2] = {{K_ECC_CV, K_ECC_CA}, {K_ECC_UV, K_ECC_UA}};
    return get_ull(d, key[error_type][counter_type], n);
}
int nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned *corr, unsigned *unc, unsigned *pending, unsigned *failure) {
    int r;
    if ((r = get_uint(d, K_REMAP_CORR, corr)) || (r = get_uint(d, K_REMAP_UNC, unc)) ||
        (r = get_uint(d, K_REMAP_PENDING, pending)) || (r = get_uint(d, K_REMAP_FAILURE, failure)))
        return r;
    return OK;
}

int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *count, nvmlProcessInfo_t *infos) {
    int r = check(d, K_PROCESSES);
    if (r != OK) return r;
    /* NVML's two-call protocol: a short buffer gets the needed count and INSUFFICIENT_SIZE. */
    if (!infos || *count < (unsigned)d->nproc) { *count = (unsigned)d->nproc; return d->nproc ? E_INSUFFICIENT_SIZE : OK; }
    for (int i = 0; i < d->nproc; i++) {
        infos[i].pid = d->proc[i].pid;
        infos[i].usedGpuMemory = (unsigned long long)d->proc[i].mem;
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFFu; /* not MIG */
    }
    *count = (unsigned)d->nproc;
    return OK;
}

int nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *out, unsigned *count,
                                    unsigned long long last_seen_us) {
    int r = check(d, K_PROCESS_UTIL);
    if (r != OK) return r;
    if (d->nputil == 0) return E_NOT_FOUND; /* what NVML says when it holds no samples */
    if (!out || *count < (unsigned)d->nputil) { *count = (unsigned)d->nputil; return E_INSUFFICIENT_SIZE; }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long now_us = (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000;
    if (now_us <= last_seen_us) now_us = last_seen_us + 1; /* samples are always newer than last seen */
    for (int i = 0; i < d->nputil; i++) {
        out[i].pid = d->putil[i].pid; out[i].timeStamp = now_us;
        out[i].smUtil = d->putil[i].sm; out[i].memUtil = d->putil[i].mem; out[i].encUtil = out[i].decUtil = 0;
    }
    *count = (unsigned)d->nputil;
    return OK;
}

/* Field ids that read a value key, so `gpu 0 power_mw ...` and `gpu 0 fail power_mw ...` script the
 * getter and the field alike. `field <id>` lines script any other id (NVLink). */
static const struct { unsigned id; int key; unsigned type; } FIELD_KEYS[] = {
    {3, K_ECC_CV, 3}, {4, K_ECC_UV, 3}, {5, K_ECC_CA, 3}, {6, K_ECC_UA, 3},  /* ECC SBE/DBE vol/agg totals */
    {83, K_ENERGY_MJ, 3}, {94, K_PCIE_REPLAY, 1},                         /* total energy, PCIe replays */
    {142, K_REMAP_CORR, 1}, {143, K_REMAP_UNC, 1}, {144, K_REMAP_PENDING, 1}, {145, K_REMAP_FAILURE, 1},
    {186, K_POWER_MW, 1}};                                                /* instantaneous power */

/* One entry: its own nvmlReturn; the call itself succeeds (real NVML's per-field semantics). */
static void field_value(nvmlDevice_t d, nvmlFieldValue_t *v) {
    v->nvmlReturn = E_NOT_SUPPORTED;
    v->value.ullVal = 0;
    for (int j = 0; j < d->nfield_fail; j++)
        if (d->field_fail[j].id == v->fieldId) { v->nvmlReturn = (unsigned)d->field_fail[j].code; return; }
    for (int j = 0; j < d->nfield; j++)
        if (d->field[j].id == v->fieldId) {
            v->nvmlReturn = OK;
            v->valueType = 3; /* NVML_VALUE_TYPE_UNSIGNED_LONG_LONG */
            v->value.ullVal = (unsigned long long)next_value(&d->field[j].s);
            return;
        }
    for (size_t k = 0; k < sizeof FIELD_KEYS / sizeof *FIELD_KEYS; k++)
        if (FIELD_KEYS[k].id == v->fieldId) {
            int key = FIELD_KEYS[k].key;
            if (d->fail[key]) { v->nvmlReturn = (unsigned)d->fail[key]; return; }
            if (d->val[key].n == 0) return; /* unscripted: this GPU lacks it */
            double x = next_value(&d->val[key]);
            v->nvmlReturn = OK;
            v->valueType = FIELD_KEYS[k].type; /* 1 UNSIGNED_INT, 3 UNSIGNED_LONG_LONG */
            if (v->valueType == 1) v->value.uiVal = (unsigned)x; else v->value.ullVal = (unsigned long long)x;
            return;
        }
}

int nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
    int r = check(d, K_FIELDS);
    if (r != OK) return r;
    for (int i = 0; i < count; i++) field_value(d, &values[i]);
    return OK;
}

int nvmlGpmQueryDeviceSupport(nvmlDevice_t d, nvmlGpmSupport_t *support) {
    int r = check(d, K_GPM);
    if (r != OK) return r;
    if (support->version != 1) return E_ARGUMENT_VERSION_MISMATCH;
    support->isSupportedDevice = d->val[K_GPM_SUPPORTED].n ? (unsigned)next_value(&d->val[K_GPM_SUPPORTED]) : 0;
    return OK;
}

int nvmlGpmSampleAlloc(nvmlGpmSample_t *sample) {
    if (!refcount) return E_UNINITIALIZED;
    *sample = calloc(1, sizeof **sample);
    (*sample)->device = -1;
    return OK;
}
int nvmlGpmSampleFree(nvmlGpmSample_t sample) { free(sample); return OK; }

int nvmlGpmSampleGet(nvmlDevice_t d, nvmlGpmSample_t sample) {
    int r = check(d, K_GPM);
    if (r != OK) return r;
    sample->device = (int)(d - gpus);
    return OK;
}

int nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *m) {
    if (!refcount) return E_UNINITIALIZED;
    if (m->version != 1) return E_ARGUMENT_VERSION_MISMATCH;
    if (!m->sample1 || !m->sample2 || m->sample2->device < 0 || m->numMetrics > GPM_METRIC_MAX) return E_INVALID_ARGUMENT;
    struct nvmlDevice_st *d = &gpus[m->sample2->device];
    for (unsigned i = 0; i < m->numMetrics; i++) {
        m->metrics[i].nvmlReturn = E_NOT_SUPPORTED;
        for (int j = 0; j < d->ngpm; j++)
            if (d->gpm[j].id == m->metrics[i].metricId) {
                m->metrics[i].nvmlReturn = OK;
                m->metrics[i].value = next_value(&d->gpm[j].s);
            }
    }
    return OK;
}

int nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!refcount) return E_UNINITIALIZED;
    *set = (nvmlEventSet_t)&the_event_set;
    return OK;
}
int nvmlEventSetFree(nvmlEventSet_t set) { (void)set; return OK; }

int nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) {
    return get_ull(d, K_EVENTS_SUPPORTED, types);
}
int nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
    (void)set;
    unsigned long long supported;
    int r = get_ull(d, K_EVENTS_SUPPORTED, &supported);
    if (r != OK) return r;
    if (types & ~supported) return E_NOT_SUPPORTED;
    d->registered |= types;
    return OK;
}

/* Delivers each scripted XID once, in order, to a set that registered for XIDs; then times out. */
int nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms) {
    (void)set;
    if (!refcount) return E_UNINITIALIZED;
    long long deadline = now_ns(CLOCK_MONOTONIC) + (long long)timeout_ms * 1000000LL;
    do { /* a control file's Xid may arrive while this waits, as a real event would */
        reload_control();
        pthread_mutex_lock(&lock);
        for (int i = 0; i < device_count; i++) {
            struct nvmlDevice_st *d = &gpus[i];
            if ((d->registered & EVENT_XID) && d->next_xid < d->nxid) {
                data->device = d; data->eventType = EVENT_XID; data->eventData = d->xid[d->next_xid++];
                data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
                pthread_mutex_unlock(&lock);
                return OK;
            }
        }
        pthread_mutex_unlock(&lock);
        long long left = deadline - now_ns(CLOCK_MONOTONIC);
        if (left > 0) usleep((useconds_t)((left < 100000000LL ? left : 100000000LL) / 1000));
    } while (now_ns(CLOCK_MONOTONIC) < deadline);
    return E_TIMEOUT;
}

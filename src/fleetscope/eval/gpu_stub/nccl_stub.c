/* Stand-in for libnccl.so.2 (no GPU, no NCCL here): the real exported names
 * and C signatures, including the by-value 128-byte ncclUniqueId of
 * ncclCommInitRank, which the x86-64 ABI passes on the stack. */
#include <stddef.h>
#include <stdlib.h>
#include "stub_control.h"

typedef int ncclResult_t, ncclDataType_t, ncclRedOp_t;
typedef struct ncclComm *ncclComm_t;
typedef void *cudaStream_t;
typedef struct { char internal[128]; } ncclUniqueId;

/* Not an NCCL symbol: a workload may register a function that moves a
 * collective's bytes for real (the GPU stand-in's TCP ring). A collective
 * then returns only after its delay and the hook, as a blocking collective
 * would; its return code is the hook's when the stub itself succeeded. */
typedef int (*gpu_stub_collective_fn)(const char *api, size_t count, int datatype, void *arg);
static gpu_stub_collective_fn stub_hook;
static void *stub_hook_arg;
void gpu_stub_set_collective_hook(gpu_stub_collective_fn fn, void *arg) { stub_hook = fn; stub_hook_arg = arg; }
#define STUB_COLL(name, count, dt) ({ int rc_ = STUB_RC(name); \
    (rc_ == 0 && stub_hook) ? stub_hook(name, count, dt, stub_hook_arg) : rc_; })

/* A stand-in communicator knows its rank and size, so ncclCommUserRank/ncclCommCount can answer. */
struct ncclComm { int rank, nranks; };
typedef struct ncclConfig_v21700 { size_t size; unsigned magic, version; int blocking, cgaClusterSize, minCTAs,
                                   maxCTAs; const char *netName; int splitShare; } ncclConfig_t;
#define NCCL_SPLIT_NOCOLOR (-1)
static ncclComm_t new_comm(int rank, int nranks) {
    ncclComm_t c = malloc(sizeof *c);
    if (c) { c->rank = rank; c->nranks = nranks; }
    return c;
}
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    (void)commId;
    STUB_CALL("ncclCommInitRank");
    *comm = new_comm(rank, nranks);
    return *comm ? 0 : 1;
}
/* PyTorch's way (ProcessGroupNCCL): the same, with a config. */
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config) {
    (void)commId; (void)config;
    STUB_CALL("ncclCommInitRankConfig");
    *comm = new_comm(rank, nranks);
    return *comm ? 0 : 1;
}
/* One process, ndev devices: comms[i] is rank i of ndev. */
ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    (void)devlist;
    STUB_CALL("ncclCommInitAll");
    for (int i = 0; i < ndev; i++) comms[i] = new_comm(i, ndev);
    return 0;
}
/* A split: the stand-in is one process, so it cannot see the other members; it makes the
 * new rank the key (as PyTorch passes it: the rank in the new group) and the size the
 * knob split_nranks (default: the parent's). NCCL_SPLIT_NOCOLOR leaves the caller out. */
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
    (void)config;
    STUB_CALL("ncclCommSplit");
    if (color == NCCL_SPLIT_NOCOLOR) { *newcomm = NULL; return 0; }
    const char *n = getenv("GPU_STUB_SPLIT_NRANKS");
    *newcomm = new_comm(key, n ? atoi(n) : comm->nranks);
    return 0;
}
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) { *rank = comm->rank; return STUB_RC("ncclCommUserRank"); }
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) { *count = comm->nranks; return STUB_RC("ncclCommCount"); }
ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    (void)s; (void)r; (void)count; (void)dt; (void)op; (void)comm; (void)stream; return STUB_COLL("ncclAllReduce", count, dt);
}
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t recvcount, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    (void)s; (void)r; (void)recvcount; (void)dt; (void)op; (void)comm; (void)stream; return STUB_COLL("ncclReduceScatter", recvcount, dt);
}
ncclResult_t ncclAllGather(const void *s, void *r, size_t sendcount, ncclDataType_t dt, ncclComm_t comm, cudaStream_t stream) {
    (void)s; (void)r; (void)sendcount; (void)dt; (void)comm; (void)stream; return STUB_COLL("ncclAllGather", sendcount, dt);
}
ncclResult_t ncclBroadcast(const void *s, void *r, size_t count, ncclDataType_t dt, int root, ncclComm_t comm, cudaStream_t stream) {
    (void)s; (void)r; (void)count; (void)dt; (void)root; (void)comm; (void)stream; return STUB_COLL("ncclBroadcast", count, dt);
}
ncclResult_t ncclReduce(const void *s, void *r, size_t count, ncclDataType_t dt, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    (void)s; (void)r; (void)count; (void)dt; (void)op; (void)root; (void)comm; (void)stream; return STUB_COLL("ncclReduce", count, dt);
}
ncclResult_t ncclSend(const void *s, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t stream) {
    (void)s; (void)count; (void)dt; (void)peer; (void)comm; (void)stream; return STUB_RC("ncclSend");
}
ncclResult_t ncclRecv(void *r, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t stream) {
    (void)r; (void)count; (void)dt; (void)peer; (void)comm; (void)stream; return STUB_RC("ncclRecv");
}
ncclResult_t ncclGroupStart(void) { return STUB_RC("ncclGroupStart"); }
ncclResult_t ncclGroupEnd(void) { return STUB_RC("ncclGroupEnd"); }

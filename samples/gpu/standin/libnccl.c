/*
 * A stand-in libnccl.so.2: the real soname and the signatures of nccl.h for the calls
 * tokentrace probes. Collectives do nothing; every call is counted, and at exit the
 * counts go as JSON to the file named by TT_STANDIN_NCCL_COUNTS.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef struct CUstream_st *cudaStream_t;
#define EXPORT __attribute__((visibility("default"), noinline))

static const int dtype_size[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
enum { N_ALLREDUCE, N_ALLGATHER, N_REDUCESCATTER, N_BROADCAST, N_REDUCE, N_SEND, N_RECV,
       N_GROUP_START, N_GROUP_END, N_COMM_INIT, N_OPS };
static const char *op_names[N_OPS] = {"allreduce", "allgather", "reducescatter",
    "broadcast", "reduce", "send", "recv", "group_start", "group_end", "comm_init"};
static _Atomic unsigned long long calls[N_OPS], bytes[N_OPS];

static ncclResult_t did(int op, size_t count, ncclDataType_t t)
{
    atomic_fetch_add(&calls[op], 1);
    if (t >= 0 && t < 12)
        atomic_fetch_add(&bytes[op], count * dtype_size[t]);
    return 0;
}

__attribute__((destructor)) static void write_counts(void)
{
    const char *path = getenv("TT_STANDIN_NCCL_COUNTS");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (!f)
        return;
    fprintf(f, "{");
    for (int i = 0; i < N_OPS; i++)
        fprintf(f, "%s\"%s\": [%llu, %llu]", i ? ", " : "", op_names[i],
                (unsigned long long)calls[i], (unsigned long long)bytes[i]);
    fprintf(f, "}\n");
    fclose(f);
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    memset(id, 0, sizeof(*id));
    for (int i = 0; i < 8; i++)
        id->internal[i] = (char)(0x11 * (i + 1));
    return 0;
}
EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    (void)id;
    *comm = (ncclComm_t)calloc(1, 64);
    atomic_fetch_add(&calls[N_COMM_INIT], 1);
    return nranks > rank ? 0 : 4; /* ncclInvalidArgument */
}
EXPORT ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, ncclDataType_t t,
                                  ncclRedOp_t op, ncclComm_t c, cudaStream_t st)
{ return did(N_ALLREDUCE, n, t); }
EXPORT ncclResult_t ncclAllGather(const void *s, void *r, size_t n, ncclDataType_t t,
                                  ncclComm_t c, cudaStream_t st)
{ return did(N_ALLGATHER, n, t); }
EXPORT ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, ncclDataType_t t,
                                      ncclRedOp_t op, ncclComm_t c, cudaStream_t st)
{ return did(N_REDUCESCATTER, n, t); }
EXPORT ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, ncclDataType_t t,
                                  int root, ncclComm_t c, cudaStream_t st)
{ return did(N_BROADCAST, n, t); }
EXPORT ncclResult_t ncclReduce(const void *s, void *r, size_t n, ncclDataType_t t,
                               ncclRedOp_t op, int root, ncclComm_t c, cudaStream_t st)
{ return did(N_REDUCE, n, t); }
EXPORT ncclResult_t ncclSend(const void *b, size_t n, ncclDataType_t t, int peer,
                             ncclComm_t c, cudaStream_t st)
{ return did(N_SEND, n, t); }
EXPORT ncclResult_t ncclRecv(void *b, size_t n, ncclDataType_t t, int peer, ncclComm_t c,
                             cudaStream_t st)
{ return did(N_RECV, n, t); }
EXPORT ncclResult_t ncclGroupStart(void) { atomic_fetch_add(&calls[N_GROUP_START], 1); return 0; }
EXPORT ncclResult_t ncclGroupEnd(void) { atomic_fetch_add(&calls[N_GROUP_END], 1); return 0; }

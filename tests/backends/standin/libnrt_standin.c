/*
 * kvpush STAND-IN for the Neuron runtime library (libnrt.so.1). It is NOT the Neuron runtime: it
 * exports, with the signatures documented in the Neuron SDK's nrt.h / nrt_version.h, the few symbols
 * kvpush probes and uses, over malloc'd host memory, so that symbol probing, the prerequisite checks
 * and host staging can be tested without Trainium. Written for kvpush's tests; compiled at test time.
 *
 * Modelled behaviour (documented facts, see ../shared/notes/neuron.md):
 *  - APIs return NRT_UNINITIALIZED (13) before nrt_init() and NRT_CLOSED (14) after nrt_close()
 *    (nrt_status.h), except the core-count getters, which nrt.h documents as callable before nrt_init();
 *  - the runtime tracks tensors that a pending execution writes and blocks reads of them until the
 *    execution is done (nrt.h: batch reads take an `unsafe` flag to "skip tensor tracking/blocking");
 *    standin_execute_async() stands for a NEFF that writes a tensor (vLLM Neuron's KV, aliased in and
 *    out of the compiled graph) after a delay, on its own thread;
 *  - device tensors have a virtual address only when NEURON_RT_MAP_HBM=1 was set when nrt_init() ran
 *    (nrt_tensor_get_va returns NULL otherwise: the "data_ptr() == 0" case);
 *  - nrt_get_attached_efa_bdf(va) answers for addresses inside a live device tensor (runtime >= 2.31.24);
 *    build with -DSTANDIN_NO_EFA_BDF to model an older runtime without the symbol, and with
 *    -DSTANDIN_NO_MEMORY_STATS for one without nrt_get_vnc_memory_stats.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int NRT_STATUS;
#define NRT_SUCCESS 0
#define NRT_FAILURE 1
#define NRT_INVALID 2
#define NRT_RESOURCE 4
#define NRT_UNINITIALIZED 13
#define NRT_CLOSED 14

#ifndef STANDIN_RT_MAJOR
#define STANDIN_RT_MAJOR 2
#define STANDIN_RT_MINOR 31
#define STANDIN_RT_PATCH 24
#endif
#define STANDIN_NC_COUNT 8
#define MAX_TENSORS 1024

typedef struct nrt_version {
    uint64_t rt_major;
    uint64_t rt_minor;
    uint64_t rt_patch;
    uint64_t rt_maintenance;
    char rt_detail[128];
    char git_hash[64];
} nrt_version_t;

typedef struct nrt_tensor {
    unsigned char *mem;
    size_t size;
    int placement;
    int lnc;
    int pending; /* executions in flight that write this tensor */
    pthread_mutex_t lock;
    pthread_cond_t done;
} nrt_tensor_t;

enum { STATE_START = 0, STATE_INIT = 1, STATE_CLOSED = 2 };
static int g_state = STATE_START;
#define g_inited (g_state == STATE_INIT)
#define NOT_INITED_STATUS (g_state == STATE_CLOSED ? NRT_CLOSED : NRT_UNINITIALIZED)
static int g_map_hbm = 0;
static void wait_written(nrt_tensor_t *t);
static nrt_tensor_t *g_live[MAX_TENSORS];

NRT_STATUS nrt_init(int framework, const char *fw_version, const char *fal_version) {
    (void)framework;
    (void)fw_version;
    (void)fal_version;
    const char *map = getenv("NEURON_RT_MAP_HBM");
    g_map_hbm = map != NULL && strcmp(map, "1") == 0;
    g_state = STATE_INIT;
    return NRT_SUCCESS;
}

void nrt_close(void) { g_state = STATE_CLOSED; }

NRT_STATUS nrt_get_version(nrt_version_t *ver, size_t size) {
    nrt_version_t v;
    memset(&v, 0, sizeof(v));
    v.rt_major = STANDIN_RT_MAJOR;
    v.rt_minor = STANDIN_RT_MINOR;
    v.rt_patch = STANDIN_RT_PATCH;
    snprintf(v.rt_detail, sizeof(v.rt_detail), "kvpush libnrt stand-in");
    memcpy(ver, &v, size < sizeof(v) ? size : sizeof(v));
    return NRT_SUCCESS;
}

/* nrt.h: "This API can be called before nrt_init()" - so it cannot tell whether the runtime is up. */
NRT_STATUS nrt_get_visible_nc_count(uint32_t *nc_count) {
    *nc_count = STANDIN_NC_COUNT;
    return NRT_SUCCESS;
}

#ifndef STANDIN_NO_MEMORY_STATS
typedef struct nrt_vnc_memory_stats {
    size_t bytes_used;
    size_t bytes_limit;
} nrt_vnc_memory_stats_t;

NRT_STATUS nrt_get_vnc_memory_stats(uint32_t vnc, nrt_vnc_memory_stats_t *stats, size_t stats_size_in,
                                    size_t *stats_size_out) {
    if (!g_inited) return NOT_INITED_STATUS;
    if (vnc >= STANDIN_NC_COUNT || stats == NULL || stats_size_out == NULL) return NRT_INVALID;
    nrt_vnc_memory_stats_t v = {0, (size_t)16 << 30};
    size_t n = stats_size_in < sizeof(v) ? stats_size_in : sizeof(v);
    memcpy(stats, &v, n);
    *stats_size_out = n;
    return NRT_SUCCESS;
}
#endif

NRT_STATUS nrt_tensor_allocate(int placement, int logical_nc_id, size_t size, const char *name,
                               nrt_tensor_t **tensor) {
    (void)name;
    if (!g_inited) return NOT_INITED_STATUS;
    if (size == 0 || tensor == NULL) return NRT_INVALID;
    for (int i = 0; i < MAX_TENSORS; i++) {
        if (g_live[i] == NULL) {
            nrt_tensor_t *t = calloc(1, sizeof(*t));
            size_t rounded = (size + 4095) & ~(size_t)4095;
            if (t == NULL || (t->mem = aligned_alloc(4096, rounded)) == NULL) {
                free(t);
                return NRT_RESOURCE;
            }
            memset(t->mem, 0, rounded);
            t->size = size;
            t->placement = placement;
            t->lnc = logical_nc_id;
            pthread_mutex_init(&t->lock, NULL);
            pthread_cond_init(&t->done, NULL);
            g_live[i] = t;
            *tensor = t;
            return NRT_SUCCESS;
        }
    }
    return NRT_RESOURCE;
}

void nrt_tensor_free(nrt_tensor_t **tensor) {
    if (tensor == NULL || *tensor == NULL) return;
    wait_written(*tensor);
    for (int i = 0; i < MAX_TENSORS; i++) {
        if (g_live[i] == *tensor) g_live[i] = NULL;
    }
    free((*tensor)->mem);
    free(*tensor);
    *tensor = NULL;
}

void *nrt_tensor_get_va(const nrt_tensor_t *tensor) {
    return (tensor != NULL && g_map_hbm) ? tensor->mem : NULL;
}

static void wait_written(nrt_tensor_t *t) {
    pthread_mutex_lock(&t->lock);
    while (t->pending > 0) pthread_cond_wait(&t->done, &t->lock);
    pthread_mutex_unlock(&t->lock);
}

/* A tracked read: it returns once no execution in flight writes the tensor any more. */
NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size) {
    if (tensor == NULL || offset > tensor->size || size > tensor->size - offset) return NRT_INVALID;
    wait_written((nrt_tensor_t *)tensor);
    memcpy(buf, tensor->mem + offset, size);
    return NRT_SUCCESS;
}

/* Stand-in only (no libnrt symbol): an execution that fills [offset, offset + size) of the tensor with
 * `value` after `delay_us`, on its own thread, as a NEFF writing the KV cache would; until it is done,
 * reads of the tensor block. */
typedef struct {
    nrt_tensor_t *t;
    size_t offset, size;
    int value;
    unsigned delay_us;
} standin_exec_t;

static void *run_exec(void *arg) {
    standin_exec_t *e = arg;
    struct timespec ts = {e->delay_us / 1000000, (long)(e->delay_us % 1000000) * 1000};
    nanosleep(&ts, NULL);
    memset(e->t->mem + e->offset, e->value, e->size);
    pthread_mutex_lock(&e->t->lock);
    e->t->pending--;
    pthread_cond_broadcast(&e->t->done);
    pthread_mutex_unlock(&e->t->lock);
    free(e);
    return NULL;
}

NRT_STATUS standin_execute_async(nrt_tensor_t *tensor, size_t offset, size_t size, int value,
                                 unsigned delay_us) {
    if (!g_inited) return NOT_INITED_STATUS;
    if (tensor == NULL || offset > tensor->size || size > tensor->size - offset) return NRT_INVALID;
    standin_exec_t *e = malloc(sizeof(*e));
    if (e == NULL) return NRT_RESOURCE;
    *e = (standin_exec_t){tensor, offset, size, value, delay_us};
    pthread_mutex_lock(&tensor->lock);
    tensor->pending++;
    pthread_mutex_unlock(&tensor->lock);
    pthread_t th;
    if (pthread_create(&th, NULL, run_exec, e) != 0) {
        pthread_mutex_lock(&tensor->lock);
        tensor->pending--;
        pthread_mutex_unlock(&tensor->lock);
        free(e);
        return NRT_FAILURE;
    }
    pthread_detach(th);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size) {
    if (tensor == NULL || offset > tensor->size || size > tensor->size - offset) return NRT_INVALID;
    memcpy(tensor->mem + offset, buf, size);
    return NRT_SUCCESS;
}

#ifndef STANDIN_NO_EFA_BDF
NRT_STATUS nrt_get_attached_efa_bdf(const void *va, char *efa_bdf, size_t *len) {
    const unsigned char *p = va;
    for (int i = 0; i < MAX_TENSORS; i++) {
        nrt_tensor_t *t = g_live[i];
        if (t != NULL && p >= t->mem && p < t->mem + t->size) {
            char bdf[16];
            int n = snprintf(bdf, sizeof(bdf), "0000:%02x:1c.0", 0x10 + t->lnc / 2);
            if (*len < (size_t)n + 1) return NRT_RESOURCE;
            memcpy(efa_bdf, bdf, (size_t)n + 1);
            *len = (size_t)n;
            return NRT_SUCCESS;
        }
    }
    return NRT_FAILURE;
}
#endif

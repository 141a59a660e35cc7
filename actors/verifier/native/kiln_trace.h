/* kiln_trace.h: the device's record of what ran, part of kiln_native (included by kiln_native.c).
 *
 * CUPTI's activity API, driven by this code alone and switched on only around the requests the
 * verifier traces:
 *   trace_attach(path)  load CUPTI from `path` and register this file's buffer callbacks (before the
 *                       seal: the sandbox calls it, then one empty start/stop, in _prepare)
 *   trace_start()       forget earlier records; enable kernel, copy and memset records
 *   trace_stop()        disable them, flush, and give ([kind, name, start_ns, end_ns, stream], ...,
 *                       dropped): every kernel (its mangled name), copy ("Memcpy HtoD" ...) and memset
 *                       the device ran in between, and how many records were lost
 * Between a stop and the next start no activity kind is enabled and no callback is subscribed, so a
 * timed call pays nothing for the trace (torch's profiler, once started, stays subscribed to every
 * launch: a timed relu read 40 us slow).
 *
 * The records are read at fixed offsets that every CUPTI since CUDA 10 (API version 12) shares: the
 * kernel record's start, end, streamId and name, the copy's kind and the memset's times. Buffers are
 * a fixed pool allocated at attach, so a trace allocates nothing; a trace longer than the pool drops
 * records and says how many (the verifier treats a trace with drops as incomplete).
 */
#ifndef KILN_TRACE_H
#define KILN_TRACE_H

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TRACE_KIND_MEMCPY 1
#define TRACE_KIND_MEMSET 2
#define TRACE_KIND_KERNEL 3
#define TRACE_KIND_CONCURRENT_KERNEL 10
#define TRACE_FLUSH_FORCED 1
#define TRACE_MIN_API_VERSION 12 /* CUDA 10.0: the record prefix read below is that version's on */
#define TRACE_BUFFERS 16
#define TRACE_BUFFER_BYTES (1u << 20)
#define TRACE_RECORDS 65536

typedef void (*trace_requested_t)(uint8_t **, size_t *, size_t *);
typedef void (*trace_completed_t)(void *, uint32_t, uint8_t *, size_t, size_t);
typedef int (*cupti_register_t)(trace_requested_t, trace_completed_t);
typedef int (*cupti_kind_t)(int);
typedef int (*cupti_flush_t)(uint32_t);
typedef int (*cupti_next_t)(uint8_t *, size_t, void **);
typedef int (*cupti_version_t)(uint32_t *);

typedef struct {
    int kind; /* TRACE_KIND_* */
    int copy_kind;
    uint64_t start, end;
    uint32_t stream;
    const char *name; /* CUPTI's: shared by every record of a kernel, alive while CUPTI is attached */
} TraceRecord;

static struct {
    int attached;
    cupti_kind_t enable, disable;
    cupti_flush_t flush_all;
    cupti_next_t next_record;
    pthread_mutex_t lock; /* the completion callback runs on CUPTI's thread */
    uint8_t *pool[TRACE_BUFFERS];
    int free_buffers;
    TraceRecord *records;
    size_t kept, dropped;
} g_trace = {.lock = PTHREAD_MUTEX_INITIALIZER};

static const int g_trace_kinds[] = {TRACE_KIND_CONCURRENT_KERNEL, TRACE_KIND_MEMCPY, TRACE_KIND_MEMSET};
#define TRACE_NKINDS ((int)(sizeof(g_trace_kinds) / sizeof(g_trace_kinds[0])))

static uint64_t rd64(const uint8_t *p, size_t at) { uint64_t v; memcpy(&v, p + at, 8); return v; }
static uint32_t rd32(const uint8_t *p, size_t at) { uint32_t v; memcpy(&v, p + at, 4); return v; }

static void trace_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    pthread_mutex_lock(&g_trace.lock);
    if (g_trace.free_buffers > 0) {
        *buffer = g_trace.pool[--g_trace.free_buffers];
        *size = TRACE_BUFFER_BYTES;
    } else { /* the pool is out: CUPTI drops these records and counts them */
        *buffer = NULL;
        *size = 0;
        g_trace.dropped++; /* at least one record: the trace is incomplete */
    }
    *max_records = 0;
    pthread_mutex_unlock(&g_trace.lock);
}

/* One record into the store: its kind's fields at the offsets of the packed, 8-aligned layouts. */
static void trace_keep(const uint8_t *r) {
    uint32_t kind = rd32(r, 0);
    TraceRecord t = {0};
    if (kind == TRACE_KIND_CONCURRENT_KERNEL || kind == TRACE_KIND_KERNEL) {
        t.kind = TRACE_KIND_KERNEL;
        t.start = rd64(r, 16), t.end = rd64(r, 24), t.stream = rd32(r, 48);
        memcpy(&t.name, r + 104, sizeof t.name);
    } else if (kind == TRACE_KIND_MEMCPY || kind == TRACE_KIND_MEMSET) {
        t.kind = (int)kind;
        t.copy_kind = kind == TRACE_KIND_MEMCPY ? r[4] : 0;
        t.start = rd64(r, 16), t.end = rd64(r, 24), t.stream = rd32(r, 40);
    } else {
        return;
    }
    if (g_trace.kept < TRACE_RECORDS) g_trace.records[g_trace.kept++] = t;
    else g_trace.dropped++;
}

static void trace_completed(void *ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    if (buffer == NULL) return;
    pthread_mutex_lock(&g_trace.lock);
    void *record = NULL;
    while (g_trace.next_record(buffer, valid, &record) == 0) trace_keep((const uint8_t *)record);
    g_trace.pool[g_trace.free_buffers++] = buffer;
    pthread_mutex_unlock(&g_trace.lock);
}

static PyObject *py_trace_attach(PyObject *self, PyObject *arg) {
    if (g_trace.attached) Py_RETURN_NONE;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return PyErr_Format(PyExc_RuntimeError, "CUPTI did not load: %s", dlerror());
    cupti_version_t version = (cupti_version_t)dlsym(lib, "cuptiGetVersion");
    cupti_register_t register_callbacks = (cupti_register_t)dlsym(lib, "cuptiActivityRegisterCallbacks");
    g_trace.enable = (cupti_kind_t)dlsym(lib, "cuptiActivityEnable");
    g_trace.disable = (cupti_kind_t)dlsym(lib, "cuptiActivityDisable");
    g_trace.flush_all = (cupti_flush_t)dlsym(lib, "cuptiActivityFlushAll");
    g_trace.next_record = (cupti_next_t)dlsym(lib, "cuptiActivityGetNextRecord");
    if (!version || !register_callbacks || !g_trace.enable || !g_trace.disable || !g_trace.flush_all ||
        !g_trace.next_record)
        return PyErr_Format(PyExc_RuntimeError, "%s lacks CUPTI's activity API", path);
    uint32_t v = 0;
    if (version(&v) != 0 || v < TRACE_MIN_API_VERSION)
        return PyErr_Format(PyExc_RuntimeError, "CUPTI API version %u is older than %d", v, TRACE_MIN_API_VERSION);
    g_trace.records = (TraceRecord *)calloc(TRACE_RECORDS, sizeof(TraceRecord));
    if (g_trace.records == NULL) return PyErr_NoMemory();
    for (int i = 0; i < TRACE_BUFFERS; i++) {
        g_trace.pool[i] = (uint8_t *)aligned_alloc(8, TRACE_BUFFER_BYTES);
        if (g_trace.pool[i] == NULL) return PyErr_NoMemory();
    }
    g_trace.free_buffers = TRACE_BUFFERS;
    int rc = register_callbacks(trace_requested, trace_completed);
    if (rc != 0) return PyErr_Format(PyExc_RuntimeError, "cuptiActivityRegisterCallbacks failed (%d)", rc);
    g_trace.attached = 1;
    Py_RETURN_NONE;
}

static PyObject *py_trace_start(PyObject *self, PyObject *unused) {
    if (!g_trace.attached) return PyErr_Format(PyExc_RuntimeError, "the device trace is not attached");
    pthread_mutex_lock(&g_trace.lock);
    g_trace.kept = 0, g_trace.dropped = 0;
    pthread_mutex_unlock(&g_trace.lock);
    for (int i = 0; i < TRACE_NKINDS; i++) {
        int rc = g_trace.enable(g_trace_kinds[i]);
        if (rc != 0) return PyErr_Format(PyExc_RuntimeError, "cuptiActivityEnable(%d) failed (%d)", g_trace_kinds[i], rc);
    }
    Py_RETURN_NONE;
}

static const char *trace_copy_name(int copy_kind) {
    switch (copy_kind) {
    case 1: return "Memcpy HtoD";
    case 2: return "Memcpy DtoH";
    case 8: return "Memcpy DtoD";
    case 9: return "Memcpy HtoH";
    case 10: return "Memcpy PtoP";
    default: return "Memcpy (other)";
    }
}

static PyObject *py_trace_stop(PyObject *self, PyObject *unused) {
    if (!g_trace.attached) return PyErr_Format(PyExc_RuntimeError, "the device trace is not attached");
    for (int i = 0; i < TRACE_NKINDS; i++) g_trace.disable(g_trace_kinds[i]);
    g_trace.flush_all(TRACE_FLUSH_FORCED); /* every completed buffer through trace_completed, now */
    pthread_mutex_lock(&g_trace.lock);
    size_t n = g_trace.kept, dropped = g_trace.dropped;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        const TraceRecord *t = &g_trace.records[i];
        const char *name = t->kind == TRACE_KIND_KERNEL ? (t->name ? t->name : "(unnamed kernel)")
                           : t->kind == TRACE_KIND_MEMCPY ? trace_copy_name(t->copy_kind)
                                                          : "Memset";
        const char *kind = t->kind == TRACE_KIND_KERNEL ? "kernel" : t->kind == TRACE_KIND_MEMCPY ? "memcpy" : "memset";
        PyObject *text = PyUnicode_DecodeUTF8(name, (Py_ssize_t)strlen(name), "replace");
        PyObject *item = text == NULL ? NULL
                                      : Py_BuildValue("(sNKKI)", kind, text, (unsigned long long)t->start,
                                                      (unsigned long long)t->end, (unsigned int)t->stream);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    g_trace.kept = 0;
    pthread_mutex_unlock(&g_trace.lock);
    if (out == NULL) return NULL;
    return Py_BuildValue("(Nn)", out, (Py_ssize_t)dropped);
}

#endif

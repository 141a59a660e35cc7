/* kiln_clock.h: the per-call clock of the timing protocol (actors/verifier/timing.py), part of
 * kiln_native (included by kiln_native.c, so the sandbox and the verifier load the same code).
 *
 * `CallClock(device_type, stream, flush_ptr, flush_bytes, marks)` holds `marks` time stamps:
 *   cuda  CUDA events recorded on `stream` (the caller's stream), read with cuEventElapsedTime; the
 *         L2 flush is a cuMemsetD8Async of `flush_bytes` at `flush_ptr` on the same stream, after the
 *         persisting-L2 set-aside is reset to none (a line pinned there survives a flush); `idle`
 *         waits until the whole device is idle (cuCtxSynchronize). All through the CUDA driver
 *         library that torch already loaded, looked up when the clock is made: no ATen operator,
 *         no dispatcher, nothing a candidate's registration or patch can reach.
 *   cpu   CLOCK_MONOTONIC read at `mark`; `flush` and `idle` do nothing.
 * `spans(n)` gives the n call times in seconds: mark 2i to mark 2i+1, i < n.
 * `preroll(seconds, head_start)` readies a trip: the device busy with flushes (cuda) or the core spinning (cpu).
 *
 * The type cannot be subclassed and its methods are C functions: the sandbox binds them before
 * sealing. What the candidate's native code could still do (write this process's memory) is
 * bounded by the verifier's own clock (timing.TripTimes.paid_s), never trusted alone.
 */
#ifndef KILN_CLOCK_H
#define KILN_CLOCK_H

#include <dlfcn.h>
#include <time.h>

typedef int (*cu_event_create_t)(void **, unsigned int);
typedef int (*cu_event_record_t)(void *, void *);
typedef int (*cu_event_elapsed_t)(float *, void *, void *);
typedef int (*cu_event_destroy_t)(void *);
typedef int (*cu_memset_t)(unsigned long long, unsigned char, size_t, void *);
typedef int (*cu_ctx_sync_t)(void);
typedef int (*cu_ctx_get_t)(void **);
typedef int (*cu_ctx_set_t)(void *);
typedef int (*cu_ctx_reset_l2_t)(void);
typedef int (*cu_ctx_set_limit_t)(int, size_t);
typedef int (*cu_ctx_get_limit_t)(size_t *, int);
#define CU_LIMIT_PERSISTING_L2_CACHE_SIZE 0x06

static struct {
    int resolved;
    cu_event_create_t event_create;
    cu_event_record_t event_record;
    cu_event_elapsed_t event_elapsed;
    cu_event_destroy_t event_destroy;
    cu_memset_t memset_async;
    cu_ctx_sync_t ctx_sync;
    cu_ctx_get_t ctx_get;
    cu_ctx_set_t ctx_set;
    cu_ctx_reset_l2_t reset_l2;     /* optional: devices and drivers without persisting L2 lack them */
    cu_ctx_set_limit_t set_limit;
    cu_ctx_get_limit_t get_limit;
} g_cu;

static void *cu_symbol(void *lib, const char *name, const char *fallback) {
    void *fn = dlsym(lib, name);
    return fn != NULL || fallback == NULL ? fn : dlsym(lib, fallback);
}

/* The driver library torch loaded (RTLD_NOLOAD: no file is opened), else the one on the path. */
static int cu_resolve(void) {
    if (g_cu.resolved) return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) return -1;
    g_cu.event_create = (cu_event_create_t)cu_symbol(lib, "cuEventCreate", NULL);
    g_cu.event_record = (cu_event_record_t)cu_symbol(lib, "cuEventRecord", NULL);
    g_cu.event_elapsed = (cu_event_elapsed_t)cu_symbol(lib, "cuEventElapsedTime_v2", "cuEventElapsedTime");
    g_cu.event_destroy = (cu_event_destroy_t)cu_symbol(lib, "cuEventDestroy_v2", "cuEventDestroy");
    g_cu.memset_async = (cu_memset_t)cu_symbol(lib, "cuMemsetD8Async", NULL);
    g_cu.ctx_sync = (cu_ctx_sync_t)cu_symbol(lib, "cuCtxSynchronize", NULL);
    g_cu.ctx_get = (cu_ctx_get_t)cu_symbol(lib, "cuCtxGetCurrent", NULL);
    g_cu.ctx_set = (cu_ctx_set_t)cu_symbol(lib, "cuCtxSetCurrent", NULL);
    g_cu.reset_l2 = (cu_ctx_reset_l2_t)cu_symbol(lib, "cuCtxResetPersistingL2Cache", NULL);
    g_cu.set_limit = (cu_ctx_set_limit_t)cu_symbol(lib, "cuCtxSetLimit", NULL);
    g_cu.get_limit = (cu_ctx_get_limit_t)cu_symbol(lib, "cuCtxGetLimit", NULL);
    if (!g_cu.event_create || !g_cu.event_record || !g_cu.event_elapsed || !g_cu.event_destroy ||
        !g_cu.memset_async || !g_cu.ctx_sync || !g_cu.ctx_get || !g_cu.ctx_set)
        return -1;
    g_cu.resolved = 1;
    return 0;
}

#define CLOCK_MAX_MARKS 1024

typedef struct {
    PyObject_HEAD
    int cuda;
    int marks;
    void *stream;
    void *ctx;
    unsigned long long flush_ptr;
    size_t flush_bytes;
    void *events[CLOCK_MAX_MARKS];
    struct timespec stamps[CLOCK_MAX_MARKS];
} CallClock;

static PyObject *cu_failed(const char *what, int code) {
    return PyErr_Format(PyExc_RuntimeError, "CUDA driver error %d in %s", code, what), NULL;
}

static PyObject *clock_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)kwds;
    const char *device;
    unsigned long long stream, flush_ptr;
    Py_ssize_t flush_bytes;
    int marks;
    if (!PyArg_ParseTuple(args, "sKKni:CallClock", &device, &stream, &flush_ptr, &flush_bytes, &marks))
        return NULL;
    if (marks < 2 || marks > CLOCK_MAX_MARKS || flush_bytes < 0)
        return PyErr_Format(PyExc_ValueError, "marks must be in [2, %d]", CLOCK_MAX_MARKS), NULL;
    CallClock *self = (CallClock *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->cuda = strcmp(device, "cuda") == 0;
    self->marks = marks;
    self->stream = (void *)(uintptr_t)stream;
    self->flush_ptr = flush_ptr;
    self->flush_bytes = (size_t)flush_bytes;
    if (!self->cuda) return (PyObject *)self;
    if (cu_resolve() != 0) {
        Py_DECREF(self);
        return PyErr_Format(PyExc_RuntimeError, "the CUDA driver library (libcuda.so.1) is not usable"), NULL;
    }
    int rc = g_cu.ctx_get(&self->ctx);
    if (rc != 0 || self->ctx == NULL) {
        Py_DECREF(self);
        return PyErr_Format(PyExc_RuntimeError, "no current CUDA context (initialise CUDA first)"), NULL;
    }
    for (int i = 0; i < marks; ++i) {
        rc = g_cu.event_create(&self->events[i], 0);
        if (rc != 0) {
            self->marks = i;
            Py_DECREF(self);
            return cu_failed("cuEventCreate", rc);
        }
    }
    return (PyObject *)self;
}

static void clock_dealloc(CallClock *self) {
    if (self->cuda && g_cu.resolved) {
        g_cu.ctx_set(self->ctx);
        for (int i = 0; i < self->marks; ++i)
            if (self->events[i] != NULL) g_cu.event_destroy(self->events[i]);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Device state a call could leave for the next one: a persisting-L2 set-aside (and the lines an access
 * policy window pinned there) survives the flush, which evicts only normal lines. Before every call's
 * flush, a set-aside someone made goes back to none and every persisting line to normal; where none
 * was made (every honest run) only the limit is read, a call that costs no device work. Errors are
 * ignored: a device without persisting L2 has nothing to reset. */
static void reset_device_state(void) {
    size_t set_aside = 0;
    if (g_cu.get_limit && g_cu.get_limit(&set_aside, CU_LIMIT_PERSISTING_L2_CACHE_SIZE) == 0 && set_aside == 0) return;
    if (g_cu.set_limit) g_cu.set_limit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0);
    if (g_cu.reset_l2) g_cu.reset_l2();
}

static PyObject *clock_flush(CallClock *self, PyObject *unused) {
    (void)unused;
    if (self->cuda && self->flush_bytes) {
        g_cu.ctx_set(self->ctx);
        reset_device_state();
        int rc = g_cu.memset_async(self->flush_ptr, 0, self->flush_bytes, self->stream);
        if (rc != 0) return cu_failed("cuMemsetD8Async", rc);
    }
    Py_RETURN_NONE;
}

static PyObject *clock_mark(CallClock *self, PyObject *arg) {
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= self->marks) return PyErr_Format(PyExc_IndexError, "mark %ld of %d", i, self->marks), NULL;
    if (!self->cuda) {
        clock_gettime(CLOCK_MONOTONIC, &self->stamps[i]);
        Py_RETURN_NONE;
    }
    g_cu.ctx_set(self->ctx);
    int rc = g_cu.event_record(self->events[i], self->stream);
    if (rc != 0) return cu_failed("cuEventRecord", rc);
    Py_RETURN_NONE;
}

static PyObject *clock_idle(CallClock *self, PyObject *unused) {
    (void)unused;
    if (!self->cuda) Py_RETURN_NONE;
    int rc;
    void *ctx = self->ctx;
    Py_BEGIN_ALLOW_THREADS
    g_cu.ctx_set(ctx);
    rc = g_cu.ctx_sync();
    Py_END_ALLOW_THREADS
    if (rc != 0) return cu_failed("cuCtxSynchronize", rc);
    Py_RETURN_NONE;
}

static double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* preroll(seconds, head_start): bring the device and the host to the state a call in KernelBench's
 * loop starts in. cuda: flushes, each waited for, for `seconds` (an idle GPU has dropped its clocks),
 * then flushes left running for about `head_start` seconds of device time (counted in the fastest
 * waited flush), ahead of the first call's own flush: time in which the host's first launch of the
 * trip, colder than the loop's, is hidden as the loop's is by one flush. cpu: the core spins for
 * `seconds`. The same in a trip and its null trip, so it cancels in the verifier's clock; no mark
 * is recorded. */
#define PREROLL_MAX_HEAD_FLUSHES 16
static PyObject *clock_preroll(CallClock *self, PyObject *args) {
    double seconds, head;
    if (!PyArg_ParseTuple(args, "dd:preroll", &seconds, &head)) return NULL;
    if (!(seconds >= 0.0 && seconds <= 1.0) || !(head >= 0.0 && head <= 0.1))
        return PyErr_Format(PyExc_ValueError, "preroll of %f s with a head start of %f s is out of range", seconds, head), NULL;
    int rc = 0;
    const char *what = NULL;
    void *ctx = self->ctx;
    int cuda = self->cuda && self->flush_bytes;
    Py_BEGIN_ALLOW_THREADS
    double now = monotonic_s(), end = now + seconds, fastest = 1.0;
    if (cuda) {
        g_cu.ctx_set(ctx);
        reset_device_state();
    }
    while (now < end) {
        if (cuda) {
            rc = g_cu.memset_async(self->flush_ptr, 0, self->flush_bytes, self->stream);
            if (rc != 0) { what = "cuMemsetD8Async"; break; }
            rc = g_cu.ctx_sync();
            if (rc != 0) { what = "cuCtxSynchronize"; break; }
        }
        double later = monotonic_s();
        if (later - now < fastest) fastest = later - now;
        now = later;
    }
    if (cuda && rc == 0 && head > 0.0) {
        int n = (int)(head / (fastest > 1e-6 ? fastest : 1e-6)) + 1;
        if (n > PREROLL_MAX_HEAD_FLUSHES) n = PREROLL_MAX_HEAD_FLUSHES;
        for (int i = 0; i < n && rc == 0; ++i) rc = g_cu.memset_async(self->flush_ptr, 0, self->flush_bytes, self->stream);
        if (rc != 0) what = "cuMemsetD8Async";
    }
    Py_END_ALLOW_THREADS
    if (rc != 0) return cu_failed(what, rc);
    Py_RETURN_NONE;
}

static PyObject *clock_spans(CallClock *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || 2 * n > self->marks) return PyErr_Format(PyExc_IndexError, "%ld spans of %d marks", n, self->marks), NULL;
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (long i = 0; i < n; ++i) {
        double seconds;
        if (self->cuda) {
            float ms = 0.0f;
            g_cu.ctx_set(self->ctx);
            int rc = g_cu.event_elapsed(&ms, self->events[2 * i], self->events[2 * i + 1]);
            if (rc != 0) {
                Py_DECREF(out);
                return cu_failed("cuEventElapsedTime", rc);
            }
            seconds = ms * 1e-3;
        } else {
            struct timespec a = self->stamps[2 * i], b = self->stamps[2 * i + 1];
            seconds = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
        }
        PyObject *value = PyFloat_FromDouble(seconds);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, value);
    }
    return out;
}

static PyMethodDef clock_methods[] = {
    {"flush", (PyCFunction)clock_flush, METH_NOARGS, "flush(): cuda: the L2 flush on the clock's stream."},
    {"mark", (PyCFunction)clock_mark, METH_O, "mark(i): time stamp i (an event on the stream, or the monotonic clock)."},
    {"idle", (PyCFunction)clock_idle, METH_NOARGS, "idle(): cuda: wait until the device is idle."},
    {"preroll", (PyCFunction)clock_preroll, METH_VARARGS, "preroll(seconds, head_start): cuda: waited flushes for `seconds`, then about `head_start` s of flushes left running; cpu: a spin."},
    {"spans", (PyCFunction)clock_spans, METH_O, "spans(n) -> [seconds from mark 2i to mark 2i+1 for i < n]."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CallClockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kiln_native.CallClock",
    .tp_basicsize = sizeof(CallClock),
    .tp_dealloc = (destructor)clock_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CallClock(device_type, stream, flush_ptr, flush_bytes, marks): the timing protocol's per-call clock.",
    .tp_methods = clock_methods,
    .tp_new = clock_new,
};

#endif

/* kiln_native: the sandbox's native half that needs no torch.
 *
 * A Python extension module, built once per toolchain by the trusted build service and imported by
 * the zygote before anything else (actors/verifier/native/__init__.py). It holds what the jailed
 * processes need from the operating system (mount, unshare, prctl, raw syscalls, seccomp, dlopen),
 * so no process that runs candidate code ever loads ctypes, and `arm`, the one-way switch a process
 * throws before the first byte of candidate code runs in it.
 *
 * `arm_compute`, one-way too, is thrown before the first input enters the process: from then on the
 * compute fence (kiln_fence) refuses every ATen op outside plumbing. Between the two the candidate's
 * module is imported and its ModelNew instances are built, with no input anywhere in the process.
 *
 * After `arm`:
 *   - an audit hook (C, irremovable, no Python state) refuses, for every caller, the interpreter's
 *     routes to raw memory, to other objects' references, to code objects, to processes, sockets
 *     and shared mappings, and the import of modules that expose raw memory or Kiln itself; and the
 *     sandbox's own frames, functions and tracebacks (code from Kiln's tree) are out of reach: the
 *     candidate's stack ends where the sandbox's code begins (`f_back` is None there);
 *     each refusal is numbered and kept in a log in static memory (which the sandbox's signed
 *     replies carry to the verifier) and written at once to the evidence pipe (which the verifier
 *     reads even when the process dies before it can reply). Closing or replacing the pipe loses
 *     nothing: it is itself logged, found by the pipe's identity (device, inode) before each write;
 *   - `refuser` functions (installed by the sandbox in place of torch's data paths) refuse the same
 *     way, and `refuse_subscript` makes a static type's item access refuse;
 *   - a native extension loads only from the candidate's own build: the "import" event that carries a
 *     file (`_imp.create_dynamic`, whatever reached it: importlib's ExtensionFileLoader, `imp`, a
 *     hand-made spec) is allowed only for a library of the process's artifact table (exact files, or
 *     the one directory that holds only its own verified libraries) or a standard extension module
 *     (a tagged suffix in a directory of sys.path at arming); every other load is refused;
 *   - an extra seccomp filter (passed to `arm`) is stacked: the kernel refuses what the candidate
 *     must never do (signal handlers, timers, new processes, memfd);
 *   - every function of this module that changes the process (mount, prctl, syscall, ...) refuses.
 * Nothing here can be disarmed: the state lives in static C variables that Python cannot address
 * (no ctypes, no raw-memory module is loadable once armed).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kiln_clock.h" /* the timing protocol's per-call clock */
#include "kiln_trace.h" /* the device's record of what ran (CUPTI's activity API) */

#define MAX_PATH 4096
#define MAX_LINES 20000

static int g_armed = 0;
static int g_compute_armed = 0; /* the compute fence refuses (one-way, from the first input on) */
static int g_evidence = -1;
static dev_t g_evidence_dev;              /* the pipe's identity at arming: a replaced pipe differs */
static ino_t g_evidence_ino;
static int g_channel_lost = 0;
static char g_candidate[MAX_PATH];
static char g_trusted_root[MAX_PATH];     /* "<Kiln's tree>/": code from there is the sandbox's own */
static PyObject *g_lines = NULL;          /* tuple of the candidate's source lines (str) */
static PyObject *g_denied_imports = NULL; /* frozenset: top-level modules that expose raw memory */
static PyObject *g_kiln_packages = NULL;  /* frozenset: Kiln's own top-level packages */
static PyObject *g_own_libraries = NULL;  /* tuple of str: the artifact table (files; "dir/": a directory) */
static PyObject *g_module_dirs = NULL;    /* tuple of str "dir/": sys.path's directories at arming */
static PyObject *g_module_suffixes = NULL; /* tuple of str: the interpreter's tagged extension suffixes */

/* ------------------------------------------------------------------------------------ evidence */

/* Every refusal since arming, as "seq\tkind\twhat\tsite\n" lines; past LOG_BYTES only the count
 * grows (the verdict needs one refusal, the feedback a few). Threads refuse concurrently (torch's
 * pool, a candidate's own): one lock. */
#define LOG_BYTES (256 * 1024)
static char g_log[LOG_BYTES];
static size_t g_log_len = 0;
static unsigned long g_refusals = 0;
static pthread_mutex_t g_log_lock = PTHREAD_MUTEX_INITIALIZER;

static void log_line_locked(const char *kind, const char *what, const char *site, char *line, int *n) {
    *n = snprintf(line, 1024, "%lu\t%s\t%.400s\t%.400s\n", ++g_refusals, kind, what, site);
    if (*n <= 0) { *n = 0; return; }
    if (*n >= 1024) { *n = 1023; line[*n - 1] = '\n'; }
    if (g_log_len + (size_t)*n <= LOG_BYTES) {
        memcpy(g_log + g_log_len, line, (size_t)*n);
        g_log_len += (size_t)*n;
    }
}

/* Whether the evidence descriptor is still the pipe it was at arming. */
static int channel_intact_locked(void) {
    struct stat st;
    return fstat(g_evidence, &st) == 0 && st.st_dev == g_evidence_dev && st.st_ino == g_evidence_ino;
}

/* Called with the lock held: the first time the pipe is found closed or replaced, that is logged. */
static void check_channel_locked(void) {
    if (g_evidence < 0 || g_channel_lost || channel_intact_locked()) return;
    g_channel_lost = 1;
    char line[1024];
    int n;
    log_line_locked("tamper", "the evidence pipe was closed or replaced", "", line, &n);
}

static void write_evidence(const char *kind, const char *what, const char *site) {
    if (!g_armed) return; /* before arming there is no candidate: nothing to tell */
    char line[1024];
    int n;
    pthread_mutex_lock(&g_log_lock);
    check_channel_locked();
    log_line_locked(kind, what, site, line, &n);
    /* Non-blocking: a full pipe loses lines there, never in the log, and never stalls the process. */
    if (n > 0 && g_evidence >= 0 && !g_channel_lost) {
        ssize_t done = write(g_evidence, line, (size_t)n);
        (void)done;
    }
    pthread_mutex_unlock(&g_log_lock);
}

/* "line N: `text`" of the innermost frame of the candidate's file, starting at `frame`. Uses the C
 * API only, so it raises no audit event and reaches nothing a Python caller could. */
static void site_from_frame(PyFrameObject *frame, char *out, size_t size) {
    out[0] = '\0';
    if (!g_candidate[0]) return;
    PyFrameObject *f = frame;
    Py_XINCREF(f);
    while (f != NULL) {
        PyCodeObject *code = PyFrame_GetCode(f);
        int match = code != NULL && code->co_filename != NULL && PyUnicode_Check(code->co_filename) &&
                    PyUnicode_CompareWithASCIIString(code->co_filename, g_candidate) == 0;
        Py_XDECREF(code);
        if (match) {
            int lineno = PyFrame_GetLineNumber(f);
            const char *text = "";
            if (g_lines != NULL && lineno >= 1 && lineno <= PyTuple_GET_SIZE(g_lines)) {
                text = PyUnicode_AsUTF8(PyTuple_GET_ITEM(g_lines, lineno - 1));
                if (text == NULL) { PyErr_Clear(); text = ""; }
            }
            if (text[0]) snprintf(out, size, "line %d: `%.120s`", lineno, text);
            else snprintf(out, size, "line %d", lineno);
            Py_DECREF(f);
            return;
        }
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
}

static void current_site(char *out, size_t size) {
    out[0] = '\0';
    if (!PyGILState_Check()) return;
    site_from_frame(PyEval_GetFrame(), out, size);
}

static int refuse(const char *kind, const char *what, const char *why) {
    char site[600];
    current_site(site, sizeof site);
    write_evidence(kind, what, site);
    PyErr_Format(PyExc_RuntimeError, "%s is not allowed in the verifier's sandbox (%s)", what, why);
    return -1;
}

/* ---------------------------------------------------------------------------- trusted frames */

/* The sandbox's own Python code (Kiln's tree) sits below every candidate frame: the request loop
 * that calls forward, the loader that exec'd the module. Its frames hold what the sandbox needs
 * (the channel, the key, the functions it bound), so no candidate may hold one: the stack the
 * candidate can walk ends where the sandbox's code begins. Frames, functions and tracebacks of
 * anything else (the candidate's own, torch's, the standard library's) stay introspectable, so
 * namedtuple, typing, enum, logging and traceback work as anywhere. */
static int is_trusted_code(PyCodeObject *code) {
    if (code == NULL || !g_trusted_root[0] || code->co_filename == NULL || !PyUnicode_Check(code->co_filename))
        return 0;
    const char *file = PyUnicode_AsUTF8(code->co_filename);
    if (file == NULL) { PyErr_Clear(); return 1; } /* unreadable: assume the worst */
    return strncmp(file, g_trusted_root, strlen(g_trusted_root)) == 0;
}

static int is_trusted_frame(PyFrameObject *frame) {
    PyCodeObject *code = PyFrame_GetCode(frame);
    int trusted = is_trusted_code(code);
    Py_XDECREF(code);
    return trusted;
}

/* sys._getframe(depth): allowed unless the frame it returns is the sandbox's. */
static int check_getframe(PyObject *args) {
    if (PyTuple_Check(args) && PyTuple_GET_SIZE(args) >= 1 && PyFrame_Check(PyTuple_GET_ITEM(args, 0)) &&
        !is_trusted_frame((PyFrameObject *)PyTuple_GET_ITEM(args, 0)))
        return 0;
    return refuse("introspection", "sys._getframe", "reaching the sandbox's own frames");
}

/* The attributes the interpreter audits (a frame's code, a traceback's frame, a function's globals,
 * code and defaults, a generator's frame): allowed on what is not the sandbox's. */
static int check_getattr(PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 2) return 0;
    PyObject *obj = PyTuple_GET_ITEM(args, 0);
    PyObject *name = PyTuple_GET_ITEM(args, 1);
    int trusted = 1; /* what is not one of the kinds below: refused, as before */
    if (PyFrame_Check(obj)) {
        trusted = is_trusted_frame((PyFrameObject *)obj);
    } else if (PyTraceBack_Check(obj)) {
        PyFrameObject *f = ((PyTracebackObject *)obj)->tb_frame;
        trusted = f != NULL && is_trusted_frame(f);
    } else if (PyFunction_Check(obj)) {
        trusted = is_trusted_code((PyCodeObject *)PyFunction_GET_CODE(obj));
    }
    if (!trusted) return 0;
    char what[200];
    const char *attr = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (attr == NULL) { PyErr_Clear(); attr = "?"; }
    snprintf(what, sizeof what, "%.60s.%.60s", Py_TYPE(obj)->tp_name, attr);
    return refuse("introspection", what, "reaching the sandbox's own frames, code and globals");
}

/* frame.f_back, from arming on: None where the caller is the sandbox's own code (the top of the
 * candidate's stack), as the outermost frame of a thread has. The getter of the frame type is
 * swapped in place (the type is static; its getset table is writable data of the interpreter). */
static getter g_f_back = NULL;

static PyObject *guarded_f_back(PyObject *self, void *closure) {
    PyObject *back = g_f_back(self, closure);
    if (back != NULL && g_armed && PyFrame_Check(back) && is_trusted_frame((PyFrameObject *)back)) {
        Py_DECREF(back);
        Py_RETURN_NONE;
    }
    return back;
}

static int guard_f_back(void) {
    PyObject *descr = PyObject_GetAttrString((PyObject *)&PyFrame_Type, "f_back");
    if (descr == NULL) return -1;
    int ok = Py_IS_TYPE(descr, &PyGetSetDescr_Type);
    if (ok) {
        PyGetSetDef *def = ((PyGetSetDescrObject *)descr)->d_getset;
        if (def->get != guarded_f_back) {
            g_f_back = def->get;
            def->get = guarded_f_back;
        }
    }
    Py_DECREF(descr);
    if (!ok) PyErr_SetString(PyExc_RuntimeError, "frame.f_back is not a getset descriptor here");
    return ok ? 0 : -1;
}

/* A function's __globals__, __closure__ and __builtins__ are plain members the interpreter does not
 * audit; for the sandbox's own functions (the load_inline a candidate calls is one) they would lead
 * to its modules and closures. From arming on they refuse there: each member is replaced in the
 * function type's dict by a getter that checks whose function it is. */
#define GUARDED_MEMBERS 3
static const char *const g_member_names[GUARDED_MEMBERS] = {"__globals__", "__closure__", "__builtins__"};
static PyObject *g_member_descr[GUARDED_MEMBERS]; /* the original member descriptors */
static PyGetSetDef g_member_defs[GUARDED_MEMBERS + 1];

static PyObject *guarded_member(PyObject *self, void *closure) {
    Py_ssize_t i = (Py_ssize_t)closure;
    if (g_armed && PyFunction_Check(self) && is_trusted_code((PyCodeObject *)PyFunction_GET_CODE(self))) {
        char what[120];
        snprintf(what, sizeof what, "function.%s", g_member_names[i]);
        refuse("introspection", what, "reaching the sandbox's own frames, code and globals");
        return NULL;
    }
    return Py_TYPE(g_member_descr[i])->tp_descr_get(g_member_descr[i], self, (PyObject *)Py_TYPE(self));
}

static int guard_function_members(void) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *dict = PyType_GetDict(&PyFunction_Type);
#else
    PyObject *dict = PyFunction_Type.tp_dict;
    Py_XINCREF(dict);
#endif
    if (dict == NULL) return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; i < GUARDED_MEMBERS && rc == 0; ++i) {
        PyObject *old = PyDict_GetItemString(dict, g_member_names[i]);
        if (old == NULL || !Py_IS_TYPE(old, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_RuntimeError, "function.%s is not a member descriptor here", g_member_names[i]);
            rc = -1;
            break;
        }
        g_member_descr[i] = Py_NewRef(old);
        g_member_defs[i] = (PyGetSetDef){g_member_names[i], guarded_member, NULL, NULL, (void *)i};
        PyObject *descr = PyDescr_NewGetSet(&PyFunction_Type, &g_member_defs[i]);
        if (descr == NULL || PyDict_SetItemString(dict, g_member_names[i], descr) != 0) rc = -1;
        Py_XDECREF(descr);
    }
    Py_DECREF(dict);
    PyType_Modified(&PyFunction_Type);
    return rc;
}

/* ----------------------------------------------------------------------------------- audit hook */

typedef struct {
    const char *event;
    int prefix;
    const char *kind;
    const char *why;
} Rule;

static const Rule RULES[] = {
    {"ctypes.", 1, "native_escape", "raw memory and foreign calls"},
    {"sys._getframemodulename", 0, NULL, NULL}, /* a module's name: nothing to reach (3.12) */
    {"sys._current_frames", 0, "introspection", "reaching other code's frames"},
    {"sys._current_exceptions", 0, "introspection", "reaching other code's frames"},
    {"gc.get_", 1, "introspection", "reaching other code's objects"},
    {"sys.settrace", 0, "introspection", "tracing hooks"},
    {"sys.setprofile", 0, "introspection", "profiling hooks"},
    {"sys._settraceallthreads", 0, "introspection", "tracing hooks"},
    {"sys._setprofileallthreads", 0, "introspection", "profiling hooks"},
    {"sys.monitoring.", 1, "introspection", "monitoring hooks"},
    {"sys.addaudithook", 0, "introspection", "audit hooks"},
    {"cpython.PyInterpreterState_New", 0, "introspection", "sub-interpreters"},
    {"code.__new__", 0, "dynamic_code", "building code objects"},
    {"marshal.load", 1, "dynamic_code", "building code objects"},
    {"os.system", 0, "process", "starting processes"},
    {"os.exec", 1, "process", "starting processes"},
    {"os.posix_spawn", 0, "process", "starting processes"},
    {"os.spawn", 1, "process", "starting processes"},
    {"os.fork", 1, "process", "starting processes"},
    {"subprocess.Popen", 0, "process", "starting processes"},
    {"pty.spawn", 0, "process", "starting processes"},
    {"os.kill", 0, "process", "signalling processes"},
    {"os.killpg", 0, "process", "signalling processes"},
    {"signal.pthread_kill", 0, "process", "signalling threads"},
    {"socket.", 1, "network", "network access"},
    {"mmap.__new__", 0, "shared_memory", "memory mappings Python can read"},
    {NULL, 0, NULL, NULL},
};

static int matches(const Rule *r, const char *event) {
    return r->prefix ? strncmp(event, r->event, strlen(r->event)) == 0 : strcmp(event, r->event) == 0;
}

static int check_import(PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) return 0;
    PyObject *name = PyTuple_GET_ITEM(args, 0);
    if (!PyUnicode_Check(name)) return 0;
    Py_ssize_t dot = PyUnicode_FindChar(name, '.', 0, PyUnicode_GET_LENGTH(name), 1);
    if (dot == -2) { PyErr_Clear(); return 0; }
    PyObject *top = dot >= 0 ? PyUnicode_Substring(name, 0, dot) : (Py_INCREF(name), name);
    if (top == NULL) { PyErr_Clear(); return 0; }
    int denied = g_denied_imports != NULL && PySet_Contains(g_denied_imports, top) == 1;
    int kiln = g_kiln_packages != NULL && PySet_Contains(g_kiln_packages, top) == 1;
    Py_DECREF(top);
    if (!denied && !kiln) return 0;
    const char *text = PyUnicode_AsUTF8(name);
    char what[300];
    snprintf(what, sizeof what, "import %.250s", text ? text : "?");
    if (kiln) return refuse("verifier_access", what, "Kiln's own modules are not the candidate's");
    return refuse("forbidden_import", what, "a module that exposes raw memory or interpreter internals");
}

/* Whether `text` starts with (`prefix` 1) or equals (`prefix` 0) one of `items` (a tuple of str),
 * or, for items ending in '/', lies below that directory. */
static int listed(PyObject *items, const char *text, int suffix) {
    if (items == NULL) return 0;
    size_t n = strlen(text);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); ++i) {
        const char *item = PyUnicode_AsUTF8(PyTuple_GET_ITEM(items, i));
        if (item == NULL) { PyErr_Clear(); continue; }
        size_t m = strlen(item);
        if (suffix) {
            if (m <= n && strcmp(text + n - m, item) == 0) return 1;
        } else if (m > 0 && item[m - 1] == '/') {
            if (n > m && strncmp(text, item, m) == 0) return 1;
        } else if (strcmp(text, item) == 0) {
            return 1;
        }
    }
    return 0;
}

/* The "import" event with a file is a native extension being loaded (dlopen, its constructors, its
 * init function). Allowed: a library of the artifact table, or a standard extension module (a tagged
 * suffix in one of sys.path's directories at arming). The path is resolved first (no "..", no link
 * out of a directory); anything but an exact str is refused, since the loader would read it differently. */
static int check_extension(PyObject *path) {
    char what[300];
    if (!PyUnicode_CheckExact(path)) return refuse("foreign_library", "load a native extension", "not a plain path");
    const char *text = PyUnicode_AsUTF8(path);
    if (text == NULL) { PyErr_Clear(); return refuse("foreign_library", "load a native extension", "unreadable path"); }
    char resolved[PATH_MAX];
    int own = 0, standard = 0;
    if (realpath(text, resolved) != NULL) {
        own = listed(g_own_libraries, resolved, 0);
        standard = listed(g_module_dirs, resolved, 0) && listed(g_module_suffixes, resolved, 1);
    }
    if (own || standard) return 0;
    snprintf(what, sizeof what, "load %.250s", text);
    return refuse("foreign_library", what,
                  "native extensions load only from the candidate's own build (its load_inline calls)");
}

static int is_process_memory(const char *path) {
    if (strcmp(path, "/dev/mem") == 0 || strcmp(path, "/dev/kmem") == 0 || strcmp(path, "/proc/kcore") == 0)
        return 1;
    if (strncmp(path, "/proc/", 6) != 0) return 0;
    const char *last = strrchr(path, '/');
    if (last == NULL) return 0;
    return strcmp(last, "/mem") == 0 || strcmp(last, "/pagemap") == 0 || strstr(path, "/map_files") != NULL;
}

/* open(path, mode, flags): mode is a str (builtins.open) or None, flags an int (os.open). */
static int opens_for_writing(PyObject *args) {
    if (PyTuple_GET_SIZE(args) >= 2 && PyUnicode_Check(PyTuple_GET_ITEM(args, 1))) {
        const char *mode = PyUnicode_AsUTF8(PyTuple_GET_ITEM(args, 1));
        if (mode == NULL) { PyErr_Clear(); return 0; }
        return strpbrk(mode, "wax+") != NULL;
    }
    if (PyTuple_GET_SIZE(args) >= 3 && PyLong_Check(PyTuple_GET_ITEM(args, 2))) {
        long flags = PyLong_AsLong(PyTuple_GET_ITEM(args, 2));
        if (flags == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
        return (flags & (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND)) != 0;
    }
    return 0;
}

static int check_open(PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) return 0;
    PyObject *path = PyTuple_GET_ITEM(args, 0);
    const char *text = NULL;
    if (PyUnicode_Check(path)) text = PyUnicode_AsUTF8(path);
    else if (PyBytes_Check(path)) text = PyBytes_AS_STRING(path);
    if (text == NULL) { PyErr_Clear(); return 0; }
    char what[300];
    if (is_process_memory(text)) {
        snprintf(what, sizeof what, "open %.250s", text);
        return refuse("memory_access", what, "reading or patching process memory");
    }
    /* Nothing a candidate runs in may write a file (its scratch is read-only): an attempt is one to
     * get memory Python can read through a file, or to leave something behind. */
    if (opens_for_writing(args)) {
        snprintf(what, sizeof what, "open %.250s for writing", text);
        return refuse("fs_escape", what, "the sandbox writes no file");
    }
    return 0;
}

static int audit_hook(const char *event, PyObject *args, void *unused) {
    (void)unused;
    if (!g_armed) return 0;
    if (event[0] == 'i' && strcmp(event, "import") == 0) {
        if (PyTuple_Check(args) && PyTuple_GET_SIZE(args) >= 2 && PyTuple_GET_ITEM(args, 1) != Py_None &&
            check_extension(PyTuple_GET_ITEM(args, 1)) != 0)
            return -1;
        return check_import(args);
    }
    if (event[0] == 'o' && strcmp(event, "open") == 0) return check_open(args);
    if (strcmp(event, "sys._getframe") == 0) return check_getframe(args);
    if (strcmp(event, "object.__getattr__") == 0) return check_getattr(args);
    for (const Rule *r = RULES; r->event != NULL; ++r) {
        if (matches(r, event)) {
            if (r->kind == NULL) return 0;
            char what[200];
            snprintf(what, sizeof what, "%.180s", event);
            return refuse(r->kind, what, r->why);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ refusers */

/* A refuser's `self` is the tuple (what, kind, why); it refuses whatever it is called with. */
static PyObject *refused_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    const char *what = PyUnicode_AsUTF8(PyTuple_GET_ITEM(self, 0));
    const char *kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(self, 1));
    const char *why = PyUnicode_AsUTF8(PyTuple_GET_ITEM(self, 2));
    if (what == NULL || kind == NULL || why == NULL) return NULL;
    refuse(kind, what, why);
    return NULL;
}

static PyMethodDef refuser_def = {"refused", (PyCFunction)(void (*)(void))refused_call,
                                  METH_VARARGS | METH_KEYWORDS, "Refuses: not allowed in the verifier's sandbox."};

static PyObject *py_refuser(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *what, *kind, *why;
    if (!PyArg_ParseTuple(args, "UUU:refuser", &what, &kind, &why)) return NULL;
    PyObject *self = PyTuple_Pack(3, what, kind, why);
    if (self == NULL) return NULL;
    PyObject *fn = PyCFunction_NewEx(&refuser_def, self, NULL);
    Py_DECREF(self);
    return fn;
}

/* Item access of a static (C) type, refused at the slot: replacing `__getitem__` in the type's
 * dict does not change the slot that `x[i]` uses. */
#define MAX_SLOTS 8
static struct { PyTypeObject *type; char what[120]; } g_slots[MAX_SLOTS];
static int g_nslots = 0;

static const char *slot_what(PyObject *obj) {
    for (int i = 0; i < g_nslots; ++i)
        if (PyObject_TypeCheck(obj, g_slots[i].type)) return g_slots[i].what;
    return "item access";
}

static PyObject *refused_subscript(PyObject *obj, PyObject *key) {
    (void)key;
    refuse("python_compute", slot_what(obj), "tensor data handed to Python");
    return NULL;
}

static PyObject *refused_item(PyObject *obj, Py_ssize_t i) {
    (void)i;
    refuse("python_compute", slot_what(obj), "tensor data handed to Python");
    return NULL;
}

static PyObject *py_refuse_subscript(PyObject *module, PyObject *args) {
    (void)module;
    PyTypeObject *type;
    const char *what;
    if (!PyArg_ParseTuple(args, "O!s:refuse_subscript", &PyType_Type, &type, &what)) return NULL;
    if (g_armed) return PyErr_Format(PyExc_RuntimeError, "kiln_native is armed"), NULL;
    if (g_nslots >= MAX_SLOTS) return PyErr_Format(PyExc_RuntimeError, "too many refused slots"), NULL;
    g_slots[g_nslots].type = type;
    snprintf(g_slots[g_nslots].what, sizeof g_slots[g_nslots].what, "%s", what);
    ++g_nslots;
    Py_INCREF(type);
    if (type->tp_as_mapping != NULL && type->tp_as_mapping->mp_subscript != NULL)
        type->tp_as_mapping->mp_subscript = refused_subscript;
    if (type->tp_as_sequence != NULL && type->tp_as_sequence->sq_item != NULL)
        type->tp_as_sequence->sq_item = refused_item;
    PyType_Modified(type);
    Py_RETURN_NONE;
}

/* --------------------------------------------------------------------------------- attribution */

static PyObject *py_traceback_site(PyObject *module, PyObject *tb) {
    (void)module;
    char best[600] = "";
    char site[600];
    while (tb != NULL && tb != Py_None && PyTraceBack_Check(tb)) {
        PyTracebackObject *t = (PyTracebackObject *)tb;
        /* Only this frame, not its callers: the innermost candidate line of the chain wins. */
        if (t->tb_frame != NULL) {
            PyCodeObject *code = PyFrame_GetCode(t->tb_frame);
            int match = code != NULL && g_candidate[0] && PyUnicode_Check(code->co_filename) &&
                        PyUnicode_CompareWithASCIIString(code->co_filename, g_candidate) == 0;
            Py_XDECREF(code);
            if (match) {
                site_from_frame(t->tb_frame, site, sizeof site);
                memcpy(best, site, sizeof best);
            }
        }
        tb = (PyObject *)t->tb_next;
    }
    return PyUnicode_FromString(best);
}

static PyObject *py_current_site(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    char site[600];
    current_site(site, sizeof site);
    return PyUnicode_FromString(site);
}

/* ------------------------------------------------------------------------------------- arming */

/* A new tuple of exact str copies of the str items of `items` (a tuple); others are dropped. */
static PyObject *str_tuple(PyObject *items) {
    PyObject *out = PyTuple_New(PyTuple_GET_SIZE(items));
    if (out == NULL) return NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); ++i) {
        PyObject *item = PyTuple_GET_ITEM(items, i);
        if (!PyUnicode_Check(item)) continue;
        const char *text = PyUnicode_AsUTF8(item);
        if (text == NULL) { Py_DECREF(out); return NULL; }
        PyObject *copy = PyUnicode_FromString(text);
        if (copy == NULL) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, k++, copy);
    }
    if (_PyTuple_Resize(&out, k) != 0) return NULL;
    return out;
}

static PyObject *frozenset_of(PyObject *iterable) {
    return iterable == Py_None ? PyFrozenSet_New(NULL) : PyFrozenSet_New(iterable);
}

static int install_filter(PyObject *prog) {
    /* A classic-BPF seccomp program (struct sock_filter[]), stacked on the ones already in place. */
    Py_ssize_t n = PyBytes_GET_SIZE(prog);
    if (n <= 0 || n % (Py_ssize_t)sizeof(struct sock_filter) != 0) {
        PyErr_SetString(PyExc_ValueError, "a seccomp program is a whole number of sock_filter entries");
        return -1;
    }
    struct sock_fprog fprog = {(unsigned short)(n / (Py_ssize_t)sizeof(struct sock_filter)),
                               (struct sock_filter *)PyBytes_AS_STRING(prog)};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *py_arm(PyObject *module, PyObject *args, PyObject *kwargs) {
    (void)module;
    static char *names[] = {"evidence_fd", "candidate_file", "source", "denied_imports", "kiln_packages",
                            "trusted_root", "seccomp", "own_libraries", "module_dirs", "module_suffixes", NULL};
    int fd;
    const char *candidate, *trusted_root;
    PyObject *source, *denied, *kiln, *seccomp = Py_None;
    PyObject *own = NULL, *module_dirs = NULL, *suffixes = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "isUOOs|OO!O!O!:arm", names, &fd, &candidate, &source, &denied,
                                     &kiln, &trusted_root, &seccomp, &PyTuple_Type, &own, &PyTuple_Type,
                                     &module_dirs, &PyTuple_Type, &suffixes))
        return NULL;
    if (g_armed) {
        refuse("tamper", "kiln_native.arm", "arming is one-way and happens once");
        return NULL;
    }
    if (strlen(candidate) >= MAX_PATH) return PyErr_Format(PyExc_ValueError, "candidate path too long"), NULL;
    if (strlen(trusted_root) + 2 >= MAX_PATH || trusted_root[0] != '/')
        return PyErr_Format(PyExc_ValueError, "trusted_root must be an absolute path"), NULL;
    PyObject *lines = PyUnicode_Splitlines(source, 0);
    if (lines == NULL) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(lines);
    g_lines = PyList_AsTuple(lines);
    Py_DECREF(lines);
    if (g_lines == NULL) return NULL;
    if (count > MAX_LINES) {
        Py_SETREF(g_lines, PyTuple_GetSlice(g_lines, 0, MAX_LINES));
        if (g_lines == NULL) return NULL;
    }
    g_denied_imports = frozenset_of(denied);
    g_kiln_packages = frozenset_of(kiln);
    if (g_denied_imports == NULL || g_kiln_packages == NULL) return NULL;
    /* Copies (tuples of exact str): nothing the candidate holds can change them after arming. */
    g_own_libraries = own ? str_tuple(own) : PyTuple_New(0);
    g_module_dirs = module_dirs ? str_tuple(module_dirs) : PyTuple_New(0);
    g_module_suffixes = suffixes ? str_tuple(suffixes) : PyTuple_New(0);
    if (g_own_libraries == NULL || g_module_dirs == NULL || g_module_suffixes == NULL) return NULL;
    if (seccomp != Py_None && !PyBytes_Check(seccomp))
        return PyErr_Format(PyExc_TypeError, "seccomp must be bytes or None"), NULL;
    snprintf(g_candidate, sizeof g_candidate, "%s", candidate);
    size_t rl = strlen(trusted_root);
    snprintf(g_trusted_root, sizeof g_trusted_root, "%s%s", trusted_root, trusted_root[rl - 1] == '/' ? "" : "/");
    if (guard_f_back() != 0 || guard_function_members() != 0) return NULL;
    if (fd >= 0) {
        int flags = fcntl(fd, F_GETFL);
        if (flags >= 0) fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    }
    g_evidence = fd;
    if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) != 0) return PyErr_SetFromErrno(PyExc_OSError), NULL;
        g_evidence_dev = st.st_dev;
        g_evidence_ino = st.st_ino;
    }
    if (PySys_AddAuditHook(audit_hook, NULL) != 0) return NULL;
    if (seccomp != Py_None && install_filter(seccomp) != 0) return NULL;
    g_armed = 1;
    Py_RETURN_NONE;
}

/* evidence_since(offset) -> (bytes, end, refusals): the log from byte `offset` on, where it ends, and
 * how many refusals there were in all (more than the log's lines once it is full). Checks the pipe
 * first, so a reply that follows a closed pipe carries that finding. Reading it gives nothing away. */
static PyObject *py_evidence_since(PyObject *module, PyObject *arg) {
    (void)module;
    Py_ssize_t offset = PyLong_AsSsize_t(arg);
    if (offset == -1 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&g_log_lock);
    if (g_armed) check_channel_locked();
    size_t from = offset < 0 ? 0 : (size_t)offset > g_log_len ? g_log_len : (size_t)offset;
    PyObject *out = Py_BuildValue("(y#nk)", g_log + from, (Py_ssize_t)(g_log_len - from), (Py_ssize_t)g_log_len,
                                  g_refusals);
    pthread_mutex_unlock(&g_log_lock);
    return out;
}

static PyObject *py_armed(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyBool_FromLong(g_armed);
}

/* From here on the compute fence refuses, until the process exits. Anyone may call it: there is
 * nothing to gain from arming early, and there is no way back. */
static PyObject *py_arm_compute(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    if (!g_armed) return PyErr_Format(PyExc_RuntimeError, "arm() comes first"), NULL;
    g_compute_armed = 1;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------- the operating system, before arming only */

static int refuse_if_armed(const char *what) {
    if (!g_armed) return 0;
    return refuse("tamper", what, "the sandbox's set-up functions are closed once candidate code exists");
}

static PyObject *errno_error(const char *what) {
    int err = errno;
    PyObject *text = PyUnicode_FromFormat("%s: %s", what, strerror(err));
    if (text == NULL) return NULL;
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "iO", err, text);
    Py_DECREF(text);
    if (exc != NULL) {
        PyErr_SetObject(PyExc_OSError, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static const char *opt_str(PyObject *obj) {
    if (obj == Py_None) return NULL;
    if (PyBytes_Check(obj)) return PyBytes_AS_STRING(obj);
    if (PyUnicode_Check(obj)) return PyUnicode_AsUTF8(obj);
    PyErr_SetString(PyExc_TypeError, "expected str, bytes or None");
    return NULL;
}

static PyObject *py_mount(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *src, *dst, *fstype, *data;
    unsigned long flags;
    if (!PyArg_ParseTuple(args, "OOOkO:mount", &src, &dst, &fstype, &flags, &data)) return NULL;
    if (refuse_if_armed("mount")) return NULL;
    const char *s = opt_str(src), *d = opt_str(dst), *t = opt_str(fstype), *x = opt_str(data);
    if (PyErr_Occurred()) return NULL;
    if (mount(s, d, t, flags, x) != 0) {
        char what[600];
        snprintf(what, sizeof what, "mount %s on %s", s ? s : (t ? t : "-"), d ? d : "-");
        return errno_error(what);
    }
    Py_RETURN_NONE;
}

static PyObject *py_umount2(PyObject *module, PyObject *args) {
    (void)module;
    const char *target;
    int flags;
    if (!PyArg_ParseTuple(args, "si:umount2", &target, &flags)) return NULL;
    if (refuse_if_armed("umount2")) return NULL;
    if (umount2(target, flags) != 0) return errno_error("umount2");
    Py_RETURN_NONE;
}

static PyObject *py_unshare(PyObject *module, PyObject *args) {
    (void)module;
    int flags;
    if (!PyArg_ParseTuple(args, "i:unshare", &flags)) return NULL;
    if (refuse_if_armed("unshare")) return NULL;
    if (unshare(flags) != 0) return errno_error("unshare");
    Py_RETURN_NONE;
}

static PyObject *py_prctl(PyObject *module, PyObject *args) {
    (void)module;
    int option;
    unsigned long a2 = 0, a3 = 0, a4 = 0, a5 = 0;
    if (!PyArg_ParseTuple(args, "i|kkkk:prctl", &option, &a2, &a3, &a4, &a5)) return NULL;
    if (refuse_if_armed("prctl")) return NULL;
    int rc = prctl(option, a2, a3, a4, a5);
    if (rc < 0) return errno_error("prctl");
    return PyLong_FromLong(rc);
}

/* syscall(nr, *args): each argument an int or a bytes object (passed as a pointer to its buffer). */
static PyObject *py_syscall(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 1 || n > 7) return PyErr_Format(PyExc_TypeError, "syscall(nr, up to 6 arguments)"), NULL;
    if (refuse_if_armed("syscall")) return NULL;
    long nr = PyLong_AsLong(PyTuple_GET_ITEM(args, 0));
    if (nr == -1 && PyErr_Occurred()) return NULL;
    long a[6] = {0, 0, 0, 0, 0, 0};
    for (Py_ssize_t i = 1; i < n; ++i) {
        PyObject *v = PyTuple_GET_ITEM(args, i);
        if (PyBytes_Check(v)) a[i - 1] = (long)PyBytes_AS_STRING(v);
        else if (PyByteArray_Check(v)) a[i - 1] = (long)PyByteArray_AS_STRING(v);
        else {
            a[i - 1] = PyLong_AsLong(v);
            if (a[i - 1] == -1 && PyErr_Occurred()) return NULL;
        }
    }
    long rc = syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
    if (rc == -1) {
        char what[64];
        snprintf(what, sizeof what, "syscall %ld", nr);
        return errno_error(what);
    }
    return PyLong_FromLong(rc);
}

static PyObject *py_seccomp(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *prog;
    if (!PyArg_ParseTuple(args, "S:seccomp", &prog)) return NULL;
    if (refuse_if_armed("seccomp")) return NULL;
    if (install_filter(prog) != 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_dlopen(PyObject *module, PyObject *args) {
    (void)module;
    const char *path;
    int mode;
    if (!PyArg_ParseTuple(args, "zi:dlopen", &path, &mode)) return NULL;
    if (refuse_if_armed("dlopen")) return NULL;
    void *handle = dlopen(path, mode);
    if (handle == NULL) {
        const char *err = dlerror();
        return PyErr_Format(PyExc_OSError, "%s", err ? err : "dlopen failed"), NULL;
    }
    return PyLong_FromVoidPtr(handle);
}

static PyObject *py_type_modified(PyObject *module, PyObject *args) {
    (void)module;
    PyTypeObject *type;
    if (!PyArg_ParseTuple(args, "O!:type_modified", &PyType_Type, &type)) return NULL;
    if (refuse_if_armed("type_modified")) return NULL;
    PyType_Modified(type);
    Py_RETURN_NONE;
}

/* The C API other native parts of the sandbox use (the compute fence): one arm switch, one evidence
 * channel, one attribution, shared through a capsule that Python can do nothing with. */
typedef struct {
    int (*armed)(void);          /* the compute fence refuses: from the first input until exit */
    void (*refused)(const char *kind, const char *what); /* write evidence with the candidate's site */
    int (*sealed)(void);         /* arm() was called: candidate code may exist in this process */
} KilnNativeAPI;

static int api_armed(void) { return g_compute_armed; }
static int api_sealed(void) { return g_armed; }

static void api_refused(const char *kind, const char *what) {
    char site[600];
    /* torch releases the GIL around an op: take it back to read the calling thread's frames (a
     * thread that never ran Python gets a fresh thread state with none). A refusal is rare. */
    PyGILState_STATE gil = PyGILState_Ensure();
    current_site(site, sizeof site);
    PyGILState_Release(gil);
    write_evidence(kind, what, site[0] ? site : "native code (no Python frame)");
}

static KilnNativeAPI g_api = {api_armed, api_refused, api_sealed};

static PyMethodDef methods[] = {
    {"arm", (PyCFunction)(void (*)(void))py_arm, METH_VARARGS | METH_KEYWORDS,
     "arm(evidence_fd, candidate_file, source, denied_imports, kiln_packages, trusted_root, seccomp=None): one-way."},
    {"armed", py_armed, METH_NOARGS, "Whether this process is armed."},
    {"evidence_since", py_evidence_since, METH_O, "evidence_since(offset) -> (log bytes, end, refusals)."},
    {"trace_attach", py_trace_attach, METH_O, "trace_attach(cupti_path): load CUPTI, register the trace's buffers."},
    {"trace_start", py_trace_start, METH_NOARGS, "trace_start(): record the device's kernels, copies and memsets."},
    {"trace_stop", py_trace_stop, METH_NOARGS, "trace_stop() -> ([(kind, name, start_ns, end_ns, stream)], dropped)."},
    {"arm_compute", py_arm_compute, METH_NOARGS, "Arm the compute fence: one-way, until exit."},
    {"refuser", py_refuser, METH_VARARGS, "refuser(what, kind, why) -> a callable that always refuses."},
    {"refuse_subscript", py_refuse_subscript, METH_VARARGS, "refuse_subscript(type, what): x[i] refuses."},
    {"traceback_site", py_traceback_site, METH_O, "The candidate's innermost line in a traceback."},
    {"current_site", py_current_site, METH_NOARGS, "The candidate's innermost line on this thread's stack."},
    {"mount", py_mount, METH_VARARGS, "mount(src, target, fstype, flags, data)"},
    {"umount2", py_umount2, METH_VARARGS, "umount2(target, flags)"},
    {"unshare", py_unshare, METH_VARARGS, "unshare(flags)"},
    {"prctl", py_prctl, METH_VARARGS, "prctl(option, a2=0, a3=0, a4=0, a5=0) -> int"},
    {"syscall", py_syscall, METH_VARARGS, "syscall(nr, *args) -> int (bytes arguments pass as pointers)"},
    {"seccomp", py_seccomp, METH_VARARGS, "seccomp(program): stack a classic-BPF seccomp filter"},
    {"dlopen", py_dlopen, METH_VARARGS, "dlopen(path, mode) -> handle"},
    {"type_modified", py_type_modified, METH_VARARGS, "PyType_Modified(type)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "kiln_native", NULL, -1, methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_kiln_native(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    if (PyType_Ready(&CallClockType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CallClockType);
    if (PyModule_AddObject(m, "CallClock", (PyObject *)&CallClockType) != 0) {
        Py_DECREF(&CallClockType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(&g_api, "kiln_native._C_API", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) != 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

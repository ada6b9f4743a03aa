/* cudamem's span core: a span's open and close in C, for the common case.
 *
 * ``open`` and ``close`` take exactly the arguments of the Python path's ``_py_open`` and
 * ``_py_close`` and do what they do, for the case almost every span is in: one device
 * (named, or the backend's settled devices), no synchronize, counters that are tuples of
 * three ints. Anything else is handed to the Python function before any state changes
 * (``open``: before the span exists; ``close``: before anything but the exit reads is
 * stored, which the Python close stores again). The rare branches of the common path (a
 * span of another thread open, a closed parent, a failing hook or read, a full queue) call
 * the same Python helpers the Python path calls, so each rule keeps one home in Python.
 *
 * ``init(table)`` makes a state (``Core``) for one span machinery from one explicit table:
 * a tuple in the order of the ``T_`` enum below (built by the Python side's
 * ``_core_table``): its two types, its ``SpanState`` (the object both paths read what may
 * be rebound from: hooks, the finished sink, limits, the Python fallbacks), where the
 * active backend is held, the slot descriptors of the three types, the Python helpers, the
 * containers that are mutated in place and never rebound, and whether the clock is
 * ``time.perf_counter_ns``. Nothing is looked up by name in a module's namespace. Nothing
 * is process-wide, so a second copy of the span machinery in the process (a reload) gets a
 * state of its own and each serves its own spans. Fields are read and stored by their slot
 * offsets, checked at ``init`` to be object slots of those exact types; objects read that
 * way are checked to be RawSpans (MemorySpans) of the state first.
 *
 * Files: util.c (helpers), open.c, close.c, with.c (MemorySpan's with block), columns.c
 * (``make`` and the history's fold), state.c (the state's type, ``init``, the module).
 */
#ifndef CUDAMEM_SPANCORE_CORE_H
#define CUDAMEM_SPANCORE_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#ifdef Py_GIL_DISABLED
/* Free-threaded builds: this module relies on the GIL; the build fails and Python serves. */
#error "cudamem's compiled extensions need the GIL"
#endif
#include <structmember.h>
#include <limits.h>
#include <string.h>

#ifndef CUDAMEM_MODULE_NAME
#define CUDAMEM_MODULE_NAME _cudamem_spancore
#endif
#define CM_CAT2(a, b) a##b
#define CM_CAT(a, b) CM_CAT2(a, b)
#define CM_STR2(a) #a
#define CM_STR(a) CM_STR2(a)

/* Nothing but PyInit_ leaves the library (the build passes -fvisibility=hidden too). */
#if defined(__GNUC__) || defined(__clang__)
#define CM_HIDDEN __attribute__((visibility("hidden")))
#else
#define CM_HIDDEN
#endif

/* RawSpan's fields, in the order of the table's T_RAW_SLOTS descriptors. */
enum {
    F_NAME, F_DEVICE, F_SYNC, F_PEAK, F_LEAKS, F_PARENT, F_CHILDREN, F_EXTRAS, F_FOLD,
    F_XFOLD, F_RECORD, F_CLOSED, F_DEVS, F_OWNER, F_SOLO, F_ARMED, F_BEFORE, F_START_NS,
    F_END_NS, F_EXIT_DEVS, F_AFTER, F_LEVEL, F_ALLOC_DELTA, F_RES_DELTA, F_PEAK_TOTAL,
    F_PEAK_DELTA, F_EXCEPTION, F_THREAD, F_TOP_LEVEL, F_DROPPED, N_FIELDS
};

/* MemorySpan's fields (T_SPAN_SLOTS), read by its ``__enter__``/``__exit__`` and stored by
 * ``make``. */
enum { M_DETACHED, M_DEVICE, M_EXTRAS, M_LEAKS, M_NAME, M_PEAK, M_RAW, M_SYNC, M_FIELDS };

/* SpanState's fields (T_STATE_SLOTS): what either path may rebind, read at every call. */
enum {
    ST_PY_OPEN, ST_PY_CLOSE, ST_ENTRY_HOOKS, ST_ENTRY_HOOKS_LEAKS, ST_EXIT_CALLS,
    ST_EXIT_CALLS_OK, ST_FINISHED_SINK, ST_MAX_CHILDREN, ST_PEAK_INBOX_MAX, ST_FINISHED_AT,
    N_STATE
};

/* The Python helpers the core calls (T_FN onwards), one home for each rule. */
enum {
    FN_PY_SPAN_ENTER, FN_PY_SPAN_EXIT, FN_MERGE_SOON, FN_ENTER_PEAK, FN_ENTRY_FAILED,
    FN_ENTRY_HOOK_FAILED, FN_EXIT_HOOK_FAILED, FN_CLOSE_FAILED, FN_LIVE, FN_WAIT_FOLDS,
    FN_EXCEPTION_INFO, FN_THREAD_NAME, FN_UNLINK, FN_DRAIN_FINISHED, FN_NOW_NS, N_FN
};

/* The table ``init`` takes: a tuple in this order. */
enum {
    T_RAW_TYPE,    /* RawSpan */
    T_SPAN_TYPE,   /* MemorySpan */
    T_STATE,       /* the SpanState instance */
    T_RAW_SLOTS,   /* RawSpan's member descriptors, in F_ order */
    T_SPAN_SLOTS,  /* MemorySpan's, in M_ order */
    T_STATE_SLOTS, /* SpanState's, in ST_ order */
    T_BACKEND_NS,  /* the dict that holds the active backend ... */
    T_BACKEND_KEY, /* ... under this key */
    T_FN,          /* N_FN callables, in FN_ order */
    T_OPEN_PEAK = T_FN + N_FN, /* dict: open peak spans -> owner thread */
    T_PROCESS_PEAK,            /* dict: device -> process-wide peak */
    T_PEAK_INBOX,              /* deque of (device, peak) */
    T_FINISHED,                /* deque of finished top-level spans */
    T_TOP,                     /* ContextVar: the innermost span */
    T_TLS,                     /* threading.local: the thread's name */
    T_MONOTONIC,               /* bool: the clock is time.perf_counter_ns */
    N_TABLE
};

/* Attribute names of other objects (the backend, the keeper, the thread-local). */
enum {
    S_SETTLED, S_FAST_RESET, S_FAST_COUNTERS, S_COUNTERS_RESET_PEAK, S_COUNTERS, S_APPEND,
    S_HOOKS, S_EXTRAS_ATTR, S_NAME_ATTR, S_SPAN_DEFAULT, N_NAMES
};
extern CM_HIDDEN PyObject *cm_names[N_NAMES];
extern CM_HIDDEN const char *const cm_field_names[N_FIELDS];
extern CM_HIDDEN const char *const cm_mfield_names[M_FIELDS];
extern CM_HIDDEN const char *const cm_state_names[N_STATE];

/* One span machinery's state: what ``init`` was given for it, so that two copies in one
 * process (a reload) each open and close their own spans. Its ``open``/``close``/``make``/
 * ``columns`` are its methods, and its ``enter``/``exit`` (MemorySpan's methods through the
 * core) hold it. */
typedef struct {
    PyObject_HEAD
    PyTypeObject *raw_type;  /* RawSpan; NULL once cleared (everything then refuses) */
    PyTypeObject *span_type; /* MemorySpan */
    PyObject *state;         /* the SpanState */
    PyObject *backend_ns, *backend_key;
    PyObject *fn[N_FN];
    PyObject *open_peak, *process_peak, *inbox, *inbox_append, *top, *tls, *finished,
        *finished_append;
    PyObject *enter, *exit; /* MemorySpan.__enter__/__exit__ through this state */
    int monotonic;
    Py_ssize_t off[N_FIELDS];  /* RawSpan's slot offsets */
    Py_ssize_t moff[M_FIELDS]; /* MemorySpan's */
    Py_ssize_t soff[N_STATE];  /* SpanState's */
} Core;

extern CM_HIDDEN PyTypeObject cm_core_type, cm_method_type, cm_bound_type;

/* Field ``f`` of a RawSpan (MemorySpan) of the state ``st``. */
#define SLOT(st, o, f) (*(PyObject **)((char *)(o) + (st)->off[f]))
#define MSLOT(st, o, f) (*(PyObject **)((char *)(o) + (st)->moff[f]))

/* util.c */
CM_HIDDEN void cm_put(Core *st, PyObject *o, int f, PyObject *v);
CM_HIDDEN void cm_set(Core *st, PyObject *o, int f, PyObject *v);
CM_HIDDEN PyObject *cm_state(Core *st, int i);
CM_HIDDEN PyObject *cm_call0(Core *st, int fn);
CM_HIDDEN PyObject *cm_call1(Core *st, int fn, PyObject *a);
CM_HIDDEN PyObject *cm_callv(Core *st, int fn, PyObject *const *args, size_t n);
CM_HIDDEN PyObject *cm_fallback(Core *st, int which, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames);
CM_HIDDEN PyObject *cm_backend(Core *st);
CM_HIDDEN PyObject *cm_take_exception(void);
CM_HIDDEN int cm_catchable(void);
CM_HIDDEN PyObject *cm_now_ns(Core *st);
CM_HIDDEN PyObject *cm_thread_ident(void);
CM_HIDDEN int cm_only_me(PyObject *open_peak, PyObject *me);
CM_HIDDEN int cm_triple(PyObject *t, long long out[3]);
CM_HIDDEN PyObject *cm_read_counters(PyObject *backend, PyObject *d, int fast_name, int method);
CM_HIDDEN int cm_keyword_hooks(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                               int *hooks);
CM_HIDDEN int cm_flag(PyObject *v);
CM_HIDDEN int cm_call_hooks(Core *st, int hooks_field, PyObject *span, PyObject *exc,
                            PyObject **pending);

/* open.c, close.c */
CM_HIDDEN PyObject *cm_open(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames);
CM_HIDDEN PyObject *cm_close(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames);

/* with.c */
CM_HIDDEN PyObject *cm_new_method(Core *st, PyObject *type_qualname, const char *name,
                                  int enter);

/* columns.c */
CM_HIDDEN PyObject *cm_make(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
CM_HIDDEN PyObject *cm_columns(PyObject *self, PyObject *spans);

#endif

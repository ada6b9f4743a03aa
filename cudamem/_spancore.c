/* cudamem's span core: the common path of a span's open and close, in C.
 *
 * ``open`` and ``close`` take exactly the arguments of ``span._py_open`` and
 * ``span._py_close`` and do what they do, for the case almost every span is in: one device
 * (named, or the backend's settled devices), no synchronize, counters that are tuples of
 * three ints. Anything else is handed to the Python function before any state changes
 * (``open``: before the span exists; ``close``: before anything but the exit reads is
 * stored, which the Python close stores again). The rare branches of the common path (a
 * span of another thread open, a closed parent, a failing hook or read, a full queue) call
 * the same Python helpers the Python path calls, so each rule keeps one home in span.py.
 *
 * ``init`` makes a state (``Core``) for one span module: its globals, _backend.py's, its
 * types and the containers it never rebinds. Nothing of a span module is process-wide, so
 * a second ``cudamem.span`` in the process (a reload) gets a state of its own and each
 * serves its own spans. The state's ``open``/``close``/``make``/``columns`` are its
 * methods, and its ``enter``/``exit`` (MemorySpan's ``__enter__``/``__exit__``) hold it.
 * Module state is read at each call from the globals (hooks, queues and constants may be
 * rebound), so the C path sees what the Python path would. RawSpan's fields are stored by
 * their slot offsets, checked at ``init`` to be object slots of that exact type; the
 * objects read that way are checked to be RawSpans (MemorySpans) of the state first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#ifdef Py_GIL_DISABLED
/* Free-threaded builds: this module relies on the GIL; the build fails and Python serves. */
#error "cudamem's compiled extensions need the GIL"
#endif
#include <structmember.h>
#include <limits.h>
#include <time.h>

#ifndef CUDAMEM_MODULE_NAME
#define CUDAMEM_MODULE_NAME _cudamem_spancore
#endif
#define CM_CAT2(a, b) a##b
#define CM_CAT(a, b) CM_CAT2(a, b)
#define CM_STR2(a) #a
#define CM_STR(a) CM_STR2(a)

enum {
    F_NAME, F_DEVICE, F_SYNC, F_PEAK, F_LEAKS, F_PARENT, F_CHILDREN, F_EXTRAS, F_FOLD,
    F_XFOLD, F_RECORD, F_CLOSED, F_DEVS, F_OWNER, F_SOLO, F_ARMED, F_BEFORE, F_START_NS,
    F_END_NS, F_EXIT_DEVS, F_AFTER, F_LEVEL, F_ALLOC_DELTA, F_RES_DELTA, F_PEAK_TOTAL,
    F_PEAK_DELTA, F_EXCEPTION, F_THREAD, F_TOP_LEVEL, F_DROPPED, N_FIELDS
};

static const char *FIELD_NAMES[N_FIELDS] = {
    "name", "device", "sync", "peak", "leaks", "parent", "children", "extras", "fold",
    "xfold", "_record", "closed", "devs", "owner", "solo", "armed", "before", "start_ns",
    "end_ns", "exit_devs", "after", "level", "alloc_delta", "res_delta", "peak_total",
    "peak_delta", "exception", "thread", "top_level", "dropped"};

/* MemorySpan's fields, read by its ``__enter__``/``__exit__`` and stored by ``make``. */
enum { M_DETACHED, M_DEVICE, M_EXTRAS, M_LEAKS, M_NAME, M_PEAK, M_RAW, M_SYNC, M_FIELDS };
static const char *MFIELD_NAMES[M_FIELDS] = {"_detached", "_device", "_extras", "_leaks",
                                             "_name",     "_peak",   "_raw",    "_sync"};

/* One span module's state: what ``init`` was given for it and what it kept, so that two
 * span modules in one process (a reload) each open and close their own spans. Its
 * ``open``/``close``/``make``/``columns`` are its methods, and its ``enter``/``exit``
 * (MemorySpan's methods through the core) hold it: nothing of it is process-wide. */
typedef struct {
    PyObject_HEAD
    PyTypeObject *raw_type;  /* span.RawSpan; NULL once cleared (everything then refuses) */
    PyTypeObject *span_type; /* span.MemorySpan */
    PyObject *g_span;        /* span.py's globals */
    PyObject *g_backend;     /* _backend.py's globals */
    /* span.py's containers that are mutated in place and never rebound, kept at init. */
    PyObject *open_peak, *process_peak, *inbox_append, *top, *tls, *finished, *finished_append;
    PyObject *enter, *exit; /* MemorySpan.__enter__/__exit__ through this state */
    /* Whether span._now_ns is time.perf_counter_ns, read here as that function does. */
    int monotonic;
    Py_ssize_t off[N_FIELDS];  /* RawSpan's slot offsets */
    Py_ssize_t moff[M_FIELDS]; /* MemorySpan's */
} Core;

/* Interned names. */
enum {
    S_PY_OPEN, S_PY_CLOSE, S_ACTIVE, S_SETTLED, S_FAST_RESET, S_FAST_COUNTERS,
    S_COUNTERS_RESET_PEAK, S_COUNTERS, S_OPEN_PEAK, S_PROCESS_PEAK, S_PEAK_INBOX,
    S_PEAK_INBOX_MAX, S_MERGE_SOON, S_ENTER_PEAK, S_ENTRY_FAILED, S_ENTRY_HOOKS,
    S_ENTRY_HOOKS_LEAKS, S_ENTRY_HOOK_FAILED, S_TOP, S_LIVE, S_NOW_NS, S_WAIT_FOLDS,
    S_EXCEPTION_INFO, S_TLS, S_THREAD_NAME, S_MAX_CHILDREN, S_UNLINK, S_FINISHED_SINK,
    S_FINISHED, S_FINISHED_AT, S_DRAIN_FINISHED, S_EXIT_CALLS, S_EXIT_CALLS_OK,
    S_EXIT_HOOK_FAILED, S_CLOSE_FAILED, S_APPEND, S_HOOKS, S_EXTRAS_ATTR, S_NAME_ATTR,
    N_NAMES
};
static const char *NAMES[N_NAMES] = {
    "_py_open", "_py_close", "_active", "settled_devices", "fast_reset", "fast_counters",
    "counters_reset_peak", "counters", "_open_peak", "_process_peak", "_peak_inbox",
    "_PEAK_INBOX", "_merge_peaks_soon", "_enter_peak", "_entry_failed", "_entry_hooks",
    "_entry_hooks_leaks", "_entry_hook_failed", "_top", "_live", "_now_ns", "_wait_folds",
    "_exception_info", "_tls", "_thread_name", "MAX_CHILDREN", "_unlink", "_finished_sink",
    "finished", "FINISHED_AT", "_drain_finished", "_exit_calls", "_exit_calls_ok",
    "_exit_hook_failed", "_close_failed", "append", "hooks", "_extras", "name"};
static PyObject *S[N_NAMES];

/* Field ``f`` of a RawSpan of the state ``st``. */
#define SLOT(st, o, f) (*(PyObject **)((char *)(o) + (st)->off[f]))

/* Store ``v`` (a new reference, stolen) in field ``f`` of a RawSpan. */
static void put(Core *st, PyObject *o, int f, PyObject *v) {
    PyObject *old = SLOT(st, o, f);
    SLOT(st, o, f) = v;
    Py_XDECREF(old);
}

/* Store ``v`` (borrowed) in field ``f``. */
static void set(Core *st, PyObject *o, int f, PyObject *v) { put(st, o, f, Py_NewRef(v)); }

/* A global of span.py (borrowed), or NULL with an exception set. */
static PyObject *G(Core *st, int name) {
    if (st->g_span == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this span core state was cleared");
        return NULL;
    }
    PyObject *v = PyDict_GetItemWithError(st->g_span, S[name]);
    if (v == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_RuntimeError, "cudamem.span has no %s", NAMES[name]);
    return v;
}

static PyObject *call0(Core *st, int name) {
    PyObject *f = G(st, name);
    return f == NULL ? NULL : PyObject_CallNoArgs(f);
}

static PyObject *call1(Core *st, int name, PyObject *a) {
    PyObject *f = G(st, name);
    return f == NULL ? NULL : PyObject_CallOneArg(f, a);
}

static PyObject *callv(Core *st, int name, PyObject *const *args, size_t n) {
    PyObject *f = G(st, name);
    return f == NULL ? NULL : PyObject_Vectorcall(f, args, n, NULL);
}

/* The pending exception as an object (a new reference; the error indicator cleared). */
static PyObject *take_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v != NULL && tb != NULL)
        PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
#endif
}

/* Whether the pending error is an ``Exception`` (what the Python path catches); a
 * ``BaseException`` that is not (KeyboardInterrupt, SystemExit) propagates. */
static int catchable(void) { return PyErr_ExceptionMatches(PyExc_Exception); }

/* ``_now_ns()``: CLOCK_MONOTONIC, what time.perf_counter_ns reads on Linux. */
static PyObject *now_ns(Core *st) {
#if defined(__linux__)
    struct timespec ts;
    if (st->monotonic && clock_gettime(CLOCK_MONOTONIC, &ts) == 0)
        return PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
#endif
    return call0(st, S_NOW_NS);
}

/* threading.get_ident(), the same object while the thread is the same. */
static unsigned long last_ident = 0;
static PyObject *last_ident_obj = NULL;

static PyObject *thread_ident(void) {
    unsigned long ident = PyThread_get_thread_ident();
    if (last_ident_obj == NULL || ident != last_ident) {
        PyObject *obj = PyLong_FromUnsignedLong(ident);
        if (obj == NULL)
            return NULL;
        Py_XSETREF(last_ident_obj, obj);
        last_ident = ident;
    }
    return Py_NewRef(last_ident_obj);
}

/* Whether every value of ``open_peak`` equals ``me`` (span._only); -1 on error. */
static int only_me(PyObject *open_peak, PyObject *me) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(open_peak, &pos, &k, &v)) {
        int eq = PyObject_RichCompareBool(v, me, Py_EQ);
        if (eq <= 0)
            return eq;
    }
    return 1;
}

/* A tuple of three exact ints, read into ``out`` (0 when it is not one). */
static int triple(PyObject *t, long long out[3]) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 3)
        return 0;
    for (int i = 0; i < 3; i++) {
        PyObject *x = PyTuple_GET_ITEM(t, i);
        int overflow = 0;
        if (!PyLong_CheckExact(x))
            return 0;
        out[i] = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (overflow || (out[i] == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

/* ``backend.<fast>(d)`` when the reader is set, falling back to ``backend.<method>(d)``
 * when it is None or raises an Exception (what span.py's edges do); a new reference. */
static PyObject *read_counters(PyObject *backend, PyObject *d, int fast_name, int method) {
    PyObject *fast = PyObject_GetAttr(backend, S[fast_name]);
    if (fast == NULL)
        return NULL;
    if (fast != Py_None) {
        PyObject *v = PyObject_CallOneArg(fast, d);
        Py_DECREF(fast);
        if (v != NULL || !catchable())
            return v;
        PyErr_Clear();
    } else {
        Py_DECREF(fast);
    }
    return PyObject_CallMethodOneArg(backend, S[method], d);
}

/* Parse ``hooks=`` (the only keyword) into *hooks; 0 when the call is not one this module
 * takes (the Python function then answers, with its own errors). */
static int keyword_hooks(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int *hooks) {
    *hooks = 1;
    if (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)
        return 1;
    if (PyTuple_GET_SIZE(kwnames) != 1)
        return 0;
    PyObject *key = PyTuple_GET_ITEM(kwnames, 0);
    if (key != S[S_HOOKS] && PyUnicode_Compare(key, S[S_HOOKS]) != 0) {
        PyErr_Clear();
        return 0;
    }
    PyObject *v = args[nargs];
    if (v != Py_True && v != Py_False)
        return 0;
    *hooks = v == Py_True;
    return 1;
}

static int flag(PyObject *v) { return v == Py_True ? 1 : v == Py_False ? 0 : -1; }

/* ---------------------------------------------------------------------------- open */

/* The entry measurement raised: span._entry_failed(span, err), as the Python except. */
static int entry_failed(Core *st, PyObject *span) {
    if (!catchable())
        return -1;
    PyObject *err = take_exception();
    PyObject *args[2] = {span, err};
    PyObject *r = callv(st, S_ENTRY_FAILED, args, 2);
    Py_XDECREF(err);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* A lone or same-thread peak span on one device: read and reset, fold, queue the
 * discarded peak (span._py_open's one-device branch). */
static int enter_peak_one(Core *st, PyObject *span, PyObject *backend, PyObject *d,
                          PyObject *open_peak, PyObject *me, int alone) {
    PyObject *values = read_counters(backend, d, S_FAST_RESET, S_COUNTERS_RESET_PEAK);
    if (values == NULL)
        return -1;
    PyObject *before = PyTuple_Pack(1, values);
    if (before == NULL) {
        Py_DECREF(values);
        return -1;
    }
    put(st, span, F_BEFORE, before);
    set(st, span, F_ARMED, Py_True);
    PyObject *discarded = PySequence_GetItem(values, 2);
    Py_DECREF(values);
    if (discarded == NULL)
        return -1;
    int rc = -1;
    if (!alone) { /* fold into this thread's open spans */
        Py_ssize_t pos = 0;
        PyObject *other, *owner;
        while (PyDict_Next(open_peak, &pos, &other, &owner)) {
            if (other == span || Py_TYPE(other) != st->raw_type || SLOT(st, other, F_OWNER) == NULL)
                continue;
            int mine = PyObject_RichCompareBool(SLOT(st, other, F_OWNER), me, Py_EQ);
            if (mine < 0)
                goto done;
            if (!mine)
                continue;
            PyObject *fold = SLOT(st, other, F_FOLD);
            if (fold == NULL || fold == Py_None) {
                PyObject *fresh = PyDict_New();
                if (fresh == NULL || PyDict_SetItem(fresh, d, discarded) < 0) {
                    Py_XDECREF(fresh);
                    goto done;
                }
                put(st, other, F_FOLD, fresh);
            } else if (PyDict_CheckExact(fold)) {
                PyObject *cur = PyDict_GetItemWithError(fold, d);
                int higher = cur == NULL ? (PyErr_Occurred() ? -1 : 1)
                                         : PyObject_RichCompareBool(discarded, cur, Py_GT);
                if (higher < 0 || (higher && PyDict_SetItem(fold, d, discarded) < 0))
                    goto done;
            } else {
                PyErr_SetString(PyExc_TypeError, "a span's fold is not a dict");
                goto done;
            }
        }
    }
    { /* ``if discarded > _process_peak.get(d, -1)``: queue it */
        PyObject *process_peak = st->process_peak;
        PyObject *cur = PyDict_GetItemWithError(process_peak, d);
        int higher = cur == NULL ? (PyErr_Occurred() ? -1 : 1)
                                 : PyObject_RichCompareBool(discarded, cur, Py_GT);
        if (higher < 0)
            goto done;
        if (higher) {
            PyObject *inbox = G(st, S_PEAK_INBOX), *limit = G(st, S_PEAK_INBOX_MAX);
            if (inbox == NULL || limit == NULL)
                goto done;
            PyObject *item = PyTuple_Pack(2, d, discarded);
            if (item == NULL)
                goto done;
            PyObject *r = PyObject_CallOneArg(st->inbox_append, item);
            Py_DECREF(item);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
            Py_ssize_t n = PyObject_Size(inbox);
            long long most = PyLong_AsLongLong(limit);
            if (n < 0 || (most == -1 && PyErr_Occurred()))
                goto done;
            if (n > most) {
                r = call0(st, S_MERGE_SOON);
                if (r == NULL)
                    goto done;
                Py_DECREF(r);
            }
        }
    }
    rc = 0;
done:
    Py_DECREF(discarded);
    return rc;
}

/* The measurement part of an open (the Python ``try`` block); -1 with an error set. */
static int enter_measure(Core *st, PyObject *span, PyObject *backend, PyObject *devs, int peak) {
    PyObject *d = PyTuple_GET_ITEM(devs, 0);
    if (!peak) {
        PyObject *values = read_counters(backend, d, S_FAST_COUNTERS, S_COUNTERS);
        if (values == NULL)
            return -1;
        PyObject *before = PyTuple_Pack(1, values);
        Py_DECREF(values);
        if (before == NULL)
            return -1;
        put(st, span, F_BEFORE, before);
        return 0;
    }
    PyObject *me = thread_ident();
    if (me == NULL)
        return -1;
    set(st, span, F_OWNER, me);
    set(st, span, F_SOLO, Py_True);
    set(st, span, F_ARMED, Py_False);
    int rc = -1;
    PyObject *open_peak = st->open_peak;
    if (PyDict_SetItem(open_peak, span, me) < 0) /* announce (see span._enter_peak) */
        goto done;
    int alone = PyDict_GET_SIZE(open_peak) == 1;
    int only = alone ? 1 : only_me(open_peak, me);
    if (only < 0)
        goto done;
    if (only) {
        rc = enter_peak_one(st, span, backend, d, open_peak, me, alone);
    } else {
        PyObject *args[3] = {span, backend, devs};
        PyObject *r = callv(st, S_ENTER_PEAK, args, 3);
        if (r != NULL) {
            Py_DECREF(r);
            rc = 0;
        }
    }
done:
    Py_DECREF(me);
    return rc;
}

/* Call each hook of the tuple global ``name`` with ``span``, as the Python loops do: a
 * hook's Exception goes to span._entry_hook_failed(hook, err) (``pending`` NULL: the
 * entry hooks) or to span._exit_hook_failed(hook, err, exc, pending), whose answer
 * becomes *pending (the error to raise after them: a new reference, or NULL). -1 for an
 * error the Python loop would not catch. */
static int call_hooks(Core *st, int name, PyObject *span, PyObject *exc, PyObject **pending) {
    PyObject *hooks = G(st, name);
    if (hooks == NULL)
        return -1;
    if (!PyTuple_CheckExact(hooks)) {
        PyErr_Format(PyExc_TypeError, "cudamem.span.%s is not a tuple", NAMES[name]);
        return -1;
    }
    Py_INCREF(hooks); /* a hook may rebind the global */
    int rc = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(hooks); i++) {
        PyObject *hook = PyTuple_GET_ITEM(hooks, i);
        PyObject *r = PyObject_CallOneArg(hook, span);
        if (r != NULL) {
            Py_DECREF(r);
            continue;
        }
        if (!catchable()) {
            rc = -1;
            break;
        }
        PyObject *err = take_exception();
        if (pending == NULL) {
            PyObject *args[2] = {hook, err};
            r = callv(st, S_ENTRY_HOOK_FAILED, args, 2);
        } else {
            PyObject *args[4] = {hook, err, exc, *pending ? *pending : Py_None};
            r = callv(st, S_EXIT_HOOK_FAILED, args, 4);
        }
        Py_XDECREF(err);
        if (r == NULL) {
            rc = -1;
            break;
        }
        if (pending == NULL || r == Py_None) {
            Py_DECREF(r);
            r = NULL;
        }
        if (pending != NULL)
            Py_XSETREF(*pending, r);
    }
    Py_DECREF(hooks);
    return rc;
}

static PyObject *fallback(Core *st, int name, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    PyObject *f = G(st, name);
    return f == NULL ? NULL : PyObject_Vectorcall(f, args, nargs, kwnames);
}

/* open(name, device, sync, peak, leaks, nest=True, push=True, *, hooks=True) */
static PyObject *core_open(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    Core *st = (Core *)self;
    int hooks;
    if (st->raw_type == NULL || nargs < 5 || nargs > 7 ||
        !keyword_hooks(args, nargs, kwnames, &hooks))
        return fallback(st, S_PY_OPEN, args, nargs, kwnames);
    PyObject *name = args[0], *device = args[1];
    int sync = flag(args[2]), peak = flag(args[3]), leaks = flag(args[4]);
    int nest = nargs > 5 ? flag(args[5]) : 1, push = nargs > 6 ? flag(args[6]) : 1;
    if (sync != 0 || peak < 0 || leaks < 0 || nest < 0 || push < 0)
        return fallback(st, S_PY_OPEN, args, nargs, kwnames);
    PyObject *backend = PyDict_GetItemWithError(st->g_backend, S[S_ACTIVE]);
    if (backend == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return fallback(st, S_PY_OPEN, args, nargs, kwnames);
    }
    Py_INCREF(backend);
    PyObject *devs;
    if (device == Py_None) {
        devs = PyObject_GetAttr(backend, S[S_SETTLED]);
        if (devs == NULL)
            PyErr_Clear();
        else if (!PyTuple_CheckExact(devs) || PyTuple_GET_SIZE(devs) != 1)
            Py_CLEAR(devs);
    } else {
        devs = PyLong_CheckExact(device) ? PyTuple_Pack(1, device) : NULL;
        if (devs == NULL && PyErr_Occurred()) {
            Py_DECREF(backend);
            return NULL;
        }
    }
    if (devs == NULL) { /* several devices, none settled yet, or an odd device */
        Py_DECREF(backend);
        return fallback(st, S_PY_OPEN, args, nargs, kwnames);
    }
    PyObject *span = st->raw_type->tp_alloc(st->raw_type, 0);
    if (span == NULL) {
        Py_DECREF(backend);
        Py_DECREF(devs);
        return NULL;
    }
    set(st, span, F_NAME, name);
    set(st, span, F_DEVICE, device);
    set(st, span, F_SYNC, Py_False);
    set(st, span, F_PEAK, peak ? Py_True : Py_False);
    set(st, span, F_LEAKS, leaks ? Py_True : Py_False);
    set(st, span, F_PARENT, Py_None);
    set(st, span, F_CHILDREN, Py_None);
    set(st, span, F_EXTRAS, Py_None);
    set(st, span, F_FOLD, Py_None);
    set(st, span, F_XFOLD, Py_None);
    set(st, span, F_RECORD, Py_None);
    set(st, span, F_CLOSED, Py_False);
    put(st, span, F_DEVS, devs); /* the reference moves into the span */
    int rc = enter_measure(st, span, backend, devs, peak);
    Py_DECREF(backend);
    if (rc < 0 && entry_failed(st, span) < 0)
        goto error;
    if (nest) {
        PyObject *top = st->top, *parent = NULL;
        if (PyContextVar_Get(top, NULL, &parent) < 0)
            goto error;
        if (parent == NULL)
            parent = Py_NewRef(Py_None);
        if (parent != Py_None) {
            PyObject *closed = Py_TYPE(parent) == st->raw_type ? SLOT(st, parent, F_CLOSED) : NULL;
            if (closed != Py_False) { /* closed, or not a RawSpan: the Python rule */
                PyObject *live = call1(st, S_LIVE, parent);
                Py_DECREF(parent);
                if (live == NULL)
                    goto error;
                parent = live;
            }
        }
        put(st, span, F_PARENT, parent);
        if (push) {
            PyObject *token = PyContextVar_Set(top, span);
            if (token == NULL)
                goto error;
            Py_DECREF(token);
        }
    }
    if (hooks && call_hooks(st, leaks ? S_ENTRY_HOOKS_LEAKS : S_ENTRY_HOOKS, span, NULL, NULL) < 0)
        goto error;
    PyObject *start = now_ns(st);
    if (start == NULL)
        goto error;
    put(st, span, F_START_NS, start);
    return span;
error:
    Py_DECREF(span);
    return NULL;
}

/* --------------------------------------------------------------------------- close */

/* The last line of defence (span._close_failed), as the Python outer except. */
static int close_failed(Core *st, PyObject *span) {
    if (!catchable())
        return -1;
    PyObject *err = take_exception();
    PyObject *args[2] = {span, err};
    PyObject *r = callv(st, S_CLOSE_FAILED, args, 2);
    Py_XDECREF(err);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The larger of ``*top`` and ``fold.get(d)`` (a dict or None); -1 on error. */
static int fold_max(PyObject *fold, PyObject *d, long long *top) {
    if (fold == NULL || fold == Py_None)
        return 0;
    if (!PyDict_CheckExact(fold)) {
        PyErr_SetString(PyExc_TypeError, "a span's fold is not a dict");
        return -1;
    }
    PyObject *v = PyDict_GetItemWithError(fold, d);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (x > *top)
        *top = x;
    return 0;
}

/* Everything of a close after the counters are read, up to the exit hooks (the Python
 * ``try`` block past the measurement); -1 with an error set. */
static int close_body(Core *st, PyObject *span, PyObject *backend, PyObject *exc, long long b[3],
                      long long a[3], PyObject *devs, int hooks) {
    int peak = SLOT(st, span, F_PEAK) == Py_True;
    if (peak) {
        PyObject *open_peak = st->open_peak;
        if (PyDict_DelItem(open_peak, span) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError))
                return -1;
            PyErr_Clear();
        }
        if (PyDict_GET_SIZE(open_peak) > 0) {
            PyObject *me = thread_ident();
            if (me == NULL)
                return -1;
            int only = only_me(open_peak, me);
            Py_DECREF(me);
            if (only < 0)
                return -1;
            if (!only) { /* a fold of another thread may still be writing into this span */
                PyObject *r = call0(st, S_WAIT_FOLDS);
                if (r == NULL)
                    return -1;
                Py_DECREF(r);
            }
        }
    }
    PyObject *v;
    if ((v = PyLong_FromLongLong(a[0])) == NULL)
        return -1;
    put(st, span, F_LEVEL, v);
    if ((v = PyLong_FromLongLong(a[0] - b[0])) == NULL)
        return -1;
    put(st, span, F_ALLOC_DELTA, v);
    if ((v = PyLong_FromLongLong(a[1] - b[1])) == NULL)
        return -1;
    put(st, span, F_RES_DELTA, v);
    if (peak) {
        long long top = a[2] > b[0] ? a[2] : b[0];
        PyObject *fold = SLOT(st, span, F_FOLD), *xfold = SLOT(st, span, F_XFOLD);
        if ((fold != NULL && fold != Py_None) || (xfold != NULL && xfold != Py_None)) {
            PyObject *d = PyTuple_GET_ITEM(devs, 0);
            if (fold_max(fold, d, &top) < 0 || fold_max(xfold, d, &top) < 0)
                return -1;
            set(st, span, F_FOLD, Py_None);
            set(st, span, F_XFOLD, Py_None);
        }
        if ((v = PyLong_FromLongLong(top)) == NULL)
            return -1;
        put(st, span, F_PEAK_TOTAL, v);
        if ((v = PyLong_FromLongLong(top - b[0])) == NULL)
            return -1;
        put(st, span, F_PEAK_DELTA, v);
    } else {
        set(st, span, F_PEAK_TOTAL, Py_None);
        set(st, span, F_PEAK_DELTA, Py_None);
    }
    if (exc == Py_None) {
        set(st, span, F_EXCEPTION, Py_None);
    } else {
        PyObject *args[2] = {exc, backend};
        if ((v = callv(st, S_EXCEPTION_INFO, args, 2)) == NULL)
            return -1;
        put(st, span, F_EXCEPTION, v);
    }
    v = PyObject_GetAttr(st->tls, S[S_NAME_ATTR]);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        if ((v = call0(st, S_THREAD_NAME)) == NULL)
            return -1;
    }
    put(st, span, F_THREAD, v);
    set(st, span, F_CLOSED, Py_True);

    PyObject *parent = Py_NewRef(SLOT(st, span, F_PARENT) ? SLOT(st, span, F_PARENT) : Py_None);
    if (parent != Py_None) {
        PyObject *closed = Py_TYPE(parent) == st->raw_type ? SLOT(st, parent, F_CLOSED) : NULL;
        if (closed != Py_False) {
            PyObject *live = call1(st, S_LIVE, parent);
            Py_DECREF(parent);
            if (live == NULL)
                return -1;
            parent = live;
        }
    }
    int rc = -1;
    PyObject *top = st->top, *current = NULL;
    if (PyContextVar_Get(top, NULL, &current) < 0)
        goto done;
    Py_XDECREF(current); /* only its identity is compared */
    if (current == span) {
        PyObject *token = PyContextVar_Set(top, parent);
        if (token == NULL)
            goto done;
        Py_DECREF(token);
    }
    if (parent != Py_None) {
        if (Py_TYPE(parent) != st->raw_type) {
            PyErr_SetString(PyExc_TypeError, "a span's parent is not a RawSpan");
            goto done;
        }
        set(st, span, F_TOP_LEVEL, Py_False);
        PyObject *children = SLOT(st, parent, F_CHILDREN);
        PyObject *most_obj = G(st, S_MAX_CHILDREN);
        if (most_obj == NULL)
            goto done;
        if (children == NULL || children == Py_None) {
            PyObject *fresh = PyList_New(1);
            if (fresh == NULL)
                goto done;
            PyList_SET_ITEM(fresh, 0, Py_NewRef(span));
            put(st, parent, F_CHILDREN, fresh);
        } else {
            long long most = PyLong_AsLongLong(most_obj);
            if (most == -1 && PyErr_Occurred())
                goto done;
            if (!PyList_CheckExact(children)) {
                PyErr_SetString(PyExc_TypeError, "a span's children are not a list");
                goto done;
            }
            if (PyList_GET_SIZE(children) < most) {
                if (PyList_Append(children, span) < 0)
                    goto done;
            } else {
                PyObject *dropped = SLOT(st, parent, F_DROPPED);
                PyObject *one = PyLong_FromLong(1), *more = NULL;
                if (one != NULL) {
                    more = dropped == NULL ? Py_NewRef(one) : PyNumber_Add(dropped, one);
                    Py_DECREF(one);
                }
                if (more == NULL)
                    goto done;
                put(st, parent, F_DROPPED, more);
            }
        }
    } else {
        set(st, span, F_TOP_LEVEL, Py_True);
        PyObject *own = SLOT(st, span, F_PARENT), *children = SLOT(st, span, F_CHILDREN);
        int linked = own != NULL && own != Py_None;
        if (!linked && children != NULL && children != Py_None) {
            linked = PyObject_IsTrue(children);
            if (linked < 0)
                goto done;
        }
        if (linked) {
            PyObject *r = call1(st, S_UNLINK, span);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
        PyObject *sink = G(st, S_FINISHED_SINK);
        if (sink == NULL)
            goto done;
        if (hooks && sink != Py_None) {
            PyObject *queue = st->finished, *at = G(st, S_FINISHED_AT);
            if (at == NULL)
                goto done;
            PyObject *r = PyObject_CallOneArg(st->finished_append, span);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
            Py_ssize_t n = PyObject_Size(queue);
            long long most = PyLong_AsLongLong(at);
            if (n < 0 || (most == -1 && PyErr_Occurred()))
                goto done;
            if (n >= most) {
                r = call0(st, S_DRAIN_FINISHED);
                if (r == NULL)
                    goto done;
                Py_DECREF(r);
            }
        }
    }
    rc = 0;
done:
    Py_DECREF(parent);
    return rc;
}

/* close(span, exc, keeper=None, *, hooks=True) */
static PyObject *core_close(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    Core *st = (Core *)self;
    int hooks;
    if (st->raw_type == NULL || nargs < 2 || nargs > 3 ||
        !keyword_hooks(args, nargs, kwnames, &hooks))
        return fallback(st, S_PY_CLOSE, args, nargs, kwnames);
    PyObject *span = args[0], *exc = args[1], *keeper = nargs > 2 ? args[2] : Py_None;
    if (Py_TYPE(span) != st->raw_type)
        return fallback(st, S_PY_CLOSE, args, nargs, kwnames);
    PyObject *closed = SLOT(st, span, F_CLOSED);
    if (closed == Py_True)
        Py_RETURN_NONE;
    PyObject *devs = SLOT(st, span, F_DEVS), *device = SLOT(st, span, F_DEVICE);
    PyObject *before = SLOT(st, span, F_BEFORE);
    if (closed != Py_False || devs == NULL || device == NULL || before == NULL ||
        SLOT(st, span, F_SYNC) != Py_False || !PyTuple_CheckExact(devs) ||
        PyTuple_GET_SIZE(devs) != 1 || !PyTuple_CheckExact(before) ||
        PyTuple_GET_SIZE(before) != 1)
        return fallback(st, S_PY_CLOSE, args, nargs, kwnames);
    long long b[3], a[3];
    if (!triple(PyTuple_GET_ITEM(before, 0), b))
        return fallback(st, S_PY_CLOSE, args, nargs, kwnames);
    PyObject *backend = PyDict_GetItemWithError(st->g_backend, S[S_ACTIVE]);
    if (backend == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return fallback(st, S_PY_CLOSE, args, nargs, kwnames);
    }
    Py_INCREF(backend);
    Py_INCREF(span);
    Py_INCREF(devs);
    PyObject *pending = NULL, *result = NULL;
    if (device == Py_None) { /* the devices of entry must still be the settled ones */
        PyObject *settled = PyObject_GetAttr(backend, S[S_SETTLED]);
        if (settled == NULL)
            PyErr_Clear();
        Py_XDECREF(settled);
        if (settled != devs)
            goto python;
    }
    PyObject *end = now_ns(st);
    if (end == NULL)
        goto python_clear;
    put(st, span, F_END_NS, end);
    PyObject *values = read_counters(backend, PyTuple_GET_ITEM(devs, 0), S_FAST_COUNTERS,
                                     S_COUNTERS);
    if (values == NULL)
        goto python_clear; /* the Python close reads again and says why it failed */
    if (!triple(values, a)) {
        Py_DECREF(values);
        goto python;
    }
    PyObject *after = PyTuple_Pack(1, values);
    Py_DECREF(values);
    if (after == NULL)
        goto python_clear;
    set(st, span, F_EXIT_DEVS, devs);
    put(st, span, F_AFTER, after);
    /* As the Python try block: a failure before the hooks skips them. */
    if (close_body(st, span, backend, exc, b, a, devs, hooks) < 0) {
        if (close_failed(st, span) < 0)
            goto out;
    } else if (hooks &&
               call_hooks(st, exc == Py_None ? S_EXIT_CALLS_OK : S_EXIT_CALLS, span, exc,
                          &pending) < 0 &&
               close_failed(st, span) < 0) {
        goto out;
    }
    PyObject *extras = SLOT(st, span, F_EXTRAS);
    if (extras != NULL && extras != Py_None) {
        if (keeper != Py_None && PyObject_SetAttr(keeper, S[S_EXTRAS_ATTR], extras) < 0)
            goto out;
        set(st, span, F_EXTRAS, Py_None);
    }
    if (pending != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(pending), pending);
        goto out;
    }
    result = Py_NewRef(Py_None);
    goto out;
python_clear:
    if (!catchable())
        goto out;
    PyErr_Clear();
python:
    result = fallback(st, S_PY_CLOSE, args, nargs, kwnames);
out:
    Py_XDECREF(pending);
    Py_DECREF(devs);
    Py_DECREF(span);
    Py_DECREF(backend);
    return result;
}

/* ---------------------------------------------------------- MemorySpan's with block */

static PyObject *s_span_default = NULL; /* "span" */
static PyObject *s_py_enter = NULL, *s_py_exit = NULL;

/* Field ``f`` of a MemorySpan of the state ``st``. */
#define MSLOT(st, o, f) (*(PyObject **)((char *)(o) + (st)->moff[f]))

/* MemorySpan's ``__enter__`` or ``__exit__`` through one state: a method descriptor of its
 * own kind that holds its state, so that a call finds the state through its own object.
 * Called unbound with the span first (``MemorySpan.__enter__(span)``; CPython calls so
 * where it can, Py_TPFLAGS_METHOD_DESCRIPTOR) or bound to a span (a SpanBound, what a
 * ``with`` block looks up). */
typedef struct {
    PyObject_HEAD
    Core *core;
    PyObject *name, *qualname; /* "__enter__", "MemorySpan.__enter__" */
    vectorcallfunc vectorcall; /* called unbound */
    vectorcallfunc bound;      /* its SpanBound's call */
} SpanMethod;

/* A SpanMethod bound to a span, as a bound method, called straight into the core. */
typedef struct {
    PyObject_HEAD
    SpanMethod *method;
    PyObject *self;
    vectorcallfunc vectorcall;
} SpanBound;

/* Whether ``o`` is a MemorySpan of the state (its fields lie at the offsets read here). */
static int own_span(Core *st, PyObject *o) {
    return st->span_type != NULL && PyObject_TypeCheck(o, st->span_type);
}

/* The Python method (``span._py_span_enter`` or ``_py_span_exit``) with the same call. */
static PyObject *py_method(Core *st, PyObject *name, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    if (st->g_span == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this span core state was cleared");
        return NULL;
    }
    PyObject *f = PyDict_GetItemWithError(st->g_span, name);
    if (f == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "cudamem.span has no %U", name);
        return NULL;
    }
    return PyObject_Vectorcall(f, args, nargsf, kwnames);
}

/* ``self.__enter__()`` for a MemorySpan of ``st``: the span on the stack, opened by
 * ``core_open``; a span entered before or detached goes to the Python method. */
static PyObject *enter_own(Core *st, PyObject *self) {
    PyObject *raw = MSLOT(st, self, M_RAW), *detached = MSLOT(st, self, M_DETACHED);
    PyObject *name = MSLOT(st, self, M_NAME);
    if (raw != Py_None || detached == NULL || !PyLong_CheckExact(detached) ||
        PyLong_AsLong(detached) != 0 || name == NULL || MSLOT(st, self, M_DEVICE) == NULL ||
        MSLOT(st, self, M_SYNC) == NULL || MSLOT(st, self, M_PEAK) == NULL ||
        MSLOT(st, self, M_LEAKS) == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return py_method(st, s_py_enter, &self, 1, NULL);
    }
    if (name == Py_None || (PyUnicode_Check(name) && PyUnicode_GET_LENGTH(name) == 0))
        name = s_span_default; /* ``self._name or "span"`` */
    PyObject *call[5] = {name, MSLOT(st, self, M_DEVICE), MSLOT(st, self, M_SYNC),
                         MSLOT(st, self, M_PEAK), MSLOT(st, self, M_LEAKS)};
    PyObject *span = core_open((PyObject *)st, call, 5, NULL);
    if (span == NULL)
        return NULL;
    PyObject *old = MSLOT(st, self, M_RAW);
    MSLOT(st, self, M_RAW) = span;
    Py_XDECREF(old);
    return Py_NewRef(self);
}

/* ``self.__exit__(exc_type, exc, tb)`` for a MemorySpan of ``st``:
 * ``core_close(self._raw, exc, self)``. */
static PyObject *exit_own(Core *st, PyObject *self, PyObject *exc) {
    PyObject *raw = MSLOT(st, self, M_RAW);
    if (raw == NULL || raw == Py_None)
        Py_RETURN_NONE;
    Py_INCREF(raw);
    PyObject *call[3] = {raw, exc, self};
    PyObject *r = core_close((PyObject *)st, call, 3, NULL);
    Py_DECREF(raw);
    return r;
}

/* MemorySpan.__enter__(self), unbound; any other call goes to the Python method. */
static PyObject *span_enter(PyObject *method, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames) {
    Core *st = ((SpanMethod *)method)->core;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || !own_span(st, args[0]))
        return py_method(st, s_py_enter, args, nargsf, kwnames);
    return enter_own(st, args[0]);
}

/* MemorySpan.__exit__(self, exc_type, exc, tb), unbound; any other call goes to the Python
 * method. */
static PyObject *span_exit(PyObject *method, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    Core *st = ((SpanMethod *)method)->core;
    if (PyVectorcall_NARGS(nargsf) != 4 || kwnames != NULL || !own_span(st, args[0]))
        return py_method(st, s_py_exit, args, nargsf, kwnames);
    return exit_own(st, args[0], args[2]);
}

/* A bound call other than the ``with`` block's: as a bound method calls (the span first). */
static PyObject *bound_other(SpanBound *b, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    PyObject *m = PyMethod_New((PyObject *)b->method, b->self);
    if (m == NULL)
        return NULL;
    PyObject *r = PyObject_Vectorcall(m, args, nargsf, kwnames);
    Py_DECREF(m);
    return r;
}

static PyObject *bound_enter(PyObject *self, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    SpanBound *b = (SpanBound *)self;
    Core *st = b->method->core;
    if (PyVectorcall_NARGS(nargsf) != 0 || kwnames != NULL || !own_span(st, b->self))
        return bound_other(b, args, nargsf, kwnames);
    return enter_own(st, b->self);
}

static PyObject *bound_exit(PyObject *self, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames) {
    SpanBound *b = (SpanBound *)self;
    Core *st = b->method->core;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL || !own_span(st, b->self))
        return bound_other(b, args, nargsf, kwnames);
    return exit_own(st, b->self, args[1]);
}

static int bound_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((SpanBound *)self)->method);
    Py_VISIT(((SpanBound *)self)->self);
    return 0;
}

static void bound_dealloc(PyObject *self) {
    SpanBound *b = (SpanBound *)self;
    PyObject_GC_UnTrack(self);
    Py_XDECREF(b->method);
    Py_XDECREF(b->self);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *bound_repr(PyObject *self) {
    SpanBound *b = (SpanBound *)self;
    return PyUnicode_FromFormat("<bound %U of %R>", b->method->qualname, b->self);
}

static PyMemberDef bound_members[] = {
    {"__self__", T_OBJECT, offsetof(SpanBound, self), READONLY, NULL},
    {"__func__", T_OBJECT, offsetof(SpanBound, method), READONLY, NULL},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject SpanBoundType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = CM_STR(CUDAMEM_MODULE_NAME) ".SpanBound",
    .tp_basicsize = sizeof(SpanBound),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(SpanBound, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_repr = bound_repr,
    .tp_traverse = bound_traverse,
    .tp_dealloc = bound_dealloc,
    .tp_members = bound_members,
};

/* Bound to a span: a SpanBound (one that is not the state's goes to the Python method, as
 * a bound method); on the class: itself. */
static PyObject *method_get(PyObject *self, PyObject *obj, PyObject *type) {
    SpanMethod *m = (SpanMethod *)self;
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    if (!own_span(m->core, obj))
        return PyMethod_New(self, obj);
    SpanBound *b = PyObject_GC_New(SpanBound, &SpanBoundType);
    if (b == NULL)
        return NULL;
    b->method = (SpanMethod *)Py_NewRef(self);
    b->self = Py_NewRef(obj);
    b->vectorcall = m->bound;
    PyObject_GC_Track(b);
    return (PyObject *)b;
}

static PyObject *method_repr(PyObject *self) {
    return PyUnicode_FromFormat("<%U of the compiled span core>", ((SpanMethod *)self)->qualname);
}

static PyObject *method_doc(PyObject *self, void *closure) {
    return PyUnicode_FromFormat("MemorySpan.%U through the compiled span core.",
                                ((SpanMethod *)self)->name);
}

static int method_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((SpanMethod *)self)->core);
    return 0;
}

static void method_dealloc(PyObject *self) {
    SpanMethod *m = (SpanMethod *)self;
    PyObject_GC_UnTrack(self);
    Py_XDECREF(m->core);
    Py_XDECREF(m->name);
    Py_XDECREF(m->qualname);
    Py_TYPE(self)->tp_free(self);
}

static PyMemberDef method_members[] = {
    {"__name__", T_OBJECT, offsetof(SpanMethod, name), READONLY, NULL},
    {"__qualname__", T_OBJECT, offsetof(SpanMethod, qualname), READONLY, NULL},
    {NULL, 0, 0, 0, NULL}};

static PyGetSetDef method_getset[] = {{"__doc__", method_doc, NULL, NULL, NULL},
                                      {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject SpanMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = CM_STR(CUDAMEM_MODULE_NAME) ".SpanMethod",
    .tp_basicsize = sizeof(SpanMethod),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(SpanMethod, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_repr = method_repr,
    .tp_traverse = method_traverse,
    .tp_dealloc = method_dealloc,
    .tp_members = method_members,
    .tp_getset = method_getset,
};

/* A SpanMethod of ``st`` named ``name`` (a new reference, or NULL with an error). */
static PyObject *new_method(Core *st, PyObject *type_qualname, const char *name,
                            vectorcallfunc call, vectorcallfunc bound) {
    SpanMethod *m = (SpanMethod *)SpanMethodType.tp_alloc(&SpanMethodType, 0);
    if (m == NULL)
        return NULL;
    m->core = (Core *)Py_NewRef((PyObject *)st);
    m->vectorcall = call;
    m->bound = bound;
    m->name = PyUnicode_InternFromString(name);
    m->qualname = PyUnicode_FromFormat("%U.%s", type_qualname, name);
    if (m->name == NULL || m->qualname == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

/* make(name, sync, peak, leaks): ``track(name, ...)``'s MemorySpan (no device), its fields
 * stored as span._py_make_span stores them. */
static PyObject *core_make(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Core *st = (Core *)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "make(name, sync, peak, leaks)");
        return NULL;
    }
    if (st->span_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this span core state was cleared");
        return NULL;
    }
    int flags[3];
    for (int i = 0; i < 3; i++) {
        PyObject *v = args[i + 1];
        flags[i] = v == Py_True ? 1 : v == Py_False ? 0 : PyObject_IsTrue(v);
        if (flags[i] < 0)
            return NULL;
    }
    PyObject *span = st->span_type->tp_alloc(st->span_type, 0);
    if (span == NULL)
        return NULL;
    MSLOT(st, span, M_NAME) = Py_NewRef(args[0]);
    MSLOT(st, span, M_DEVICE) = Py_NewRef(Py_None);
    MSLOT(st, span, M_RAW) = Py_NewRef(Py_None);
    MSLOT(st, span, M_EXTRAS) = Py_NewRef(Py_None);
    MSLOT(st, span, M_DETACHED) = PyLong_FromLong(0);
    MSLOT(st, span, M_SYNC) = Py_NewRef(flags[0] ? Py_True : Py_False);
    MSLOT(st, span, M_PEAK) = Py_NewRef(flags[1] ? Py_True : Py_False);
    MSLOT(st, span, M_LEAKS) = Py_NewRef(flags[2] ? Py_True : Py_False);
    if (MSLOT(st, span, M_DETACHED) == NULL) {
        Py_DECREF(span);
        return NULL;
    }
    return span;
}

/* ------------------------------------------------------------------ the history's fold */

/* An int slot of a RawSpan as a long long; 0 when it is not one (the fold then goes to
 * Python). */
static int int_slot(Core *st, PyObject *r, int f, long long *out) {
    PyObject *v = SLOT(st, r, f);
    int overflow = 0;
    if (v == NULL || !PyLong_CheckExact(v))
        return 0;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

#define ADD(sum, x)                                                                           \
    if (__builtin_add_overflow(sum, x, &sum))                                                 \
    Py_RETURN_NONE

/* columns(spans): what the history folds a batch of closed RawSpans into, as
 * (errors, measured, alloc_sum, res_sum, dur_sum_ns, alloc_max, res_max, dur_max_ns,
 * peak_calls, peak_sum, peakd_sum, peak_max, peakd_max), or None when a span is not what
 * this fold reads (then _history folds the batch in Python, to the same figures). */
static PyObject *core_columns(PyObject *self, PyObject *spans) {
    Core *st = (Core *)self;
    if (st->raw_type == NULL || !PyList_CheckExact(spans) || PyList_GET_SIZE(spans) == 0)
        Py_RETURN_NONE;
    Py_ssize_t errors = 0, measured = 0, peaks = 0;
    long long alloc_sum = 0, res_sum = 0, dur_sum = 0, peak_sum = 0, peakd_sum = 0;
    long long alloc_max = LLONG_MIN, res_max = LLONG_MIN, dur_max = LLONG_MIN;
    long long peak_max = LLONG_MIN, peakd_max = LLONG_MIN;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(spans); i++) {
        PyObject *r = PyList_GET_ITEM(spans, i);
        long long a, res, end, start, peak, peakd;
        if (Py_TYPE(r) != st->raw_type || !int_slot(st, r, F_ALLOC_DELTA, &a) ||
            !int_slot(st, r, F_RES_DELTA, &res) || !int_slot(st, r, F_END_NS, &end) ||
            !int_slot(st, r, F_START_NS, &start))
            Py_RETURN_NONE;
        PyObject *exc = SLOT(st, r, F_EXCEPTION), *after = SLOT(st, r, F_AFTER);
        PyObject *top = SLOT(st, r, F_PEAK_TOTAL), *topd = SLOT(st, r, F_PEAK_DELTA);
        if (exc == NULL || after == NULL || !PyTuple_CheckExact(after) || top == NULL ||
            topd == NULL)
            Py_RETURN_NONE;
        errors += exc != Py_None;
        measured += PyTuple_GET_SIZE(after) != 0;
        long long dur;
        if (__builtin_sub_overflow(end, start, &dur))
            Py_RETURN_NONE;
        ADD(alloc_sum, a);
        ADD(res_sum, res);
        ADD(dur_sum, dur);
        alloc_max = a > alloc_max ? a : alloc_max;
        res_max = res > res_max ? res : res_max;
        dur_max = dur > dur_max ? dur : dur_max;
        if (top == Py_None || topd == Py_None)
            continue;
        if (!int_slot(st, r, F_PEAK_TOTAL, &peak) || !int_slot(st, r, F_PEAK_DELTA, &peakd))
            Py_RETURN_NONE;
        peaks++;
        ADD(peak_sum, peak);
        ADD(peakd_sum, peakd);
        peak_max = peak > peak_max ? peak : peak_max;
        peakd_max = peakd > peakd_max ? peakd : peakd_max;
    }
    return Py_BuildValue("nnLLLLLLnLLLL", errors, measured, alloc_sum, res_sum, dur_sum,
                         alloc_max, res_max, dur_max, peaks, peak_sum, peakd_sum, peak_max,
                         peakd_max);
}

/* ------------------------------------------------------------------- the state */

static int core_traverse(PyObject *self, visitproc visit, void *arg) {
    Core *st = (Core *)self;
    Py_VISIT(st->raw_type);
    Py_VISIT(st->span_type);
    Py_VISIT(st->g_span);
    Py_VISIT(st->g_backend);
    Py_VISIT(st->open_peak);
    Py_VISIT(st->process_peak);
    Py_VISIT(st->inbox_append);
    Py_VISIT(st->top);
    Py_VISIT(st->tls);
    Py_VISIT(st->finished);
    Py_VISIT(st->finished_append);
    Py_VISIT(st->enter);
    Py_VISIT(st->exit);
    return 0;
}

/* The types first: a call that comes while the rest is cleared finds them NULL and goes no
 * further (open and close hand the call on, and a cleared ``g_span`` refuses it). */
static int core_clear(PyObject *self) {
    Core *st = (Core *)self;
    Py_CLEAR(st->raw_type);
    Py_CLEAR(st->span_type);
    Py_CLEAR(st->enter);
    Py_CLEAR(st->exit);
    Py_CLEAR(st->open_peak);
    Py_CLEAR(st->process_peak);
    Py_CLEAR(st->inbox_append);
    Py_CLEAR(st->top);
    Py_CLEAR(st->tls);
    Py_CLEAR(st->finished);
    Py_CLEAR(st->finished_append);
    Py_CLEAR(st->g_backend);
    Py_CLEAR(st->g_span);
    return 0;
}

static void core_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef core_methods[] = {
    {"open", (PyCFunction)(void (*)(void))core_open, METH_FASTCALL | METH_KEYWORDS,
     "open(name, device, sync, peak, leaks, nest=True, push=True, *, hooks=True)"},
    {"close", (PyCFunction)(void (*)(void))core_close, METH_FASTCALL | METH_KEYWORDS,
     "close(span, exc, keeper=None, *, hooks=True)"},
    {"columns", core_columns, METH_O,
     "columns(spans): a batch of closed spans' sums and maxima for the history"},
    {"make", (PyCFunction)(void (*)(void))core_make, METH_FASTCALL,
     "make(name, sync, peak, leaks): track()'s MemorySpan"},
    {NULL, NULL, 0, NULL}};

static PyMemberDef core_members[] = {
    {"enter", T_OBJECT, offsetof(Core, enter), READONLY, "MemorySpan.__enter__ through it"},
    {"exit", T_OBJECT, offsetof(Core, exit), READONLY, "MemorySpan.__exit__ through it"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = CM_STR(CUDAMEM_MODULE_NAME) ".Core",
    .tp_doc = "One span module's state in the compiled span core (made by init).",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = core_traverse,
    .tp_clear = core_clear,
    .tp_dealloc = core_dealloc,
    .tp_methods = core_methods,
    .tp_members = core_members,
};

/* The offsets of ``names`` (object slots of ``type``) into ``out``; -1 with an error. */
static int slot_offsets(PyTypeObject *type, const char **names, int n, Py_ssize_t *out) {
    for (int i = 0; i < n; i++) {
        PyObject *descr = PyDict_GetItemString(type->tp_dict, names[i]);
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, names[i]);
            return -1;
        }
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset <= 0 ||
            (size_t)m->offset + sizeof(PyObject *) > (size_t)type->tp_basicsize) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot", type->tp_name,
                         names[i]);
            return -1;
        }
        out[i] = m->offset;
    }
    return 0;
}

/* ---------------------------------------------------------------------------- init */

/* init(span_globals, backend_globals, RawSpan, MemorySpan) -> Core: check the slots, keep
 * what the calls read, in a state of that span module's own. */
static PyObject *core_init(PyObject *self, PyObject *args) {
    PyObject *span_globals, *backend_globals;
    PyTypeObject *type, *mtype;
    if (!PyArg_ParseTuple(args, "O!O!O!O!:init", &PyDict_Type, &span_globals, &PyDict_Type,
                          &backend_globals, &PyType_Type, &type, &PyType_Type, &mtype))
        return NULL;
    Py_ssize_t offsets[N_FIELDS], moffsets[M_FIELDS];
    if (slot_offsets(type, FIELD_NAMES, N_FIELDS, offsets) < 0 ||
        slot_offsets(mtype, MFIELD_NAMES, M_FIELDS, moffsets) < 0)
        return NULL;
    /* The containers span.py mutates in place and never rebinds. */
    PyObject *kept[4] = {NULL, NULL, NULL, NULL};
    const int kept_names[4] = {S_OPEN_PEAK, S_PROCESS_PEAK, S_TOP, S_TLS};
    for (int i = 0; i < 4; i++) {
        kept[i] = PyDict_GetItemWithError(span_globals, S[kept_names[i]]);
        if (kept[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_RuntimeError, "cudamem.span has no %s", NAMES[kept_names[i]]);
            return NULL;
        }
    }
    if (!PyDict_CheckExact(kept[0]) || !PyDict_CheckExact(kept[1]) ||
        !PyContextVar_CheckExact(kept[2])) {
        PyErr_SetString(PyExc_TypeError, "cudamem.span's peak registries or stack are not "
                                         "what the span core reads");
        return NULL;
    }
    PyObject *inbox = PyDict_GetItemWithError(span_globals, S[S_PEAK_INBOX]);
    PyObject *queue = inbox == NULL ? NULL : PyDict_GetItemWithError(span_globals, S[S_FINISHED]);
    if (queue == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "cudamem.span has no _peak_inbox or finished");
        return NULL;
    }
    Core *st = (Core *)CoreType.tp_alloc(&CoreType, 0);
    if (st == NULL)
        return NULL;
    memcpy(st->off, offsets, sizeof offsets);
    memcpy(st->moff, moffsets, sizeof moffsets);
    st->open_peak = Py_NewRef(kept[0]);
    st->process_peak = Py_NewRef(kept[1]);
    st->top = Py_NewRef(kept[2]);
    st->tls = Py_NewRef(kept[3]);
    st->finished = Py_NewRef(queue);
    st->g_span = Py_NewRef(span_globals);
    st->g_backend = Py_NewRef(backend_globals);
    if ((st->inbox_append = PyObject_GetAttr(inbox, S[S_APPEND])) == NULL ||
        (st->finished_append = PyObject_GetAttr(queue, S[S_APPEND])) == NULL)
        goto error;
    PyObject *time = PyImport_ImportModule("time");
    PyObject *perf = time == NULL ? NULL : PyObject_GetAttrString(time, "perf_counter_ns");
    Py_XDECREF(time);
    if (perf == NULL)
        goto error;
    st->monotonic = PyDict_GetItemWithError(span_globals, S[S_NOW_NS]) == perf;
    Py_DECREF(perf);
    if (PyErr_Occurred())
        goto error;
    PyObject *qualname = PyObject_GetAttrString((PyObject *)mtype, "__qualname__");
    if (qualname == NULL)
        goto error;
    st->enter = new_method(st, qualname, "__enter__", span_enter, bound_enter);
    if (st->enter != NULL)
        st->exit = new_method(st, qualname, "__exit__", span_exit, bound_exit);
    Py_DECREF(qualname);
    if (st->exit == NULL)
        goto error;
    /* Last: a state with its types set is one that serves. */
    st->raw_type = (PyTypeObject *)Py_NewRef((PyObject *)type);
    st->span_type = (PyTypeObject *)Py_NewRef((PyObject *)mtype);
    return (PyObject *)st;
error:
    Py_DECREF(st);
    return NULL;
}

static PyMethodDef methods[] = {
    {"init", core_init, METH_VARARGS,
     "init(span_globals, backend_globals, RawSpan, MemorySpan) -> Core: a span module's "
     "state, whose open, close, make and columns serve that module, and whose enter and "
     "exit are its MemorySpan's __enter__ and __exit__"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, CM_STR(CUDAMEM_MODULE_NAME),
                                    "cudamem's span core (see span.py)", -1, methods};

PyMODINIT_FUNC CM_CAT(PyInit_, CUDAMEM_MODULE_NAME)(void) {
    for (int i = 0; i < N_NAMES; i++) {
        if (S[i] == NULL && (S[i] = PyUnicode_InternFromString(NAMES[i])) == NULL)
            return NULL;
    }
    if (s_span_default == NULL && (s_span_default = PyUnicode_InternFromString("span")) == NULL)
        return NULL;
    if (s_py_enter == NULL &&
        (s_py_enter = PyUnicode_InternFromString("_py_span_enter")) == NULL)
        return NULL;
    if (s_py_exit == NULL && (s_py_exit = PyUnicode_InternFromString("_py_span_exit")) == NULL)
        return NULL;
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&SpanMethodType) < 0 ||
        PyType_Ready(&SpanBoundType) < 0)
        return NULL;
    return PyModule_Create(&module);
}

/* The span core's helpers: slot stores, the state's fields, calls of the Python helpers,
 * the clock, the thread, counter reads and the hook loops (see core.h). */
#include "core.h"

#include <time.h>

PyObject *cm_names[N_NAMES];

const char *const cm_field_names[N_FIELDS] = {
    "name", "device", "sync", "peak", "leaks", "parent", "children", "extras", "fold",
    "xfold", "_record", "closed", "devs", "owner", "solo", "armed", "before", "start_ns",
    "end_ns", "exit_devs", "after", "level", "alloc_delta", "res_delta", "peak_total",
    "peak_delta", "exception", "thread", "top_level", "dropped"};

const char *const cm_mfield_names[M_FIELDS] = {"_detached", "_device", "_extras", "_leaks",
                                               "_name",     "_peak",   "_raw",    "_sync"};

const char *const cm_state_names[N_STATE] = {
    "py_open",      "py_close",      "entry_hooks",  "entry_hooks_leaks", "exit_calls",
    "exit_calls_ok", "finished_sink", "max_children", "peak_inbox_max",    "finished_at"};

/* Store ``v`` (a new reference, stolen) in field ``f`` of a RawSpan. */
void cm_put(Core *st, PyObject *o, int f, PyObject *v) {
    PyObject *old = SLOT(st, o, f);
    SLOT(st, o, f) = v;
    Py_XDECREF(old);
}

/* Store ``v`` (borrowed) in field ``f``. */
void cm_set(Core *st, PyObject *o, int f, PyObject *v) { cm_put(st, o, f, Py_NewRef(v)); }

/* Field ``i`` of the SpanState (borrowed), or NULL with an exception set. */
PyObject *cm_state(Core *st, int i) {
    if (st->state == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this span core state was cleared");
        return NULL;
    }
    PyObject *v = *(PyObject **)((char *)st->state + st->soff[i]);
    if (v == NULL)
        PyErr_Format(PyExc_AttributeError, "the span state has no %s", cm_state_names[i]);
    return v;
}

/* Helper ``fn`` (borrowed), or NULL with an exception set (a cleared state). */
static PyObject *helper(Core *st, int fn) {
    PyObject *f = st->fn[fn];
    if (f == NULL)
        PyErr_SetString(PyExc_RuntimeError, "this span core state was cleared");
    return f;
}

PyObject *cm_call0(Core *st, int fn) {
    PyObject *f = helper(st, fn);
    return f == NULL ? NULL : PyObject_CallNoArgs(f);
}

PyObject *cm_call1(Core *st, int fn, PyObject *a) {
    PyObject *f = helper(st, fn);
    return f == NULL ? NULL : PyObject_CallOneArg(f, a);
}

PyObject *cm_callv(Core *st, int fn, PyObject *const *args, size_t n) {
    PyObject *f = helper(st, fn);
    return f == NULL ? NULL : PyObject_Vectorcall(f, args, n, NULL);
}

/* The Python open or close (``which``: ST_PY_OPEN, ST_PY_CLOSE) with the same call. */
PyObject *cm_fallback(Core *st, int which, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames) {
    PyObject *f = cm_state(st, which);
    if (f == NULL)
        return NULL;
    Py_INCREF(f); /* the call may rebind it */
    PyObject *r = PyObject_Vectorcall(f, args, nargs, kwnames);
    Py_DECREF(f);
    return r;
}

/* The active backend (borrowed), or NULL: with an exception set on error, without one when
 * none is held (the Python path then answers). */
PyObject *cm_backend(Core *st) {
    if (st->backend_ns == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this span core state was cleared");
        return NULL;
    }
    return PyDict_GetItemWithError(st->backend_ns, st->backend_key);
}

/* The pending exception as an object (a new reference; the error indicator cleared). */
PyObject *cm_take_exception(void) {
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
int cm_catchable(void) { return PyErr_ExceptionMatches(PyExc_Exception); }

/* ``_now_ns()``: CLOCK_MONOTONIC, what time.perf_counter_ns reads on Linux. */
PyObject *cm_now_ns(Core *st) {
#if defined(__linux__)
    struct timespec ts;
    if (st->monotonic && clock_gettime(CLOCK_MONOTONIC, &ts) == 0)
        return PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
#endif
    return cm_call0(st, FN_NOW_NS);
}

/* threading.get_ident(), the same object while the thread is the same. */
static unsigned long last_ident = 0;
static PyObject *last_ident_obj = NULL;

PyObject *cm_thread_ident(void) {
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

/* Whether every value of ``open_peak`` equals ``me`` (the Python ``_only``); -1 on error. */
int cm_only_me(PyObject *open_peak, PyObject *me) {
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
int cm_triple(PyObject *t, long long out[3]) {
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
 * when it is None or raises an Exception (what the Python edges do); a new reference. */
PyObject *cm_read_counters(PyObject *backend, PyObject *d, int fast_name, int method) {
    PyObject *fast = PyObject_GetAttr(backend, cm_names[fast_name]);
    if (fast == NULL)
        return NULL;
    if (fast != Py_None) {
        PyObject *v = PyObject_CallOneArg(fast, d);
        Py_DECREF(fast);
        if (v != NULL || !cm_catchable())
            return v;
        PyErr_Clear();
    } else {
        Py_DECREF(fast);
    }
    return PyObject_CallMethodOneArg(backend, cm_names[method], d);
}

/* Parse ``hooks=`` (the only keyword) into *hooks; 0 when the call is not one this module
 * takes (the Python function then answers, with its own errors). */
int cm_keyword_hooks(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int *hooks) {
    *hooks = 1;
    if (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)
        return 1;
    if (PyTuple_GET_SIZE(kwnames) != 1)
        return 0;
    PyObject *key = PyTuple_GET_ITEM(kwnames, 0);
    if (key != cm_names[S_HOOKS] && PyUnicode_Compare(key, cm_names[S_HOOKS]) != 0) {
        PyErr_Clear();
        return 0;
    }
    PyObject *v = args[nargs];
    if (v != Py_True && v != Py_False)
        return 0;
    *hooks = v == Py_True;
    return 1;
}

int cm_flag(PyObject *v) { return v == Py_True ? 1 : v == Py_False ? 0 : -1; }

/* Call each hook of the state's tuple ``hooks_field`` with ``span``, as the Python loops
 * do: a hook's Exception goes to the entry_hook_failed helper (``pending`` NULL: the entry
 * hooks) or to exit_hook_failed(hook, err, exc, pending), whose answer becomes *pending
 * (the error to raise after them: a new reference, or NULL). -1 for an error the Python
 * loop would not catch. */
int cm_call_hooks(Core *st, int hooks_field, PyObject *span, PyObject *exc, PyObject **pending) {
    PyObject *hooks = cm_state(st, hooks_field);
    if (hooks == NULL)
        return -1;
    if (!PyTuple_CheckExact(hooks)) {
        PyErr_Format(PyExc_TypeError, "the span state's %s is not a tuple",
                     cm_state_names[hooks_field]);
        return -1;
    }
    Py_INCREF(hooks); /* a hook may rebind the field */
    int rc = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(hooks); i++) {
        PyObject *hook = PyTuple_GET_ITEM(hooks, i);
        PyObject *r = PyObject_CallOneArg(hook, span);
        if (r != NULL) {
            Py_DECREF(r);
            continue;
        }
        if (!cm_catchable()) {
            rc = -1;
            break;
        }
        PyObject *err = cm_take_exception();
        if (pending == NULL) {
            PyObject *args[2] = {hook, err};
            r = cm_callv(st, FN_ENTRY_HOOK_FAILED, args, 2);
        } else {
            PyObject *args[4] = {hook, err, exc, *pending ? *pending : Py_None};
            r = cm_callv(st, FN_EXIT_HOOK_FAILED, args, 4);
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

/* The span core's open (see core.h): the Python ``_py_open`` for the common case. */
#include "core.h"

/* The entry measurement raised: span._entry_failed(span, err), as the Python except. */
static int entry_failed(Core *st, PyObject *span) {
    if (!cm_catchable())
        return -1;
    PyObject *err = cm_take_exception();
    PyObject *args[2] = {span, err};
    PyObject *r = cm_callv(st, FN_ENTRY_FAILED, args, 2);
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
    PyObject *values = cm_read_counters(backend, d, S_FAST_RESET, S_COUNTERS_RESET_PEAK);
    if (values == NULL)
        return -1;
    PyObject *before = PyTuple_Pack(1, values);
    if (before == NULL) {
        Py_DECREF(values);
        return -1;
    }
    cm_put(st, span, F_BEFORE, before);
    cm_set(st, span, F_ARMED, Py_True);
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
                cm_put(st, other, F_FOLD, fresh);
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
            PyObject *inbox = st->inbox, *limit = cm_state(st, ST_PEAK_INBOX_MAX);
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
                r = cm_call0(st, FN_MERGE_SOON);
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
        PyObject *values = cm_read_counters(backend, d, S_FAST_COUNTERS, S_COUNTERS);
        if (values == NULL)
            return -1;
        PyObject *before = PyTuple_Pack(1, values);
        Py_DECREF(values);
        if (before == NULL)
            return -1;
        cm_put(st, span, F_BEFORE, before);
        return 0;
    }
    PyObject *me = cm_thread_ident();
    if (me == NULL)
        return -1;
    cm_set(st, span, F_OWNER, me);
    cm_set(st, span, F_SOLO, Py_True);
    cm_set(st, span, F_ARMED, Py_False);
    int rc = -1;
    PyObject *open_peak = st->open_peak;
    if (PyDict_SetItem(open_peak, span, me) < 0) /* announce (see span._enter_peak) */
        goto done;
    int alone = PyDict_GET_SIZE(open_peak) == 1;
    int only = alone ? 1 : cm_only_me(open_peak, me);
    if (only < 0)
        goto done;
    if (only) {
        rc = enter_peak_one(st, span, backend, d, open_peak, me, alone);
    } else {
        PyObject *args[3] = {span, backend, devs};
        PyObject *r = cm_callv(st, FN_ENTER_PEAK, args, 3);
        if (r != NULL) {
            Py_DECREF(r);
            rc = 0;
        }
    }
done:
    Py_DECREF(me);
    return rc;
}

/* open(name, device, sync, peak, leaks, nest=True, push=True, *, hooks=True) */
PyObject *cm_open(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    Core *st = (Core *)self;
    int hooks;
    if (st->raw_type == NULL || nargs < 5 || nargs > 7 ||
        !cm_keyword_hooks(args, nargs, kwnames, &hooks))
        return cm_fallback(st, ST_PY_OPEN, args, nargs, kwnames);
    PyObject *name = args[0], *device = args[1];
    int sync = cm_flag(args[2]), peak = cm_flag(args[3]), leaks = cm_flag(args[4]);
    int nest = nargs > 5 ? cm_flag(args[5]) : 1, push = nargs > 6 ? cm_flag(args[6]) : 1;
    if (sync != 0 || peak < 0 || leaks < 0 || nest < 0 || push < 0)
        return cm_fallback(st, ST_PY_OPEN, args, nargs, kwnames);
    PyObject *backend = cm_backend(st);
    if (backend == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return cm_fallback(st, ST_PY_OPEN, args, nargs, kwnames);
    }
    Py_INCREF(backend);
    PyObject *devs;
    if (device == Py_None) {
        devs = PyObject_GetAttr(backend, cm_names[S_SETTLED]);
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
        return cm_fallback(st, ST_PY_OPEN, args, nargs, kwnames);
    }
    PyObject *span = st->raw_type->tp_alloc(st->raw_type, 0);
    if (span == NULL) {
        Py_DECREF(backend);
        Py_DECREF(devs);
        return NULL;
    }
    cm_set(st, span, F_NAME, name);
    cm_set(st, span, F_DEVICE, device);
    cm_set(st, span, F_SYNC, Py_False);
    cm_set(st, span, F_PEAK, peak ? Py_True : Py_False);
    cm_set(st, span, F_LEAKS, leaks ? Py_True : Py_False);
    cm_set(st, span, F_PARENT, Py_None);
    cm_set(st, span, F_CHILDREN, Py_None);
    cm_set(st, span, F_EXTRAS, Py_None);
    cm_set(st, span, F_FOLD, Py_None);
    cm_set(st, span, F_XFOLD, Py_None);
    cm_set(st, span, F_RECORD, Py_None);
    cm_set(st, span, F_CLOSED, Py_False);
    cm_put(st, span, F_DEVS, devs); /* the reference moves into the span */
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
                PyObject *live = cm_call1(st, FN_LIVE, parent);
                Py_DECREF(parent);
                if (live == NULL)
                    goto error;
                parent = live;
            }
        }
        cm_put(st, span, F_PARENT, parent);
        if (push) {
            PyObject *token = PyContextVar_Set(top, span);
            if (token == NULL)
                goto error;
            Py_DECREF(token);
        }
    }
    if (hooks && cm_call_hooks(st, leaks ? ST_ENTRY_HOOKS_LEAKS : ST_ENTRY_HOOKS, span, NULL, NULL) < 0)
        goto error;
    PyObject *start = cm_now_ns(st);
    if (start == NULL)
        goto error;
    cm_put(st, span, F_START_NS, start);
    return span;
error:
    Py_DECREF(span);
    return NULL;
}


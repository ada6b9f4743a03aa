/* The span core's close (see core.h): the Python ``_py_close`` for the common case. */
#include "core.h"

/* The last line of defence (span._close_failed), as the Python outer except. */
static int close_failed(Core *st, PyObject *span) {
    if (!cm_catchable())
        return -1;
    PyObject *err = cm_take_exception();
    PyObject *args[2] = {span, err};
    PyObject *r = cm_callv(st, FN_CLOSE_FAILED, args, 2);
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
            PyObject *me = cm_thread_ident();
            if (me == NULL)
                return -1;
            int only = cm_only_me(open_peak, me);
            Py_DECREF(me);
            if (only < 0)
                return -1;
            if (!only) { /* a fold of another thread may still be writing into this span */
                PyObject *r = cm_call0(st, FN_WAIT_FOLDS);
                if (r == NULL)
                    return -1;
                Py_DECREF(r);
            }
        }
    }
    PyObject *v;
    if ((v = PyLong_FromLongLong(a[0])) == NULL)
        return -1;
    cm_put(st, span, F_LEVEL, v);
    if ((v = PyLong_FromLongLong(a[0] - b[0])) == NULL)
        return -1;
    cm_put(st, span, F_ALLOC_DELTA, v);
    if ((v = PyLong_FromLongLong(a[1] - b[1])) == NULL)
        return -1;
    cm_put(st, span, F_RES_DELTA, v);
    if (peak) {
        long long top = a[2] > b[0] ? a[2] : b[0];
        PyObject *fold = SLOT(st, span, F_FOLD), *xfold = SLOT(st, span, F_XFOLD);
        if ((fold != NULL && fold != Py_None) || (xfold != NULL && xfold != Py_None)) {
            PyObject *d = PyTuple_GET_ITEM(devs, 0);
            if (fold_max(fold, d, &top) < 0 || fold_max(xfold, d, &top) < 0)
                return -1;
            cm_set(st, span, F_FOLD, Py_None);
            cm_set(st, span, F_XFOLD, Py_None);
        }
        if ((v = PyLong_FromLongLong(top)) == NULL)
            return -1;
        cm_put(st, span, F_PEAK_TOTAL, v);
        if ((v = PyLong_FromLongLong(top - b[0])) == NULL)
            return -1;
        cm_put(st, span, F_PEAK_DELTA, v);
    } else {
        cm_set(st, span, F_PEAK_TOTAL, Py_None);
        cm_set(st, span, F_PEAK_DELTA, Py_None);
    }
    if (exc == Py_None) {
        cm_set(st, span, F_EXCEPTION, Py_None);
    } else {
        PyObject *args[2] = {exc, backend};
        if ((v = cm_callv(st, FN_EXCEPTION_INFO, args, 2)) == NULL)
            return -1;
        cm_put(st, span, F_EXCEPTION, v);
    }
    v = PyObject_GetAttr(st->tls, cm_names[S_NAME_ATTR]);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        if ((v = cm_call0(st, FN_THREAD_NAME)) == NULL)
            return -1;
    }
    cm_put(st, span, F_THREAD, v);
    cm_set(st, span, F_CLOSED, Py_True);

    PyObject *parent = Py_NewRef(SLOT(st, span, F_PARENT) ? SLOT(st, span, F_PARENT) : Py_None);
    if (parent != Py_None) {
        PyObject *closed = Py_TYPE(parent) == st->raw_type ? SLOT(st, parent, F_CLOSED) : NULL;
        if (closed != Py_False) {
            PyObject *live = cm_call1(st, FN_LIVE, parent);
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
        cm_set(st, span, F_TOP_LEVEL, Py_False);
        PyObject *children = SLOT(st, parent, F_CHILDREN);
        PyObject *most_obj = cm_state(st, ST_MAX_CHILDREN);
        if (most_obj == NULL)
            goto done;
        if (children == NULL || children == Py_None) {
            PyObject *fresh = PyList_New(1);
            if (fresh == NULL)
                goto done;
            PyList_SET_ITEM(fresh, 0, Py_NewRef(span));
            cm_put(st, parent, F_CHILDREN, fresh);
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
                cm_put(st, parent, F_DROPPED, more);
            }
        }
    } else {
        cm_set(st, span, F_TOP_LEVEL, Py_True);
        PyObject *own = SLOT(st, span, F_PARENT), *children = SLOT(st, span, F_CHILDREN);
        int linked = own != NULL && own != Py_None;
        if (!linked && children != NULL && children != Py_None) {
            linked = PyObject_IsTrue(children);
            if (linked < 0)
                goto done;
        }
        if (linked) {
            PyObject *r = cm_call1(st, FN_UNLINK, span);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
        PyObject *sink = cm_state(st, ST_FINISHED_SINK);
        if (sink == NULL)
            goto done;
        if (hooks && sink != Py_None) {
            PyObject *queue = st->finished, *at = cm_state(st, ST_FINISHED_AT);
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
                r = cm_call0(st, FN_DRAIN_FINISHED);
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
PyObject *cm_close(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    Core *st = (Core *)self;
    int hooks;
    if (st->raw_type == NULL || nargs < 2 || nargs > 3 ||
        !cm_keyword_hooks(args, nargs, kwnames, &hooks))
        return cm_fallback(st, ST_PY_CLOSE, args, nargs, kwnames);
    PyObject *span = args[0], *exc = args[1], *keeper = nargs > 2 ? args[2] : Py_None;
    if (Py_TYPE(span) != st->raw_type)
        return cm_fallback(st, ST_PY_CLOSE, args, nargs, kwnames);
    PyObject *closed = SLOT(st, span, F_CLOSED);
    if (closed == Py_True)
        Py_RETURN_NONE;
    PyObject *devs = SLOT(st, span, F_DEVS), *device = SLOT(st, span, F_DEVICE);
    PyObject *before = SLOT(st, span, F_BEFORE);
    if (closed != Py_False || devs == NULL || device == NULL || before == NULL ||
        SLOT(st, span, F_SYNC) != Py_False || !PyTuple_CheckExact(devs) ||
        PyTuple_GET_SIZE(devs) != 1 || !PyTuple_CheckExact(before) ||
        PyTuple_GET_SIZE(before) != 1)
        return cm_fallback(st, ST_PY_CLOSE, args, nargs, kwnames);
    long long b[3], a[3];
    if (!cm_triple(PyTuple_GET_ITEM(before, 0), b))
        return cm_fallback(st, ST_PY_CLOSE, args, nargs, kwnames);
    PyObject *backend = cm_backend(st);
    if (backend == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return cm_fallback(st, ST_PY_CLOSE, args, nargs, kwnames);
    }
    Py_INCREF(backend);
    Py_INCREF(span);
    Py_INCREF(devs);
    PyObject *pending = NULL, *result = NULL;
    if (device == Py_None) { /* the devices of entry must still be the settled ones */
        PyObject *settled = PyObject_GetAttr(backend, cm_names[S_SETTLED]);
        if (settled == NULL)
            PyErr_Clear();
        Py_XDECREF(settled);
        if (settled != devs)
            goto python;
    }
    PyObject *end = cm_now_ns(st);
    if (end == NULL)
        goto python_clear;
    cm_put(st, span, F_END_NS, end);
    PyObject *values = cm_read_counters(backend, PyTuple_GET_ITEM(devs, 0), S_FAST_COUNTERS,
                                     S_COUNTERS);
    if (values == NULL)
        goto python_clear; /* the Python close reads again and says why it failed */
    if (!cm_triple(values, a)) {
        Py_DECREF(values);
        goto python;
    }
    PyObject *after = PyTuple_Pack(1, values);
    Py_DECREF(values);
    if (after == NULL)
        goto python_clear;
    cm_set(st, span, F_EXIT_DEVS, devs);
    cm_put(st, span, F_AFTER, after);
    /* As the Python try block: a failure before the hooks skips them. */
    if (close_body(st, span, backend, exc, b, a, devs, hooks) < 0) {
        if (close_failed(st, span) < 0)
            goto out;
    } else if (hooks &&
               cm_call_hooks(st, exc == Py_None ? ST_EXIT_CALLS_OK : ST_EXIT_CALLS, span, exc,
                          &pending) < 0 &&
               close_failed(st, span) < 0) {
        goto out;
    }
    PyObject *extras = SLOT(st, span, F_EXTRAS);
    if (extras != NULL && extras != Py_None) {
        if (keeper != Py_None && PyObject_SetAttr(keeper, cm_names[S_EXTRAS_ATTR], extras) < 0)
            goto out;
        cm_set(st, span, F_EXTRAS, Py_None);
    }
    if (pending != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(pending), pending);
        goto out;
    }
    result = Py_NewRef(Py_None);
    goto out;
python_clear:
    if (!cm_catchable())
        goto out;
    PyErr_Clear();
python:
    result = cm_fallback(st, ST_PY_CLOSE, args, nargs, kwnames);
out:
    Py_XDECREF(pending);
    Py_DECREF(devs);
    Py_DECREF(span);
    Py_DECREF(backend);
    return result;
}


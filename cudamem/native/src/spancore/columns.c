/* ``make`` (track()'s MemorySpan) and ``columns`` (the history's fold of a batch). */
#include "core.h"

/* make(name, sync, peak, leaks): ``track(name, ...)``'s MemorySpan (no device), its fields
 * stored as the Python ``_py_make_span`` stores them. */
PyObject *cm_make(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *cm_columns(PyObject *self, PyObject *spans) {
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


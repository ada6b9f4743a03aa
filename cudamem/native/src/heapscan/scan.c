/* scan: one pass over a heap snapshot (see heapscan.h). */
#include "heapscan.h"

/* Test one object: 1 it refers to a wanted id, 0 not, -1 error. */
static int test_one(PyObject *o, Visit *v) {
    traverseproc trav = Py_TYPE(o)->tp_traverse;
    if (!trav) return 0;
    v->hit = 0;
    trav(o, visit_test, v);
    if (v->error) return -1;
    return v->hit;
}

PyObject *scan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs, *wanted, *added, *on_hit, *at_least_obj, *seconds_obj, *array_obj,
        *on_arrays, *edges_obj = Py_None;
    if (!PyArg_ParseTuple(args, "O!OO!OOOOO|O", &PyList_Type, &objs, &wanted, &PyList_Type,
                          &added, &on_hit, &at_least_obj, &seconds_obj, &array_obj, &on_arrays,
                          &edges_obj))
        return NULL;
    Edges *cache = NULL;
    if (edges_obj != Py_None) {
        cache = (Edges *)PyCapsule_GetPointer(edges_obj, EDGES_NAME);
        if (!cache) return NULL;
        if (!edges_bind(cache, objs)) cache = NULL;
    }
    Py_ssize_t at_least = -1;
    if (at_least_obj != Py_None) {
        at_least = PyLong_AsSsize_t(at_least_obj);
        if (at_least == -1 && PyErr_Occurred()) return NULL;
    }
    double deadline = -1;
    if (seconds_obj != Py_None) {
        double secs = PyFloat_AsDouble(seconds_obj);
        if (secs == -1.0 && PyErr_Occurred()) return NULL;
        deadline = now_s() + secs;
    }
    PyTypeObject *array_type = NULL;
    if (array_obj != Py_None && on_arrays != Py_None) {
        if (!PyType_Check(array_obj)) {
            PyErr_SetString(PyExc_TypeError, "array_type must be a type or None");
            return NULL;
        }
        array_type = (PyTypeObject *)array_obj;
    }
    PtrSet set;
    if (set_init(&set, 1024) < 0) return PyErr_NoMemory();
    if (set_add_ids(&set, wanted) < 0) {
        free(set.slots);
        return NULL;
    }
    if (cache && set_filter(&set) < 0) { /* the recording's reads test the filter first */
        free(set.slots);
        return PyErr_NoMemory();
    }
    Py_ssize_t synced = PyList_GET_SIZE(added);
    Py_INCREF(objs); /* the snapshot stays alive whatever the callbacks do */
    Py_ssize_t n = PyList_GET_SIZE(objs);
    Py_ssize_t n_batches = (n + CHUNK - 1) / CHUNK;
    Py_ssize_t last = -1;
    int finished = 1, whole = 1, failed = 0;
    Visit v = {&set, 0, array_type, NULL, NULL, 0};

    for (Py_ssize_t k = 0; k < n_batches && !failed; k++) {
        if (at_least >= 0 && k >= at_least) {
            whole = 0;
            break;
        }
        if (deadline >= 0 && !(k & 7) && now_s() > deadline) {
            finished = 0;
            whole = 0;
            break;
        }
        Py_ssize_t end = n - k * CHUNK;
        if (end > PyList_GET_SIZE(objs)) end = PyList_GET_SIZE(objs);
        Py_ssize_t start = end - CHUNK > 0 ? end - CHUNK : 0;
        /* In array mode the first traversal of the batch already tested every object:
         * its answers hold until the wanted ids grow (then objects are traversed again). */
        char tested[CHUNK];
        int fresh = 0;
        /* the cache serves this batch when the snapshot kept its length and the batch is
         * recorded, now or by an earlier pass */
        int cached = 0, recorded_now = 0;
        if (cache && PyList_GET_SIZE(objs) == n) {
            if (k < cache->batches) {
                cached = 1;
            } else if (k == cache->batches && edges_record(cache, objs, start, end)) {
                cached = recorded_now = 1;
            }
        }
        if (array_type) {
            /* Arrays first, for the whole batch, as chunked_pass does. */
            v.arrays = PyList_New(0);
            v.containers = PyList_New(0);
            PyObject *edges = PyList_New(0);
            if (!v.arrays || !v.containers || !edges) failed = 1;
            int read = recorded_now; /* the batch's answers come from the cache */
            if (!failed && recorded_now) {
                edges_fresh_arrays(cache, &v, start, end, tested);
                if (v.error) failed = 1;
            } else if (!failed && cached && cache->side_on && cache->side_type == array_type) {
                /* recorded by `walk`, with its arrays: nothing to traverse */
                read = 1;
                if (side_arrays(cache, &v, start, end) < 0) failed = 1;
                for (Py_ssize_t i = start; i < end; i++)
                    tested[i - start] = (char)edges_test(cache, &set, i);
            }
            for (Py_ssize_t i = start; i < end && !failed && !read; i++) {
                PyObject *o = PyList_GET_ITEM(objs, i);
                traverseproc trav = Py_TYPE(o)->tp_traverse;
                v.hit = 0;
                if (trav) trav(o, visit_test, &v);
                if (v.error) failed = 1;
                tested[i - start] = (char)v.hit;
            }
            fresh = 1;
            if (!failed && PyList_GET_SIZE(v.containers) &&
                descend(v.containers, array_type, v.arrays, edges) < 0)
                failed = 1;
            if (!failed && PyList_GET_SIZE(v.arrays)) {
                PyObject *r = PyObject_CallFunctionObjArgs(on_arrays, v.arrays, edges, NULL);
                if (!r) {
                    failed = 1;
                } else {
                    if (PyObject_IsTrue(r) == 1) last = k;
                    Py_DECREF(r);
                }
            }
            Py_XDECREF(v.arrays);
            Py_XDECREF(v.containers);
            Py_XDECREF(edges);
            v.arrays = v.containers = NULL;
            if (failed) break;
            /* the callback may have added ids */
            if (PyList_GET_SIZE(added) != synced) fresh = 0;
            if (sync_added(&set, added, &synced) < 0) {
                failed = 1;
                break;
            }
        }
        if (cached && !fresh && set.bits) {
            /* the whole batch at once, against the ids wanted now (after a callback adds
             * some, the rest of the batch is tested object by object) */
            edges_batch(cache, &set, start, end, tested);
            fresh = 1;
        }
        PyTypeObject *saved = v.array_type;
        v.array_type = NULL; /* the test proper stops at the first wanted referent */
        /* newest first within the batch, as chunked_pass's sub-batches go */
        for (Py_ssize_t i = end - 1; i >= start; i--) {
            if (i >= PyList_GET_SIZE(objs)) continue;
            PyObject *o = PyList_GET_ITEM(objs, i);
            int t = fresh ? tested[i - start]
                    : cached ? edges_test(cache, &set, i)
                             : test_one(o, &v);
            if (t < 0) {
                failed = 1;
                break;
            }
            if (!t) continue;
            Py_INCREF(o);
            PyObject *r = PyObject_CallOneArg(on_hit, o);
            Py_DECREF(o);
            if (!r) {
                failed = 1;
                break;
            }
            int grew = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (grew < 0) {
                failed = 1;
                break;
            }
            if (grew) last = k;
            if (PyList_GET_SIZE(added) != synced) fresh = 0;
            if (sync_added(&set, added, &synced) < 0) {
                failed = 1;
                break;
            }
        }
        v.array_type = saved;
    }
    /* the arrays `walk` kept serve one array-mode pass (a search's first): let them go */
    if (cache && array_type && cache->side_on) side_clear(cache);
    Py_DECREF(objs);
    free(set.slots);
    free(set.bits);
    if (failed) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return NULL;
    }
    return Py_BuildValue("(OnO)", finished ? Py_True : Py_False, last, whole ? Py_True : Py_False);
}

/* What the traversals share: the descent from untracked containers to arrays, the ids a
 * callback added, the clock. */
#include "heapscan.h"

#include <time.h>

typedef struct {
    PyTypeObject *array_type;
    PyObject *children; /* list */
} Kids;

static int visit_collect(PyObject *o, void *arg) {
    Kids *k = (Kids *)arg;
    if (Py_TYPE(o) == k->array_type || is_untracked_container(o))
        return PyList_Append(k->children, o) < 0 ? -1 : 0;
    return 0;
}

/* From untracked containers down to arrays: appends arrays to `arrays` and (container,
 * child) tuples to `edges` for every step on the way; containers met twice are skipped. */
int descend(PyObject *level0, PyTypeObject *array_type, PyObject *arrays,
                   PyObject *edges) {
    PyObject *level = level0;
    Py_INCREF(level);
    PtrSet seen;
    if (set_init(&seen, 64) < 0) {
        Py_DECREF(level);
        PyErr_NoMemory();
        return -1;
    }
    int rc = 0;
    for (int depth = 0; depth < MAX_DEPTH && PyList_GET_SIZE(level) > 0; depth++) {
        PyObject *deeper = PyList_New(0);
        if (!deeper) {
            rc = -1;
            break;
        }
        Py_ssize_t n = PyList_GET_SIZE(level);
        for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
            PyObject *c = PyList_GET_ITEM(level, i);
            if (set_has(&seen, (uintptr_t)c)) continue;
            if (set_add(&seen, (uintptr_t)c) < 0) {
                PyErr_NoMemory();
                rc = -1;
                break;
            }
            Kids k = {array_type, PyList_New(0)};
            if (!k.children) {
                rc = -1;
                break;
            }
            traverseproc trav = Py_TYPE(c)->tp_traverse;
            if (trav && trav(c, visit_collect, &k) < 0) rc = -1;
            Py_ssize_t m = PyList_GET_SIZE(k.children);
            for (Py_ssize_t j = 0; j < m && rc == 0; j++) {
                PyObject *child = PyList_GET_ITEM(k.children, j);
                PyObject *edge = PyTuple_Pack(2, c, child);
                if (!edge || PyList_Append(edges, edge) < 0) rc = -1;
                Py_XDECREF(edge);
                if (rc == 0) {
                    PyObject *into = Py_TYPE(child) == array_type ? arrays : deeper;
                    if (PyList_Append(into, child) < 0) rc = -1;
                }
            }
            Py_DECREF(k.children);
        }
        Py_DECREF(level);
        level = deeper;
        if (rc < 0) break;
    }
    Py_DECREF(level);
    free(seen.slots);
    return rc;
}

/* The ids the caller appended to `added` since `*synced`, into the set. */
int sync_added(PtrSet *set, PyObject *added, Py_ssize_t *synced) {
    Py_ssize_t now = PyList_GET_SIZE(added);
    for (Py_ssize_t j = *synced; j < now; j++) {
        void *p = PyLong_AsVoidPtr(PyList_GET_ITEM(added, j));
        if (p == NULL && PyErr_Occurred()) return -1;
        if (set_add(set, (uintptr_t)p) < 0) {
            PyErr_NoMemory();
            return -1;
        }
    }
    *synced = now;
    return 0;
}

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

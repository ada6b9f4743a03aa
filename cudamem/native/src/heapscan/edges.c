/* The edge cache: every referent address of a snapshot's objects, recorded once for a
 * search's repeated passes (see heapscan.h). */
#include "heapscan.h"

void side_clear(Edges *e) {
    PyObject **objs = e->side_obj;
    size_t n = e->side_len;
    e->side_obj = NULL;
    e->side_len = e->side_cap = 0;
    e->side_on = 0;
    free(e->side_idx);
    e->side_idx = NULL;
    for (size_t i = 0; i < n; i++) Py_DECREF(objs[i]);
    free(objs);
}

static void edges_free(PyObject *capsule) {
    Edges *e = (Edges *)PyCapsule_GetPointer(capsule, EDGES_NAME);
    if (!e) {
        PyErr_Clear();
        return;
    }
    side_clear(e);
    free(e->beg);
    free(e->cnt);
    free(e->edges);
    free(e);
}

/* edges(max_edges) -> a new, empty cache (a capsule) */
PyObject *edges_new(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t max_edges;
    if (!PyArg_ParseTuple(args, "n", &max_edges)) return NULL;
    if (max_edges < 0) {
        PyErr_SetString(PyExc_ValueError, "max_edges must be >= 0");
        return NULL;
    }
    Edges *e = (Edges *)calloc(1, sizeof(Edges));
    if (!e) return PyErr_NoMemory();
    e->max = (size_t)max_edges;
    PyObject *cap = PyCapsule_New(e, EDGES_NAME, edges_free);
    if (!cap) free(e);
    return cap;
}

/* edges_info(capsule) -> (batches recorded, edges recorded, full) */
PyObject *edges_info(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Edges *e = (Edges *)PyCapsule_GetPointer(cap, EDGES_NAME);
    if (!e) return NULL;
    return Py_BuildValue("(nnO)", e->batches, (Py_ssize_t)e->len, e->full ? Py_True : Py_False);
}

/* Bind the cache to `objs` on first use; whether it serves this snapshot. */
int edges_bind(Edges *e, PyObject *objs) {
    Py_ssize_t n = PyList_GET_SIZE(objs);
    if (e->list == NULL) {
        e->beg = (size_t *)malloc((size_t)(n ? n : 1) * sizeof(size_t));
        e->cnt = (uint32_t *)malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
        if (!e->beg || !e->cnt) {
            free(e->beg);
            free(e->cnt);
            e->beg = NULL;
            e->cnt = NULL;
            e->full = 1;
            return 0;
        }
        e->list = objs;
        e->n = n;
        return 1;
    }
    return e->list == objs && e->n == n;
}

/* Record batch [start, end) (the next one); whether it was recorded. Runs no Python code. */
int edges_record(Edges *e, PyObject *objs, Py_ssize_t start, Py_ssize_t end) {
    if (e->full) return 0;
    size_t first = e->len;
    for (Py_ssize_t i = start; i < end; i++) {
        PyObject *o = PyList_GET_ITEM(objs, i);
#if defined(__GNUC__) || defined(__clang__)
        if (i + PREFETCH < end) __builtin_prefetch(PyList_GET_ITEM(objs, i + PREFETCH));
#endif
        traverseproc trav = Py_TYPE(o)->tp_traverse;
        e->beg[i] = e->len;
        if (trav) trav(o, visit_record, e);
        if (e->full || e->len - e->beg[i] > UINT32_MAX) {
            e->full = 1;
            e->len = first; /* a batch is recorded whole or not at all */
            return 0;
        }
        e->cnt[i] = (uint32_t)(e->len - e->beg[i]);
    }
    e->batches++;
    return 1;
}

/* The objects of batch [start, end) whose recorded referents include a wanted address,
 * into `tested`: one sequential read of the batch's recording (contiguous, in index order)
 * that tests each address against the set's filter and, past it, the set. */
void edges_batch(const Edges *e, const PtrSet *wanted, Py_ssize_t start, Py_ssize_t end,
                        char *tested) {
    memset(tested, 0, (size_t)(end - start));
    const uintptr_t *p = e->edges;
    const uint64_t *bits = wanted->bits;
    const size_t hi = e->beg[end - 1] + e->cnt[end - 1];
    Py_ssize_t obj = start;
    for (size_t j = e->beg[start]; j < hi; j++) {
        const size_t b = filter_bit(p[j]);
        if (!((bits[b >> 6] >> (b & 63)) & 1) || !set_has(wanted, p[j])) continue;
        while (e->beg[obj] + e->cnt[obj] <= j) obj++;
        tested[obj - start] = 1;
        j = e->beg[obj] + e->cnt[obj] - 1; /* on to the next object's referents */
    }
}

/* Array mode on a freshly recorded batch: the wanted test and the array search read the
 * recording (its addresses are alive: nothing ran since it was made). */
void edges_fresh_arrays(const Edges *e, Visit *v, Py_ssize_t start, Py_ssize_t end,
                               char *tested) {
    const size_t last = e->len; /* the batch's recording ends the buffer */
    for (Py_ssize_t i = start; i < end && !v->error; i++) {
        v->hit = 0;
        size_t at = e->beg[i];
        for (uint32_t j = 0; j < e->cnt[i] && !v->error; j++, at++) {
#if defined(__GNUC__) || defined(__clang__)
            /* the type check reads each referent's header: ask for the ones ahead early */
            if (at + PREFETCH < last) __builtin_prefetch((const void *)e->edges[at + PREFETCH]);
#endif
            visit_test((PyObject *)e->edges[at], v);
        }
        tested[i - start] = (char)v->hit;
    }
}

/* Array mode on a batch `walk` recorded: the arrays and untracked containers it kept for
 * objects start..end-1, in the order a traversal of the batch meets them. */
int side_arrays(const Edges *e, Visit *v, Py_ssize_t start, Py_ssize_t end) {
    size_t lo = 0, hi = e->side_len;
    while (lo < hi) { /* the first entry at or after `start` */
        size_t mid = lo + (hi - lo) / 2;
        if (e->side_idx[mid] < start) lo = mid + 1;
        else hi = mid;
    }
    for (size_t j = lo; j < e->side_len && e->side_idx[j] < end; j++) {
        PyObject *o = e->side_obj[j];
        if (Py_TYPE(o) == v->array_type) {
            if (PyList_Append(v->arrays, o) < 0) return -1;
        } else if (is_untracked_container(o)) {
            if (PyList_Append(v->containers, o) < 0) return -1;
        }
    }
    return 0;
}

/* Let go of a recording `walk` could not finish: the cache is as new (scans record). */
void edges_reset(Edges *e) {
    side_clear(e);
    free(e->beg);
    free(e->cnt);
    free(e->edges);
    e->beg = NULL;
    e->cnt = NULL;
    e->edges = NULL;
    e->list = NULL;
    e->n = e->batches = 0;
    e->len = e->cap = 0;
    e->full = e->oom = 0;
}

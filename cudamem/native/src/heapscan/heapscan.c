/* cudamem's compiled heap pass: the referrers of many objects at once, in one walk of a
 * heap snapshot (cudamem/_heap.py's chunked_pass, in C).
 *
 * Each snapshot object's tp_traverse is called with a visitor that looks the referent's
 * address up in an open-addressing hash set of wanted addresses: no Python object is made
 * per edge, no Python code runs during a traversal, no user dunder is called. The pass
 * holds the GIL between callbacks; the snapshot list keeps every object it visits alive.
 *
 * scan(objs, wanted, added, on_hit, at_least, seconds, array_type, on_arrays)
 *   objs: the snapshot (oldest first; walked newest first, in batches of CHUNK objects);
 *   wanted: iterable of ids (ints) asked about; added: a list the caller appends the ids it
 *   adds to `wanted` to (read after each callback: the pass then also looks for them);
 *   on_hit(o) -> bool: called for each object referring to a wanted id (True: it added ids);
 *   at_least: batches to scan at most (None: all); seconds: time left (None: no limit);
 *   array_type, on_arrays(found, edges) -> bool: objects of exactly array_type among a
 *   batch's referents, also inside dicts and tuples gc does not track, with the
 *   (container, child) edges to them, handed over before the batch is tested.
 * Returns (finished, last, whole) exactly as chunked_pass does.
 *
 * edges (optional, an `edges()` capsule): an edge cache for repeated passes over the same
 * snapshot (a search's levels). The first pass to reach a batch records every referent
 * address of its objects; later passes test those addresses against the wanted set instead
 * of traversing the objects again (a sequential read of a few addresses per object, where
 * a traversal touches every object and the dicts and lists behind it). Recorded addresses
 * are never dereferenced: only the batch's fresh recording is read for types (arrays),
 * before any callback runs. Bound to the first snapshot it meets (a different list, or
 * one whose length changed, is walked without it); it stops recording past its budget.
 *
 * walk(types, edges, array_type) (Python 3.11 to 3.13): the snapshot itself, read off gc's
 * generation lists in place, with its tensors and its whole edge cache recorded in the same
 * walk (see walk below); the passes over it then traverse nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#ifdef Py_GIL_DISABLED
/* Free-threaded builds: this module relies on the GIL; the build fails and Python serves. */
#error "cudamem's compiled extensions need the GIL"
#endif
#if PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
/* The interpreter's generation lists, read in place: Python 3.11 has no
 * PyUnstable_GC_VisitObjects (gc_instances walks the lists itself, as that function does
 * from 3.12 on), and `walk` lists the heap oldest generation first, which that function
 * cannot say (it gives no generation boundaries). 3.14 reorganised the generations: there
 * the module has no `walk` and the Python listing serves. */
#undef _PyGC_FINALIZED
#define Py_BUILD_CORE 1
#include "internal/pycore_gc.h"
#include "internal/pycore_interp.h"
#undef Py_BUILD_CORE
#if NUM_GENERATIONS == 3
#define CUDAMEM_HAVE_WALK 1
#endif
#endif
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(CUDAMEM_HAVE_WALK) && !defined(_WIN32)
/* walk's array keeps on a second thread, beside the walk (see side_run) */
#define CUDAMEM_SIDE_THREAD 1
#include <pthread.h>
#include <signal.h>
#include <unistd.h>
#ifdef __linux__
#include <sched.h>
#endif
#endif

#define CHUNK 1024
#define MAX_DEPTH 64
#define PREFETCH 16
#define SIDE_PREFETCH 48 /* the array keeps' referents: read further ahead */

typedef struct {
    uintptr_t *slots;
    size_t mask;
    size_t used;
    /* optional (set_filter): one bit per 16 address bits, set for every member, so that a
     * test of an address that is not a member usually reads one word of 8 KiB */
    uint64_t *bits;
} PtrSet;

#define FILTER_WORDS 1024

static inline size_t filter_bit(uintptr_t p) { return (size_t)((p >> 4) ^ (p >> 20)) & 0xFFFF; }

static size_t mix(uintptr_t p) {
    uint64_t x = (uint64_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

static int set_init(PtrSet *s, size_t hint) {
    size_t n = 64;
    while (n < hint * 2 + 2) n <<= 1;
    s->slots = (uintptr_t *)calloc(n, sizeof(uintptr_t));
    if (!s->slots) return -1;
    s->mask = n - 1;
    s->used = 0;
    s->bits = NULL;
    return 0;
}

static int set_has(const PtrSet *s, uintptr_t p) {
    size_t i = mix(p) & s->mask;
    for (;;) {
        uintptr_t v = s->slots[i];
        if (v == p) return 1;
        if (v == 0) return 0;
        i = (i + 1) & s->mask;
    }
}

static int set_add(PtrSet *s, uintptr_t p);

static int set_grow(PtrSet *s) {
    PtrSet bigger;
    size_t old = s->mask + 1;
    if (set_init(&bigger, old) < 0) return -1;
    for (size_t i = 0; i < old; i++)
        if (s->slots[i]) set_add(&bigger, s->slots[i]);
    free(s->slots);
    bigger.bits = s->bits;
    *s = bigger;
    return 0;
}

static int set_add(PtrSet *s, uintptr_t p) {
    if (p == 0) return 0;
    if ((s->used + 1) * 2 > s->mask + 1 && set_grow(s) < 0) return -1;
    size_t i = mix(p) & s->mask;
    for (;;) {
        uintptr_t v = s->slots[i];
        if (v == p) return 0;
        if (v == 0) {
            s->slots[i] = p;
            s->used++;
            if (s->bits) {
                size_t b = filter_bit(p);
                s->bits[b >> 6] |= (uint64_t)1 << (b & 63);
            }
            return 0;
        }
        i = (i + 1) & s->mask;
    }
}

/* Give the set its filter, from its members; -1 without memory. */
static int set_filter(PtrSet *s) {
    s->bits = (uint64_t *)calloc(FILTER_WORDS, sizeof(uint64_t));
    if (!s->bits) return -1;
    for (size_t i = 0; i <= s->mask; i++) {
        if (!s->slots[i]) continue;
        size_t b = filter_bit(s->slots[i]);
        s->bits[b >> 6] |= (uint64_t)1 << (b & 63);
    }
    return 0;
}

/* ids (ints) from an iterable into the set */
static int set_add_ids(PtrSet *s, PyObject *iterable) {
    PyObject *it = PyObject_GetIter(iterable);
    if (!it) return -1;
    PyObject *item;
    while ((item = PyIter_Next(it))) {
        void *p = PyLong_AsVoidPtr(item);
        Py_DECREF(item);
        if (p == NULL && PyErr_Occurred()) {
            Py_DECREF(it);
            return -1;
        }
        if (set_add(s, (uintptr_t)p) < 0) {
            Py_DECREF(it);
            PyErr_NoMemory();
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

typedef struct {
    const PtrSet *wanted;
    int hit;
    PyTypeObject *array_type; /* NULL: no array search */
    PyObject *arrays;         /* list of arrays found (borrowed container) */
    PyObject *containers;     /* untracked dicts/tuples met at the top level */
    int error;
} Visit;

/* Whether the exact dict or tuple `o` is tracked by gc: its gc header, read in place where
 * the internal headers are included (a call per referent otherwise). */
static inline int container_tracked(PyObject *o) {
#ifdef CUDAMEM_HAVE_WALK
    return _PyObject_GC_IS_TRACKED(o);
#else
    return PyObject_GC_IsTracked(o);
#endif
}

static inline int is_untracked_container(PyObject *o) {
    PyTypeObject *tp = Py_TYPE(o);
    if (tp == &PyDict_Type) return PyDict_GET_SIZE(o) > 0 && !container_tracked(o);
    if (tp == &PyTuple_Type) return PyTuple_GET_SIZE(o) > 0 && !container_tracked(o);
    return 0;
}

/* The visitor: only pointer compares and type checks. */
static int visit_test(PyObject *o, void *arg) {
    Visit *v = (Visit *)arg;
    if (set_has(v->wanted, (uintptr_t)o)) {
        v->hit = 1;
        if (!v->array_type) return 1; /* one is enough: stop this traversal */
    }
    if (v->array_type && !v->error) {
        if (Py_TYPE(o) == v->array_type) {
            if (PyList_Append(v->arrays, o) < 0) v->error = 1;
        } else if (is_untracked_container(o)) {
            if (PyList_Append(v->containers, o) < 0) v->error = 1;
        }
    }
    return 0;
}

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
static int descend(PyObject *level0, PyTypeObject *array_type, PyObject *arrays,
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
static int sync_added(PtrSet *set, PyObject *added, Py_ssize_t *synced) {
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

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Test one object: 1 it refers to a wanted id, 0 not, -1 error. */
static int test_one(PyObject *o, Visit *v) {
    traverseproc trav = Py_TYPE(o)->tp_traverse;
    if (!trav) return 0;
    v->hit = 0;
    trav(o, visit_test, v);
    if (v->error) return -1;
    return v->hit;
}


/* -- the edge cache ------------------------------------------------------------------ */

#define EDGES_NAME "cudamem.heapscan.edges"

typedef struct {
    PyObject *list;       /* the snapshot it is bound to: identity only, no reference */
    Py_ssize_t n;         /* its length when bound */
    Py_ssize_t batches;   /* batches recorded, from batch 0 (the newest objects) */
    size_t *beg;          /* per snapshot index: first edge */
    uint32_t *cnt;        /* per snapshot index: number of edges */
    uintptr_t *edges;
    size_t len, cap, max; /* max: most edges it records */
    int full;             /* over budget: records no more */
    int oom;
    /* `walk` in array mode: per snapshot index (ascending), the referents of the array type
     * and the non-empty untracked dicts and tuples, with a strong reference each, for the
     * first array-mode scan; released by it (or with the cache). side_on: recorded. */
    Py_ssize_t *side_idx;
    PyObject **side_obj;
    size_t side_len, side_cap;
    int side_on;
    PyTypeObject *side_type; /* the array type it was recorded for (identity only) */
} Edges;

static void side_clear(Edges *e) {
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
static PyObject *edges_new(PyObject *self, PyObject *args) {
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
static PyObject *edges_info(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Edges *e = (Edges *)PyCapsule_GetPointer(cap, EDGES_NAME);
    if (!e) return NULL;
    return Py_BuildValue("(nnO)", e->batches, (Py_ssize_t)e->len, e->full ? Py_True : Py_False);
}

static int visit_record(PyObject *o, void *arg) {
    Edges *e = (Edges *)arg;
    if (e->len == e->cap) {
        if (e->cap >= e->max) {
            e->full = 1;
            return 1; /* stop: the batch is dropped */
        }
        size_t cap = e->cap ? e->cap * 2 : (size_t)1 << 16;
        if (cap > e->max) cap = e->max;
        uintptr_t *grown = (uintptr_t *)realloc(e->edges, cap * sizeof(uintptr_t));
        if (!grown) {
            e->oom = 1;
            e->full = 1;
            return 1;
        }
        e->edges = grown;
        e->cap = cap;
    }
    e->edges[e->len++] = (uintptr_t)o;
    return 0;
}

/* Bind the cache to `objs` on first use; whether it serves this snapshot. */
static int edges_bind(Edges *e, PyObject *objs) {
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
static int edges_record(Edges *e, PyObject *objs, Py_ssize_t start, Py_ssize_t end) {
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

/* Whether object i's recorded referents include a wanted address. */
static int edges_test(const Edges *e, const PtrSet *wanted, Py_ssize_t i) {
    const uintptr_t *p = e->edges + e->beg[i];
    const uint64_t *bits = wanted->bits;
    for (uint32_t j = 0; j < e->cnt[i]; j++) {
        if (bits) {
            size_t b = filter_bit(p[j]);
            if (!((bits[b >> 6] >> (b & 63)) & 1)) continue;
        }
        if (set_has(wanted, p[j])) return 1;
    }
    return 0;
}

/* The objects of batch [start, end) whose recorded referents include a wanted address,
 * into `tested`: one sequential read of the batch's recording (contiguous, in index order)
 * that tests each address against the set's filter and, past it, the set. */
static void edges_batch(const Edges *e, const PtrSet *wanted, Py_ssize_t start, Py_ssize_t end,
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
static void edges_fresh_arrays(const Edges *e, Visit *v, Py_ssize_t start, Py_ssize_t end,
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
static int side_arrays(const Edges *e, Visit *v, Py_ssize_t start, Py_ssize_t end) {
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

static PyObject *scan(PyObject *self, PyObject *args) {
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

/* The addresses of the types in the tuple `types`, as a set (-1 with an exception set). */
static int type_set(PyObject *types, PtrSet *set) {
    if (set_init(set, (size_t)PyTuple_GET_SIZE(types)) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
        PyObject *tp = PyTuple_GET_ITEM(types, i);
        if (!PyType_Check(tp)) {
            free(set->slots);
            PyErr_SetString(PyExc_TypeError, "types must hold types only");
            return -1;
        }
        if (set_add(set, (uintptr_t)tp) < 0) {
            free(set->slots);
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* instances(objs, types[, start, end]) -> the objects of objs[start:end] whose exact type is
 * one of the tuple `types`, in order. Reads only each object's type pointer. */
static PyObject *instances(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs, *types;
    Py_ssize_t start = 0, end = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTuple(args, "O!O!|nn", &PyList_Type, &objs, &PyTuple_Type, &types, &start,
                          &end))
        return NULL;
    if (start < 0 || end < start) {
        PyErr_SetString(PyExc_ValueError, "instances: need 0 <= start <= end");
        return NULL;
    }
    PtrSet set;
    if (type_set(types, &set) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) {
        free(set.slots);
        return NULL;
    }
    Py_INCREF(objs);
    for (Py_ssize_t i = start; i < end && i < PyList_GET_SIZE(objs); i++) {
        PyObject *o = PyList_GET_ITEM(objs, i);
        if (set_has(&set, (uintptr_t)Py_TYPE(o)) && PyList_Append(out, o) < 0) {
            Py_CLEAR(out);
            break;
        }
    }
    Py_DECREF(objs);
    free(set.slots);
    return out;
}

/* Calls cb(object, arg) for every gc-tracked object, in gc.get_objects()'s order (youngest
 * generation first, each generation in list order), until cb returns 0. gc does not run
 * meanwhile; cb must neither create nor free gc-tracked objects. */
static void visit_gc(int (*cb)(PyObject *, void *), void *arg) {
#if PY_VERSION_HEX >= 0x030C0000
    PyUnstable_GC_VisitObjects(cb, arg);
#else
    struct _gc_runtime_state *gc = &PyInterpreterState_Get()->gc;
    int enabled = gc->enabled;
    gc->enabled = 0;
    for (int i = 0; i < NUM_GENERATIONS; i++) {
        PyGC_Head *head = &gc->generations[i].head;
        for (PyGC_Head *g = (PyGC_Head *)head->_gc_next; g != head;
             g = (PyGC_Head *)g->_gc_next) {
            if (!cb((PyObject *)(g + 1), arg)) goto done;
        }
    }
done:
    gc->enabled = enabled;
#endif
}

typedef struct {
    const PtrSet *types;
    PyObject *out;
    int failed;
} TypeVisit;

static int collect_instance(PyObject *op, void *arg) {
    TypeVisit *v = (TypeVisit *)arg;
    if (set_has(v->types, (uintptr_t)Py_TYPE(op)) && PyList_Append(v->out, op) < 0) {
        v->failed = 1;
        return 0;
    }
    return 1;
}

/* gc_instances(types) -> the gc-tracked objects whose exact type is in the tuple `types`, in
 * gc.get_objects()'s order: instances(gc.get_objects(), types) without listing the heap
 * (reads each object's type pointer in place; appending to the result list allocates no
 * gc-tracked object). */
static PyObject *gc_instances(PyObject *self, PyObject *types) {
    (void)self;
    if (!PyTuple_Check(types)) {
        PyErr_SetString(PyExc_TypeError, "gc_instances: types must be a tuple of types");
        return NULL;
    }
    PtrSet set;
    if (type_set(types, &set) < 0) return NULL;
    TypeVisit v = {&set, PyList_New(0), 0};
    if (v.out != NULL) {
        visit_gc(collect_instance, &v);
        if (v.failed) Py_CLEAR(v.out);
    }
    free(set.slots);
    return v.out;
}

#ifdef CUDAMEM_HAVE_WALK
/* -- walk: the snapshot, its tensors and its edge cache in one walk of gc's lists ---- */

typedef struct {
    Edges *e;
    PyTypeObject *array_type; /* NULL: no arrays kept */
    int side_failed;
    PtrSet dead; /* untracked containers that lead to no array (they stay alive: no code runs) */
} Rec;

typedef struct {
    Rec *r;
    int depth;
    int found; /* an array below */
    int cut;   /* MAX_DEPTH stopped the look: not known to be dead */
} Look;

static int look_below(PyObject *c, Rec *r, int depth, int *cut);

static int visit_look(PyObject *o, void *arg) {
    Look *l = (Look *)arg;
    if (Py_TYPE(o) == l->r->array_type) {
        l->found = 1;
        return 1;
    }
    if (is_untracked_container(o)) {
        if (l->depth + 1 >= MAX_DEPTH) {
            l->cut = 1;
        } else if (look_below(o, l->r, l->depth + 1, &l->cut)) {
            l->found = 1;
            return 1;
        }
    }
    return 0;
}

/* Whether an array of the array type lies inside the untracked container `c` (at depth
 * `depth` of descend's levels), through untracked dicts and tuples only: what descend
 * would find below it. Containers below which there is none are remembered. */
static int look_below(PyObject *c, Rec *r, int depth, int *cut) {
    if (set_has(&r->dead, (uintptr_t)c)) return 0;
#if defined(__GNUC__) || defined(__clang__)
    /* the items' headers, all at once: the checks below then wait for one of them */
    if (PyTuple_CheckExact(c)) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(c); k++)
            __builtin_prefetch((const void *)PyTuple_GET_ITEM(c, k));
    }
#endif
    traverseproc trav = Py_TYPE(c)->tp_traverse;
    Look l = {r, depth, 0, 0};
    if (trav) trav(c, visit_look, &l);
    if (l.cut) *cut = 1;
    else if (!l.found && set_add(&r->dead, (uintptr_t)c) < 0) r->side_failed = 1;
    return l.found;
}

/* Keep `o` for object `idx`, without a reference yet: the keeps may be made on the side
 * thread, which must not touch a reference count; the walk takes them all once it is the
 * only thread left (walk, step 2). */
static int side_add(Edges *e, Py_ssize_t idx, PyObject *o) {
    if (e->side_len == e->side_cap) {
        size_t cap = e->side_cap ? e->side_cap * 2 : 1024;
        Py_ssize_t *ni = (Py_ssize_t *)realloc(e->side_idx, cap * sizeof(Py_ssize_t));
        if (!ni) return -1;
        e->side_idx = ni;
        PyObject **no = (PyObject **)realloc(e->side_obj, cap * sizeof(PyObject *));
        if (!no) return -1;
        e->side_obj = no;
        e->side_cap = cap;
    }
    e->side_idx[e->side_len] = idx;
    e->side_obj[e->side_len++] = o;
    return 0;
}

/* In array mode, whether to keep a recorded referent: an array, or a non-empty untracked
 * dict or tuple that may lead to one. Pointer compares and type checks. */
static int side_keep(PyObject *o, Rec *r) {
    if (Py_TYPE(o) == r->array_type) return 1;
    if (!is_untracked_container(o)) return 0;
    int cut = 0;
    /* kept unless nothing below it is an array: descend would find nothing there */
    return look_below(o, r, 0, &cut) || cut;
}

/* The last walk's sizes: the next one allocates about that much up front, where growing
 * by doubling copied the recording and the listing several times. A hint only. */
static Py_ssize_t last_objects = 0;
static size_t last_edges = 0;
static size_t last_dead = 0; /* array mode: containers with no array below */

/* The array-mode keeps of objects [from, to), object by object in snapshot order, each
 * object's referents in its traversal's order: a sequential read of their recording that
 * asks for the referents' headers ahead of use. Reads only (pointer compares, type checks,
 * the traversal of untracked dicts and tuples) and writes only `r`'s own memory, so it may
 * run on the side thread while the walk records further on: every recorded address is alive
 * (the snapshot holds its objects, they hold their referents, and no Python code runs). */
static void side_range(Rec *r, Py_ssize_t from, Py_ssize_t to) {
    Edges *e = r->e;
    if (from >= to) return;
    const size_t limit = e->beg[to - 1] + e->cnt[to - 1]; /* this range's last edge, + 1 */
    for (Py_ssize_t i = from; i < to && !r->side_failed; i++) {
        const size_t end = e->beg[i] + e->cnt[i];
        for (size_t at = e->beg[i]; at < end && !r->side_failed; at++) {
#if defined(__GNUC__) || defined(__clang__)
            if (at + SIDE_PREFETCH < limit)
                __builtin_prefetch((const void *)e->edges[at + SIDE_PREFETCH]);
#endif
            PyObject *o = (PyObject *)e->edges[at];
            if (side_keep(o, r) && side_add(e, i, o) < 0) r->side_failed = 1;
        }
    }
}

#ifdef CUDAMEM_SIDE_THREAD
/* The side thread: side_range over the objects the walk has recorded so far, while the walk
 * goes on (the walk waits on memory for gc's next list entry; this thread waits on memory
 * for the referents' headers: on two cores the waits overlap). The walk publishes its
 * progress every SIDE_STEP objects; the thread works in steps of at most that many, so a
 * halt is answered soon. The recording's arrays are never moved while the thread runs: the
 * walk halts it (side_join) before it grows one, and does the rest itself. The thread holds
 * no thread state, runs no Python code and touches no reference count; every signal is
 * blocked in it. */
#define SIDE_STEP 1024

/* side_thread(mode), for the side thread and the chaser (below): 1 on where there are CPUs
 * for them, 0 off, 2 in lockstep (tests: the walk waits at each publication until the side
 * thread has caught up, so its share is known: every published object; the chaser reads
 * all of gc's lists before the walk starts) */
static int side_mode = 1;
static Py_ssize_t last_side_objects = 0; /* the last walk: keeps made on the side thread */

typedef struct {
    Rec *r;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t more, caught;
    Py_ssize_t published; /* objects recorded */
    int done, stop;       /* the walk's requests */
    Py_ssize_t next;      /* objects whose keeps the thread has made */
    int exited;           /* the thread's loop has ended */
    int running;          /* the walk's own: started and not joined */
} Side;

static void *side_run(void *arg) {
    Side *s = (Side *)arg;
    for (;;) {
        pthread_mutex_lock(&s->lock);
        while (s->published <= s->next && !s->done && !s->stop)
            pthread_cond_wait(&s->more, &s->lock);
        Py_ssize_t pub = s->published;
        int stop = s->stop;
        pthread_mutex_unlock(&s->lock);
        if (stop || s->next >= pub) break;
        Py_ssize_t to = pub - s->next > SIDE_STEP ? s->next + SIDE_STEP : pub;
        side_range(s->r, s->next, to);
        pthread_mutex_lock(&s->lock);
        s->next = to;
        pthread_cond_signal(&s->caught);
        pthread_mutex_unlock(&s->lock);
        if (s->r->side_failed) break;
    }
    pthread_mutex_lock(&s->lock);
    s->exited = 1;
    pthread_cond_signal(&s->caught);
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

static int cpus_usable(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* Whether side_mode lets a helper thread start where it would be the `nth` thread of the
 * walk and `cpus` CPUs are usable (mode 2 starts it regardless). */
static int helper_allowed(int nth, int cpus) {
    return side_mode == 2 || (side_mode == 1 && cpus >= nth);
}

/* Start a helper thread with every signal blocked in it (the mask is inherited); whether
 * it started. */
static int spawn(pthread_t *thread, void *(*run)(void *), void *arg) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(thread, NULL, run, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc == 0;
}

/* Start the side thread for `r` where `cpus` CPUs are usable; else the walk makes the
 * keeps (s->running stays 0). */
static void side_start(Side *s, Rec *r, int cpus) {
    memset(s, 0, sizeof(*s));
    s->r = r;
    if (!helper_allowed(2, cpus) || pthread_mutex_init(&s->lock, NULL) != 0) return;
    int more = pthread_cond_init(&s->more, NULL) == 0;
    int caught = more && pthread_cond_init(&s->caught, NULL) == 0;
    s->running = caught && spawn(&s->thread, side_run, s);
    if (s->running) return;
    if (caught) pthread_cond_destroy(&s->caught);
    if (more) pthread_cond_destroy(&s->more);
    pthread_mutex_destroy(&s->lock);
}

static void side_publish(Side *s, Py_ssize_t recorded) {
    pthread_mutex_lock(&s->lock);
    s->published = recorded;
    pthread_cond_signal(&s->more);
    if (side_mode == 2)
        while (s->next < recorded && !s->exited) pthread_cond_wait(&s->caught, &s->lock);
    pthread_mutex_unlock(&s->lock);
}

/* Join the thread: `finish` (the walk recorded `recorded` objects in all) lets it work to
 * the end; otherwise it stops after its current step. Its progress is then s->next. */
static void side_join(Side *s, int finish, Py_ssize_t recorded) {
    if (!s->running) return;
    pthread_mutex_lock(&s->lock);
    if (finish) s->published = recorded;
    s->done = 1;
    s->stop = !finish;
    pthread_cond_signal(&s->more);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->caught);
    pthread_cond_destroy(&s->more);
    pthread_mutex_destroy(&s->lock);
    s->running = 0;
}

/* The walk's visitor while the side thread may run: a full buffer is grown only after the
 * thread is halted (it reads the buffer). */
typedef struct {
    Edges *e;
    Side *side;
} WalkVisit;

static int visit_walk(PyObject *o, void *arg) {
    WalkVisit *w = (WalkVisit *)arg;
    if (w->e->len == w->e->cap) side_join(w->side, 0, 0);
    return visit_record(o, w->e);
}

/* Without array keeps the second CPU would idle: a chaser thread follows gc's lists ahead
 * of the walk (at most CHASE_AHEAD entries), so that the walk finds each next entry in the
 * shared cache instead of waiting on memory for it. It only reads the lists' links, which
 * nothing changes during the walk (no gc-tracked object is made or freed, no code runs). */
#define CHASE_AHEAD 8192

typedef struct {
    struct _gc_runtime_state *gc;
    pthread_t thread;
    Py_ssize_t walked; /* the walk's progress, published every 256 entries (atomic) */
    int stop;          /* atomic */
    int free;          /* lockstep (side_mode 2): reads every entry, then the walk starts */
    Py_ssize_t read;   /* entries it read: the walk's once it is joined */
    int running;
} Chase;

static Py_ssize_t last_chased = 0; /* the last walk: entries the chaser read */

static void *chase_run(void *arg) {
    Chase *c = (Chase *)arg;
    Py_ssize_t at = 0;
    uintptr_t sink = 0;
    for (int gen = NUM_GENERATIONS - 1; gen >= 0; gen--) {
        PyGC_Head *head = &c->gc->generations[gen].head;
        for (PyGC_Head *g = (PyGC_Head *)head->_gc_next; g != head;
             g = (PyGC_Head *)g->_gc_next) {
            sink += (uintptr_t)Py_TYPE((PyObject *)(g + 1)); /* the header's line too */
            if ((++at & 255) != 0 || c->free) continue;
            while (at - __atomic_load_n(&c->walked, __ATOMIC_RELAXED) > CHASE_AHEAD) {
                if (__atomic_load_n(&c->stop, __ATOMIC_RELAXED)) goto out;
                sched_yield();
            }
            if (__atomic_load_n(&c->stop, __ATOMIC_RELAXED)) goto out;
        }
    }
out:
    c->read = at;
    return (void *)sink;
}

/* Start the chaser as the walk's `nth` thread where `cpus` CPUs are usable (it needs one
 * of its own). */
static void chase_start(Chase *c, struct _gc_runtime_state *gc, int nth, int cpus) {
    memset(c, 0, sizeof(*c));
    c->gc = gc;
    c->free = side_mode == 2;
    if (!helper_allowed(nth, cpus)) return;
    c->running = spawn(&c->thread, chase_run, c);
    if (c->running && c->free) { /* lockstep: its whole read first, then the walk */
        pthread_join(c->thread, NULL);
        c->running = 0;
        last_chased = c->read;
    }
}

static void chase_join(Chase *c) {
    if (!c->running) return;
    __atomic_store_n(&c->stop, 1, __ATOMIC_RELAXED);
    pthread_join(c->thread, NULL);
    c->running = 0;
    last_chased = c->read;
}

/* side_thread(mode) -> the previous mode (see side_mode) */
static PyObject *side_thread(PyObject *self, PyObject *arg) {
    (void)self;
    long mode = PyLong_AsLong(arg);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    if (mode < 0 || mode > 2) {
        PyErr_SetString(PyExc_ValueError, "side_thread: mode must be 0, 1 or 2");
        return NULL;
    }
    int was = side_mode;
    side_mode = (int)mode;
    return PyLong_FromLong(was);
}
#endif

#ifdef CUDAMEM_HAVE_WALK
/* walk_stats() -> (objects, edges, side, chased) of the last walk: what it listed and
 * recorded, the objects whose array keeps the side thread made, and the entries of gc's
 * lists the chaser read */
static PyObject *walk_stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef CUDAMEM_SIDE_THREAD
    Py_ssize_t side = last_side_objects, chased = last_chased;
#else
    Py_ssize_t side = 0, chased = 0;
#endif
    return Py_BuildValue("(nnnn)", last_objects, (Py_ssize_t)last_edges, side, chased);
}
#endif

/* Let go of a recording `walk` could not finish: the cache is as new (scans record). */
static void edges_reset(Edges *e) {
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

static size_t with_slack(size_t n) { return n + n / 8 + 4096; }

/* Append `o` to the list `out` (a reference for it); its items are allocated ahead. */
static inline int list_push(PyObject *out, PyObject *o) {
    PyListObject *l = (PyListObject *)out;
    Py_ssize_t size = Py_SIZE(l);
    if (size < l->allocated) {
        Py_INCREF(o);
        l->ob_item[size] = o;
        Py_SET_SIZE(l, size + 1);
        return 0;
    }
    return PyList_Append(out, o);
}

/* walk(types, edges, array_type) -> (objs, (n2, n1, n0), found)
 *
 * objs: every gc-tracked object, oldest first: generation 2, then 1, then 0, each in its
 * list's order (what _heap.snapshot lists with three gc.get_objects calls), read off gc's
 * lists in place; (n2, n1, n0): the generations' sizes in it; found: the objects whose exact
 * type is in the tuple `types`, in gc.get_objects()'s order (generation 0 first).
 * edges: an unused edge cache, or None. The walk records every object's referent addresses
 * into it as it goes (the object is in cache then: one walk instead of a listing and a
 * traversal), bound to objs with every batch recorded; over its budget it is left unused
 * (scans record as before). array_type (a type, or None): the cache also keeps, with a
 * reference each, the referents of exactly that type and the non-empty untracked dicts and
 * tuples, which the first array-mode scan reads instead of traversing (and then releases);
 * they are read off the recording (side_range), whose sequential order lets the referents'
 * headers be asked for ahead, where a check during the walk waited for each: on a second
 * thread while the walk goes on where there are two CPUs (side_run), else after it. Where
 * a CPU is left over, a chaser thread reads gc's lists ahead of the walk (chase_run).
 *
 * No Python code runs and no gc-tracked object is made during the walk (appending to a list
 * reallocates its item array only); gc is off meanwhile and as it was afterwards. */
static PyObject *walk(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *types, *edges_obj, *array_obj;
    if (!PyArg_ParseTuple(args, "O!OO", &PyTuple_Type, &types, &edges_obj, &array_obj))
        return NULL;
    Edges *e = NULL;
    if (edges_obj != Py_None) {
        e = (Edges *)PyCapsule_GetPointer(edges_obj, EDGES_NAME);
        if (!e) return NULL;
        if (e->list != NULL || e->len != 0 || e->beg != NULL || e->side_on) {
            PyErr_SetString(PyExc_ValueError, "walk: the edge cache is in use already");
            return NULL;
        }
    }
    PyTypeObject *array_type = NULL;
    if (array_obj != Py_None) {
        if (!PyType_Check(array_obj)) {
            PyErr_SetString(PyExc_TypeError, "walk: array_type must be a type or None");
            return NULL;
        }
        array_type = (PyTypeObject *)array_obj;
    }
    PtrSet tset;
    if (type_set(types, &tset) < 0) return NULL;
    /* the listing, with room for about the last walk's objects (size 0: nothing to visit) */
    PyObject *out = last_objects ? PyList_New((Py_ssize_t)with_slack((size_t)last_objects))
                                 : PyList_New(0);
    if (out) Py_SET_SIZE(out, 0);
    PyObject *found[NUM_GENERATIONS] = {NULL};
    int failed = out == NULL;
    for (int i = 0; i < NUM_GENERATIONS && !failed; i++)
        if (!(found[i] = PyList_New(0))) failed = 1;
    Py_ssize_t sizes[NUM_GENERATIONS] = {0};
    Rec rec = {e, e ? array_type : NULL, 0, {NULL, 0, 0, NULL}};
    if (!failed && rec.array_type && set_init(&rec.dead, last_dead ? with_slack(last_dead) : 4096) < 0) failed = 1;
    int recording = e != NULL && !failed;
    if (recording && array_type) {
        e->side_on = 1;
        e->side_type = array_type;
    }
    struct _gc_runtime_state *gc = &PyInterpreterState_Get()->gc;
    int enabled = gc->enabled;
    gc->enabled = 0;
    size_t room = 0; /* entries allocated in e->beg and e->cnt */
#ifdef CUDAMEM_SIDE_THREAD
    Side side;
    memset(&side, 0, sizeof(side));
    WalkVisit wv = {e, &side};
#endif
    if (recording && last_objects) {
        size_t want = with_slack((size_t)last_objects);
        e->beg = (size_t *)malloc(want * sizeof(size_t));
        e->cnt = (uint32_t *)malloc(want * sizeof(uint32_t));
        if (e->beg && e->cnt) room = want; /* else: grown below, as without a hint */
        size_t edges = with_slack(last_edges);
        if (edges > e->max) edges = e->max;
        if (edges > 0 && (e->edges = (uintptr_t *)malloc(edges * sizeof(uintptr_t))))
            e->cap = edges;
    }
#ifdef CUDAMEM_SIDE_THREAD
    Chase chase;
    memset(&chase, 0, sizeof(chase));
    last_chased = 0;
    int cpus = side_mode == 1 ? cpus_usable() : 0; /* asked once a walk */
    if (recording && rec.array_type) side_start(&side, &rec, cpus);
    /* the chaser needs a CPU of its own: a third one beside the side thread */
    chase_start(&chase, gc, side.running ? 3 : 2, cpus);
#endif
    /* 1. The listing and the recording, object by object along gc's lists (the traversal
     * of one object overlaps the wait for the next one's header); in array mode, the keeps
     * of the objects recorded so far on the side thread, where there is one. */
    for (int gen = NUM_GENERATIONS - 1; gen >= 0 && !failed; gen--) {
        Py_ssize_t before = PyList_GET_SIZE(out);
        PyGC_Head *head = &gc->generations[gen].head;
        for (PyGC_Head *g = (PyGC_Head *)head->_gc_next; g != head;
             g = (PyGC_Head *)g->_gc_next) {
#if defined(__GNUC__) || defined(__clang__)
            __builtin_prefetch((const void *)g->_gc_next);
#endif
            PyObject *o = (PyObject *)(g + 1);
            if (o == out || o == found[0] || o == found[1] || o == found[2]) continue;
            Py_ssize_t i = PyList_GET_SIZE(out);
            if (list_push(out, o) < 0 ||
                (set_has(&tset, (uintptr_t)Py_TYPE(o)) && PyList_Append(found[gen], o) < 0)) {
                failed = 1;
                break;
            }
#ifdef CUDAMEM_SIDE_THREAD
            if (chase.running && (i & 255) == 0)
                __atomic_store_n(&chase.walked, i, __ATOMIC_RELAXED);
#endif
            if (!recording) continue;
            if ((size_t)i >= room) {
#ifdef CUDAMEM_SIDE_THREAD
                side_join(&side, 0, 0); /* it reads e->beg and e->cnt */
#endif
                size_t more = room ? room * 2 : (size_t)1 << 16;
                size_t *beg = (size_t *)realloc(e->beg, more * sizeof(size_t));
                if (beg) e->beg = beg;
                uint32_t *cnt = beg ? (uint32_t *)realloc(e->cnt, more * sizeof(uint32_t)) : NULL;
                if (cnt) e->cnt = cnt;
                if (!beg || !cnt) {
                    recording = 0;
                    continue;
                }
                room = more;
            }
            traverseproc trav = Py_TYPE(o)->tp_traverse;
            e->beg[i] = e->len;
#ifdef CUDAMEM_SIDE_THREAD
            if (trav) {
                if (side.running) trav(o, visit_walk, &wv);
                else trav(o, visit_record, e);
            }
#else
            if (trav) trav(o, visit_record, e);
#endif
            if (e->full || e->len - e->beg[i] > UINT32_MAX) {
                recording = 0;
                continue;
            }
            e->cnt[i] = (uint32_t)(e->len - e->beg[i]);
#ifdef CUDAMEM_SIDE_THREAD
            if (side.running && ((i + 1) % SIDE_STEP) == 0) side_publish(&side, i + 1);
#endif
        }
        sizes[gen] = PyList_GET_SIZE(out) - before;
    }
    Py_ssize_t n = failed ? 0 : PyList_GET_SIZE(out);
    if (!failed) {
        last_objects = n;
        if (recording) last_edges = e->len;
    }
    /* 2. Array mode: the keeps the side thread has not made, then a reference to each
     * (the walk is the only thread again). */
    Py_ssize_t kept_to = 0;
#ifdef CUDAMEM_SIDE_THREAD
    chase_join(&chase);
    side_join(&side, recording && !failed, n);
    kept_to = side.next;
    last_side_objects = kept_to;
#endif
    if (rec.array_type) { /* (set only with a cache) */
        if (recording && !failed) {
            side_range(&rec, kept_to, n);
            last_dead = rec.dead.used;
            if (rec.side_failed) recording = 0;
        }
        if (recording && !failed) {
            for (size_t k = 0; k < e->side_len; k++) Py_INCREF(e->side_obj[k]);
        } else {
            e->side_len = 0; /* not kept: none of them has its reference yet */
        }
    }
    gc->enabled = enabled;
    free(tset.slots);
    free(rec.dead.slots);
    if (e != NULL) {
        if (recording && !failed) {
            e->list = out;
            e->n = n;
            e->batches = (e->n + CHUNK - 1) / CHUNK;
        } else {
            edges_reset(e);
        }
    }
    PyObject *result = NULL;
    if (!failed) {
        /* gc.get_objects()'s order: the youngest generation first */
        for (int i = 1; i < NUM_GENERATIONS && !failed; i++) {
            Py_ssize_t at = PyList_GET_SIZE(found[0]);
            if (PyList_SetSlice(found[0], at, at, found[i]) < 0) failed = 1;
        }
        if (!failed)
            result = Py_BuildValue("(O(nnn)O)", out, sizes[2], sizes[1], sizes[0], found[0]);
    }
    Py_XDECREF(out);
    for (int i = 0; i < NUM_GENERATIONS; i++) Py_XDECREF(found[i]);
    if (!result && !PyErr_Occurred()) PyErr_NoMemory();
    return result;
}
#endif

/* module_dicts(modules) -> {id(module.__dict__): name} for the modules of the dict
 * `modules` (sys.modules) whose name is a str, the first name of each (in the dict's
 * order). Reads fields only: no Python code runs. */
static PyObject *module_dicts(PyObject *self, PyObject *modules) {
    (void)self;
    if (!PyDict_CheckExact(modules)) {
        PyErr_SetString(PyExc_TypeError, "module_dicts: modules must be a dict");
        return NULL;
    }
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    Py_ssize_t pos = 0;
    PyObject *name, *mod;
    while (PyDict_Next(modules, &pos, &name, &mod)) {
        if (!PyUnicode_CheckExact(name) || !PyModule_Check(mod)) continue;
        PyObject *d = PyModule_GetDict(mod);
        if (d == NULL) {
            PyErr_Clear();
            continue;
        }
        PyObject *key = PyLong_FromVoidPtr(d);
        if (!key || PyDict_SetDefault(out, key, name) == NULL) {
            Py_XDECREF(key);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key);
    }
    return out;
}

static PyMethodDef methods[] = {
#ifdef CUDAMEM_HAVE_WALK
    {"walk", walk, METH_VARARGS,
     "The snapshot, the objects of given types and a full edge cache in one walk."},
#endif
    {"scan", scan, METH_VARARGS, "One pass over a heap snapshot (see the file's comment)."},
    {"instances", instances, METH_VARARGS, "The objects whose exact type is in a tuple."},
    {"gc_instances", gc_instances, METH_O, "The gc-tracked objects whose exact type is in a tuple."},
    {"module_dicts", module_dicts, METH_O, "{id(module.__dict__): name} of sys.modules."},
    {"edges", edges_new, METH_VARARGS, "A new edge cache for repeated scans of one snapshot."},
    {"edges_info", edges_info, METH_VARARGS, "(batches, edges, full) of an edge cache."},
#ifdef CUDAMEM_SIDE_THREAD
    {"side_thread", side_thread, METH_O, "Walks' array keeps on a second thread: 0, 1, 2."},
#endif
#ifdef CUDAMEM_HAVE_WALK
    {"walk_stats", walk_stats, METH_NOARGS, "(objects, edges, side, chased): the last walk."},
#endif
    {NULL, NULL, 0, NULL},
};

#ifndef CUDAMEM_MODULE_NAME
#define CUDAMEM_MODULE_NAME _cudamem_heapscan
#endif
#define STR2(x) #x
#define STR(x) STR2(x)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, STR(CUDAMEM_MODULE_NAME), "cudamem's compiled heap pass.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC CAT(PyInit_, CUDAMEM_MODULE_NAME)(void) { return PyModule_Create(&module); }

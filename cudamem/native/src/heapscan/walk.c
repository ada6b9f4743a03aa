/* walk: the snapshot, its tensors and its edge cache in one walk of gc's lists (Python
 * 3.11 to 3.13; see heapscan.h). */
#include "heapscan.h"

#ifdef CUDAMEM_HAVE_WALK

/* The last walk's sizes: the next one allocates about that much up front, where growing
 * by doubling copied the recording and the listing several times. A hint only. */
static Py_ssize_t last_objects = 0;
static size_t last_edges = 0;
static size_t last_dead = 0; /* array mode: containers with no array below */

/* walk_stats() -> (objects, edges, side, chased) of the last walk: what it listed and
 * recorded, the objects whose array keeps the side thread made, and the entries of gc's
 * lists the chaser read */
PyObject *walk_stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef CUDAMEM_SIDE_THREAD
    Py_ssize_t side = last_side_objects, chased = last_chased;
#else
    Py_ssize_t side = 0, chased = 0;
#endif
    return Py_BuildValue("(nnnn)", last_objects, (Py_ssize_t)last_edges, side, chased);
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
PyObject *walk(PyObject *self, PyObject *args) {
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

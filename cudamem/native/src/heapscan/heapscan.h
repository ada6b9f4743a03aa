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
 *
 * Files: ptrset.c (the address sets), visit.c (the visitors' helpers: descend, the added
 * ids, the clock), edges.c (the edge cache), scan.c (scan), instances.c (instances,
 * gc_instances, module_dicts), walk.c (walk), keeps.c (the array mode's keeps off the
 * recording, side_range: by the walk or its side thread), walk_threads.c (walk's side
 * thread and chaser), module.c (the module). What every file shares is declared here; the hot helpers
 * (the set test, the visitors) are inline here so that each file's loops inline them.
 */
#ifndef CUDAMEM_HEAPSCAN_H
#define CUDAMEM_HEAPSCAN_H
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

/* Nothing but PyInit_ leaves the library (the build passes -fvisibility=hidden too). */
#if defined(__GNUC__) || defined(__clang__)
#define HS_HIDDEN __attribute__((visibility("hidden")))
#else
#define HS_HIDDEN
#endif

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

static inline size_t mix(uintptr_t p) {
    uint64_t x = (uint64_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

static inline int set_has(const PtrSet *s, uintptr_t p) {
    size_t i = mix(p) & s->mask;
    for (;;) {
        uintptr_t v = s->slots[i];
        if (v == p) return 1;
        if (v == 0) return 0;
        i = (i + 1) & s->mask;
    }
}

HS_HIDDEN int set_init(PtrSet *s, size_t hint);
HS_HIDDEN int set_add(PtrSet *s, uintptr_t p);
HS_HIDDEN int set_filter(PtrSet *s);
HS_HIDDEN int set_add_ids(PtrSet *s, PyObject *iterable);

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
static inline int visit_test(PyObject *o, void *arg) {
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

HS_HIDDEN int descend(PyObject *level0, PyTypeObject *array_type, PyObject *arrays,
                      PyObject *edges);
HS_HIDDEN int sync_added(PtrSet *set, PyObject *added, Py_ssize_t *synced);
HS_HIDDEN double now_s(void);

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

static inline int visit_record(PyObject *o, void *arg) {
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

/* Whether object i's recorded referents include a wanted address. */
static inline int edges_test(const Edges *e, const PtrSet *wanted, Py_ssize_t i) {
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


HS_HIDDEN void side_clear(Edges *e);
HS_HIDDEN void edges_reset(Edges *e);
HS_HIDDEN PyObject *edges_new(PyObject *self, PyObject *args);
HS_HIDDEN PyObject *edges_info(PyObject *self, PyObject *args);
HS_HIDDEN int edges_bind(Edges *e, PyObject *objs);
HS_HIDDEN int edges_record(Edges *e, PyObject *objs, Py_ssize_t start, Py_ssize_t end);
HS_HIDDEN void edges_batch(const Edges *e, const PtrSet *wanted, Py_ssize_t start,
                           Py_ssize_t end, char *tested);
HS_HIDDEN void edges_fresh_arrays(const Edges *e, Visit *v, Py_ssize_t start, Py_ssize_t end,
                                  char *tested);
HS_HIDDEN int side_arrays(const Edges *e, Visit *v, Py_ssize_t start, Py_ssize_t end);

/* scan.c, instances.c */
HS_HIDDEN PyObject *scan(PyObject *self, PyObject *args);
HS_HIDDEN int type_set(PyObject *types, PtrSet *set);
HS_HIDDEN PyObject *instances(PyObject *self, PyObject *args);
HS_HIDDEN PyObject *gc_instances(PyObject *self, PyObject *types);
HS_HIDDEN PyObject *module_dicts(PyObject *self, PyObject *modules);

#ifdef CUDAMEM_HAVE_WALK
typedef struct {
    Edges *e;
    PyTypeObject *array_type; /* NULL: no arrays kept */
    int side_failed;
    PtrSet dead; /* untracked containers that lead to no array (they stay alive: no code runs) */
} Rec;

HS_HIDDEN void side_range(Rec *r, Py_ssize_t from, Py_ssize_t to);
HS_HIDDEN PyObject *walk(PyObject *self, PyObject *args);
HS_HIDDEN PyObject *walk_stats(PyObject *self, PyObject *unused);
#endif

#ifdef CUDAMEM_SIDE_THREAD
#define SIDE_STEP 1024

/* side_thread(mode), for the side thread and the chaser (below): 1 on where there are CPUs
 * for them, 0 off, 2 in lockstep (tests: the walk waits at each publication until the side
 * thread has caught up, so its share is known: every published object; the chaser reads
 * all of gc's lists before the walk starts) */
extern HS_HIDDEN int side_mode;
extern HS_HIDDEN Py_ssize_t last_side_objects; /* the last walk: keeps made on the side thread */
extern HS_HIDDEN Py_ssize_t last_chased;       /* the last walk: entries the chaser read */

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

/* The walk's visitor while the side thread may run: a full buffer is grown only after the
 * thread is halted (it reads the buffer). */
typedef struct {
    Edges *e;
    Side *side;
} WalkVisit;

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

HS_HIDDEN int cpus_usable(void);
HS_HIDDEN void side_start(Side *s, Rec *r, int cpus);
HS_HIDDEN void side_publish(Side *s, Py_ssize_t recorded);
HS_HIDDEN void side_join(Side *s, int finish, Py_ssize_t recorded);
HS_HIDDEN int visit_walk(PyObject *o, void *arg);
HS_HIDDEN void chase_start(Chase *c, struct _gc_runtime_state *gc, int nth, int cpus);
HS_HIDDEN void chase_join(Chase *c);
HS_HIDDEN PyObject *side_thread(PyObject *self, PyObject *arg);
#endif

#endif


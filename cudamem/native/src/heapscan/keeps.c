/* keeps: the array mode's keeps, read off the walk's recording (side_range): by the walk
 * itself or by the side thread beside it (walk_threads.c). See heapscan.h. */
#include "heapscan.h"

#ifdef CUDAMEM_HAVE_WALK

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

/* The array-mode keeps of objects [from, to), object by object in snapshot order, each
 * object's referents in its traversal's order: a sequential read of their recording that
 * asks for the referents' headers ahead of use. Reads only (pointer compares, type checks,
 * the traversal of untracked dicts and tuples) and writes only `r`'s own memory, so it may
 * run on the side thread while the walk records further on: every recorded address is alive
 * (the snapshot holds its objects, they hold their referents, and no Python code runs). */
void side_range(Rec *r, Py_ssize_t from, Py_ssize_t to) {
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

#endif /* CUDAMEM_HAVE_WALK */

/* walk's helper threads: the side thread that makes the array keeps beside the walk, and
 * the chaser that reads gc's lists ahead of it (see heapscan.h). */
#include "heapscan.h"

#ifdef CUDAMEM_SIDE_THREAD
/* The side thread: side_range over the objects the walk has recorded so far, while the walk
 * goes on (the walk waits on memory for gc's next list entry; this thread waits on memory
 * for the referents' headers: on two cores the waits overlap). The walk publishes its
 * progress every SIDE_STEP objects; the thread works in steps of at most that many, so a
 * halt is answered soon. The recording's arrays are never moved while the thread runs: the
 * walk halts it (side_join) before it grows one, and does the rest itself. The thread holds
 * no thread state, runs no Python code and touches no reference count; every signal is
 * blocked in it. */

int side_mode = 1;
Py_ssize_t last_side_objects = 0;
Py_ssize_t last_chased = 0;

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

int cpus_usable(void) {
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
void side_start(Side *s, Rec *r, int cpus) {
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

void side_publish(Side *s, Py_ssize_t recorded) {
    pthread_mutex_lock(&s->lock);
    s->published = recorded;
    pthread_cond_signal(&s->more);
    if (side_mode == 2)
        while (s->next < recorded && !s->exited) pthread_cond_wait(&s->caught, &s->lock);
    pthread_mutex_unlock(&s->lock);
}

/* Join the thread: `finish` (the walk recorded `recorded` objects in all) lets it work to
 * the end; otherwise it stops after its current step. Its progress is then s->next. */
void side_join(Side *s, int finish, Py_ssize_t recorded) {
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

int visit_walk(PyObject *o, void *arg) {
    WalkVisit *w = (WalkVisit *)arg;
    if (w->e->len == w->e->cap) side_join(w->side, 0, 0);
    return visit_record(o, w->e);
}


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
void chase_start(Chase *c, struct _gc_runtime_state *gc, int nth, int cpus) {
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

void chase_join(Chase *c) {
    if (!c->running) return;
    __atomic_store_n(&c->stop, 1, __ATOMIC_RELAXED);
    pthread_join(c->thread, NULL);
    c->running = 0;
    last_chased = c->read;
}

/* side_thread(mode) -> the previous mode (see side_mode) */
PyObject *side_thread(PyObject *self, PyObject *arg) {
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

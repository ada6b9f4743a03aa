/* The heap pass's sets of addresses: open addressing, with an optional filter. */
#include "heapscan.h"

int set_init(PtrSet *s, size_t hint) {
    size_t n = 64;
    while (n < hint * 2 + 2) n <<= 1;
    s->slots = (uintptr_t *)calloc(n, sizeof(uintptr_t));
    if (!s->slots) return -1;
    s->mask = n - 1;
    s->used = 0;
    s->bits = NULL;
    return 0;
}

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

int set_add(PtrSet *s, uintptr_t p) {
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
int set_filter(PtrSet *s) {
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
int set_add_ids(PtrSet *s, PyObject *iterable) {
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

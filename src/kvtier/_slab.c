/* kvtier._slab: the bookkeeping of PinnedPool's slab in C (slab.py has the Python reference,
 * `PySlab`, and says why): the free extents (best fit by size, ties to the lowest address,
 * coalescing on release inside a chunk), the live slots by start, the used / waste / in-flight
 * byte counts and the in-flight set. `take` and `set_in_flight` are what a submit calls: each
 * one C call instead of a chain of Python frames, bisects, dicts and a dataclass __init__.
 *
 *   Slab(slot_type, chunks, ptrs, sizes, chunk_bytes, alignment, check_request)
 *             check_request(nbytes) raises for what is no positive int (device.base.check_nbytes)
 *   take(nbytes) -> a new slot_type instance, or None when no free extent fits
 *   is_live(slot)         True when slot itself is the allocation at its address (O(1));
 *                         False for a released, reused or foreign handle
 *   free(slot)            the slot's address given back; ValueError unless is_live
 *   set_in_flight(slot, busy)   ValueError when busy and not is_live
 *   largest() / smaller_than(span) / extents() / total()    as freelist.FreeList's
 *   used, waste, in_flight_bytes, live (dict start -> slot), in_flight (set): read-only
 *
 * slot_type is pool.Slot, a dataclass with __slots__: a slot is made by its type's tp_alloc and
 * its fields set through their member descriptors (no __init__ frame). Every call holds the GIL
 * from start to end, so each is atomic towards other Python threads (the pool's lock guards its
 * condition variable and the Python reference; kvtier does not load this module where the
 * interpreter runs without a GIL).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

static const char *FIELDS[] = {"id", "chunk", "offset", "nbytes", "span", "base", "ptr", "_tensor"};
enum { F_ID, F_CHUNK, F_OFFSET, F_NBYTES, F_SPAN, F_BASE, F_PTR, F_TENSOR, NFIELDS };

typedef struct {
    PyObject_HEAD
    long long chunk_bytes, alignment, max_request;
    long long used, waste, in_flight_bytes, next_id;
    long long *st, *sz;        /* free extents by start: start, size */
    long long *ks, *kt;        /* the same extents by (size, start): size, start */
    Py_ssize_t n, cap;
    long long *cptr;           /* each chunk's first byte */
    Py_ssize_t nchunks;
    PyObject *slot_type, *chunks, *live, *in_flight, *check_request;
    PyObject *desc[NFIELDS];   /* slot_type's member descriptors, in FIELDS order */
} Slab;

/* ---- the free extents ------------------------------------------------------------------ */

static Py_ssize_t by_start(Slab *s, long long start) { /* first extent with st >= start */
    Py_ssize_t lo = 0, hi = s->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (s->st[mid] < start) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static Py_ssize_t by_size(Slab *s, long long size, long long start) { /* first (ks, kt) >= */
    Py_ssize_t lo = 0, hi = s->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (s->ks[mid] < size || (s->ks[mid] == size && s->kt[mid] < start)) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int grow(Slab *s) {
    if (s->n < s->cap)
        return 0;
    Py_ssize_t cap = s->cap ? 2 * s->cap : 16;
    long long *a[4] = {s->st, s->sz, s->ks, s->kt};
    for (int k = 0; k < 4; k++) {
        long long *p = PyMem_Realloc(a[k], cap * sizeof(long long));
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        a[k] = p;
        s->st = a[0], s->sz = a[1], s->ks = a[2], s->kt = a[3];  /* moved ones kept on failure */
    }
    s->cap = cap;
    return 0;
}

/* Insert at (i in the start order, j in the size order); the caller made room with grow(). */
static void put(Slab *s, Py_ssize_t i, Py_ssize_t j, long long start, long long size) {
    memmove(s->st + i + 1, s->st + i, (s->n - i) * sizeof(long long));
    memmove(s->sz + i + 1, s->sz + i, (s->n - i) * sizeof(long long));
    memmove(s->ks + j + 1, s->ks + j, (s->n - j) * sizeof(long long));
    memmove(s->kt + j + 1, s->kt + j, (s->n - j) * sizeof(long long));
    s->st[i] = start, s->sz[i] = size, s->ks[j] = size, s->kt[j] = start;
    s->n++;
}

static void cut_size(Slab *s, Py_ssize_t j) { /* drop entry j of the size order (n unchanged) */
    memmove(s->ks + j, s->ks + j + 1, (s->n - j - 1) * sizeof(long long));
    memmove(s->kt + j, s->kt + j + 1, (s->n - j - 1) * sizeof(long long));
}

static void cut_start(Slab *s, Py_ssize_t i) { /* drop entry i of the start order (n unchanged) */
    memmove(s->st + i, s->st + i + 1, (s->n - i - 1) * sizeof(long long));
    memmove(s->sz + i, s->sz + i + 1, (s->n - i - 1) * sizeof(long long));
}

static void drop(Slab *s, Py_ssize_t i) { /* remove extent i (start order) from both orders */
    cut_size(s, by_size(s, s->sz[i], s->st[i]));
    cut_start(s, i);
    s->n--;
}

static int add(Slab *s, long long start, long long size) {
    if (grow(s) < 0)
        return -1;
    put(s, by_start(s, start), by_size(s, size, start), start, size);
    return 0;
}

/* The start of `span` bytes cut from the smallest extent that fits (ties: the lowest address);
 * -1 when none fits. Allocates nothing: the count of extents never grows here. */
static long long take_span(Slab *s, long long span) {
    Py_ssize_t j = by_size(s, span, -1);
    if (j == s->n)
        return -1;
    long long size = s->ks[j], start = s->kt[j];
    Py_ssize_t i = by_start(s, start);
    if (size == span) {
        cut_size(s, j);
        cut_start(s, i);
        s->n--;
        return start;
    }
    /* the rest stays free where it was in the start order; it moves down in the size order */
    long long rest = size - span, at = start + span;
    cut_size(s, j);
    s->n--;
    Py_ssize_t k = by_size(s, rest, at);
    s->n++;  /* entry i of the start order stays (now the rest): the size order gets it back below */
    memmove(s->ks + k + 1, s->ks + k, (s->n - 1 - k) * sizeof(long long));
    memmove(s->kt + k + 1, s->kt + k, (s->n - 1 - k) * sizeof(long long));
    s->ks[k] = rest, s->kt[k] = at;
    s->st[i] = at, s->sz[i] = rest;
    return start;
}

/* Give `size` bytes at `start` back, merged with free neighbours in the same chunk. */
static int release(Slab *s, long long start, long long size) {
    Py_ssize_t i = by_start(s, start);
    if (i > 0 && start % s->chunk_bytes && s->st[i - 1] + s->sz[i - 1] == start) {  /* left */
        start = s->st[i - 1];
        size += s->sz[i - 1];
        drop(s, --i);
    }
    long long end = start + size;
    if (i < s->n && end % s->chunk_bytes && s->st[i] == end) {  /* right */
        size += s->sz[i];
        drop(s, i);
    }
    return add(s, start, size);
}

/* ---- slots --------------------------------------------------------------------------- */

static int set_field(Slab *s, PyObject *o, int f, PyObject *v) { /* steals v */
    if (v == NULL)
        return -1;
    int r = Py_TYPE(s->desc[f])->tp_descr_set(s->desc[f], o, v);
    Py_DECREF(v);
    return r;
}

static int get_ll(Slab *s, PyObject *o, int f, long long *out) {
    PyObject *v = Py_TYPE(s->desc[f])->tp_descr_get(s->desc[f], o, (PyObject *)Py_TYPE(o));
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *new_slot(Slab *s, long long chunk, long long off, long long nbytes, long long span) {
    PyTypeObject *t = (PyTypeObject *)s->slot_type;
    PyObject *o = t->tp_alloc(t, 0);
    if (o == NULL)
        return NULL;
    PyObject *base = PyTuple_GET_ITEM(s->chunks, chunk);
    Py_INCREF(base);
    Py_INCREF(Py_None);
    if (set_field(s, o, F_ID, PyLong_FromLongLong(s->next_id)) < 0 ||
        set_field(s, o, F_CHUNK, PyLong_FromLongLong(chunk)) < 0 ||
        set_field(s, o, F_OFFSET, PyLong_FromLongLong(off)) < 0 ||
        set_field(s, o, F_NBYTES, PyLong_FromLongLong(nbytes)) < 0 ||
        set_field(s, o, F_SPAN, PyLong_FromLongLong(span)) < 0 ||
        set_field(s, o, F_BASE, base) < 0 ||
        set_field(s, o, F_PTR, PyLong_FromLongLong(s->cptr[chunk] + off)) < 0 ||
        set_field(s, o, F_TENSOR, Py_None) < 0) {
        Py_DECREF(o);
        return NULL;
    }
    s->next_id++;  /* unique per allocation: a stale handle never shares it with the new owner */
    return o;
}

static int check_slot(Slab *s, PyObject *slot) {
    if (PyObject_TypeCheck(slot, (PyTypeObject *)s->slot_type))
        return 0;
    PyErr_Format(PyExc_ValueError, "slot must be a Slot of this pool, got %R", slot);
    return -1;
}

/* The allocation that lives at slot's address (borrowed; NULL without an error when none), its
 * key in *key (a new reference) and its chunk/offset. NULL with an error set on failure. */
static PyObject *live_at(Slab *s, PyObject *slot, PyObject **key, long long *chunk, long long *off) {
    *key = NULL;
    if (check_slot(s, slot) < 0 || get_ll(s, slot, F_CHUNK, chunk) < 0 || get_ll(s, slot, F_OFFSET, off) < 0)
        return NULL;
    *key = PyLong_FromLongLong(*chunk * s->chunk_bytes + *off);
    if (*key == NULL)
        return NULL;
    return PyDict_GetItemWithError(s->live, *key);
}

/* ValueError naming slot: it is not the allocation at its address (`now` says what is). */
static PyObject *not_allocated(PyObject *slot, PyObject *live) {
    Py_XINCREF(live);  /* borrowed from the dict: the name lookups below run Python code */
    PyObject *name = PyObject_GetAttrString(slot, "name");
    PyObject *other = live != NULL ? PyObject_GetAttrString(live, "name") : NULL;
    if (name != NULL && (live == NULL || other != NULL)) {
        if (live == NULL)
            PyErr_Format(PyExc_ValueError, "slot %S is not allocated: nothing lives at its address", name);
        else
            PyErr_Format(PyExc_ValueError, "slot %S is not allocated: %S lives at its address", name, other);
    }
    Py_XDECREF(name);
    Py_XDECREF(other);
    Py_XDECREF(live);
    return NULL;
}

static PyObject *Slab_is_live(Slab *s, PyObject *slot) {
    PyObject *key;
    long long chunk, off;
    PyObject *live = live_at(s, slot, &key, &chunk, &off);
    Py_XDECREF(key);
    if (live == NULL && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(live == slot);
}

static PyObject *Slab_take(Slab *s, PyObject *arg) {
    long long n = -1;
    if (PyLong_CheckExact(arg)) {
        int over = 0;
        n = PyLong_AsLongLongAndOverflow(arg, &over);
        if (over)
            n = -1;
    }
    if (n <= 0 || n > s->max_request) {  /* not the usual int: check_request names the error */
        PyObject *r = PyObject_CallOneArg(s->check_request, arg);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
        n = PyLong_AsLongLong(arg);  /* it passed the check: a positive int */
        if (n == -1 && PyErr_Occurred())
            return NULL;
        if (n > s->max_request)
            return PyErr_Format(PyExc_ValueError, "nbytes=%R exceeds the largest chunk; a slot never straddles chunks", arg);
        if (n <= 0)
            return PyErr_Format(PyExc_ValueError, "nbytes must be a positive int, got %R", arg);
    }
    long long span = (n + s->alignment - 1) / s->alignment * s->alignment;
    long long start = take_span(s, span);
    if (start < 0)
        Py_RETURN_NONE;
    PyObject *slot = new_slot(s, start / s->chunk_bytes, start % s->chunk_bytes, n, span);
    PyObject *key = slot ? PyLong_FromLongLong(start) : NULL;
    if (key == NULL || PyDict_SetItem(s->live, key, slot) < 0) {
        Py_XDECREF(key);
        Py_XDECREF(slot);
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        if (release(s, start, span) < 0)  /* nothing handed out: the bytes are free again */
            PyErr_Clear();
        PyErr_Restore(t, v, tb);
        return NULL;
    }
    Py_DECREF(key);
    s->used += span;
    s->waste += span - n;
    return slot;
}

static PyObject *Slab_free(Slab *s, PyObject *slot) {
    long long chunk, off, span, nbytes;
    PyObject *key;
    PyObject *live = live_at(s, slot, &key, &chunk, &off);  /* borrowed */
    if (live != slot) {  /* a stale handle must not free the bytes of their new owner */
        Py_XDECREF(key);
        if (PyErr_Occurred())
            return NULL;
        return not_allocated(slot, live);
    }
    Py_INCREF(live);  /* the dict's reference goes below */
    if (get_ll(s, live, F_SPAN, &span) < 0 || get_ll(s, live, F_NBYTES, &nbytes) < 0 ||
        PyDict_DelItem(s->live, key) < 0) {
        Py_DECREF(live);
        Py_DECREF(key);
        return NULL;
    }
    Py_DECREF(key);
    s->used -= span;
    s->waste -= span - nbytes;
    int was = PySet_Discard(s->in_flight, live);
    Py_DECREF(live);
    if (was < 0)
        return NULL;
    if (was)
        s->in_flight_bytes -= span;
    if (release(s, chunk * s->chunk_bytes + off, span) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Slab_set_in_flight(Slab *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_in_flight(slot, busy)");
        return NULL;
    }
    PyObject *slot = args[0];
    long long span;
    int busy = PyObject_IsTrue(args[1]);
    if (busy < 0 || check_slot(s, slot) < 0 || get_ll(s, slot, F_SPAN, &span) < 0)
        return NULL;
    int r = busy ? PySet_Contains(s->in_flight, slot) : PySet_Discard(s->in_flight, slot);
    if (r < 0)
        return NULL;
    if (busy && !r) {
        PyObject *key;
        long long chunk, off;
        PyObject *live = live_at(s, slot, &key, &chunk, &off);
        Py_XDECREF(key);
        if (live != slot) {  /* counted, a stale handle would never be uncounted */
            if (PyErr_Occurred())
                return NULL;
            PyObject *name = PyObject_GetAttrString(slot, "name");
            if (name != NULL)
                PyErr_Format(PyExc_ValueError, "slot %S is not allocated: it cannot be in flight", name);
            Py_XDECREF(name);
            return NULL;
        }
        if (PySet_Add(s->in_flight, slot) < 0)
            return NULL;
        s->in_flight_bytes += span;
    } else if (!busy && r) {
        s->in_flight_bytes -= span;
    }
    Py_RETURN_NONE;
}

static PyObject *Slab_largest(Slab *s, PyObject *unused) {
    return PyLong_FromLongLong(s->n ? s->ks[s->n - 1] : 0);
}

static PyObject *Slab_smaller_than(Slab *s, PyObject *arg) {
    long long span = PyLong_AsLongLong(arg), sum = 0;
    if (span == -1 && PyErr_Occurred())
        return NULL;
    for (Py_ssize_t j = 0, end = by_size(s, span, -1); j < end; j++)
        sum += s->ks[j];
    return PyLong_FromLongLong(sum);
}

static PyObject *Slab_extents(Slab *s, PyObject *unused) {
    PyObject *out = PyList_New(s->n);
    for (Py_ssize_t i = 0; out != NULL && i < s->n; i++) {
        PyObject *t = Py_BuildValue("(LL)", s->st[i], s->sz[i]);
        if (t == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *Slab_total(Slab *s, PyObject *unused) {
    long long sum = 0;
    for (Py_ssize_t i = 0; i < s->n; i++) {  /* also checks that the two orders agree (tests) */
        if (i && (s->st[i - 1] + s->sz[i - 1] > s->st[i]))
            return PyErr_Format(PyExc_AssertionError, "free extents overlap at %lld", s->st[i]);
        if (by_size(s, s->sz[i], s->st[i]) >= s->n || s->kt[by_size(s, s->sz[i], s->st[i])] != s->st[i])
            return PyErr_Format(PyExc_AssertionError, "extent at %lld missing from the size order", s->st[i]);
        sum += s->sz[i];
    }
    return PyLong_FromLongLong(sum);
}

/* ---- the type -------------------------------------------------------------------------- */

static int Slab_init(Slab *s, PyObject *args, PyObject *kw) {
    PyObject *slot_type, *chunks, *ptrs, *sizes, *check_request;
    long long chunk_bytes, alignment;
    if (!PyArg_ParseTuple(args, "O!OOOLLO:Slab", &PyType_Type, &slot_type, &chunks, &ptrs, &sizes,
                          &chunk_bytes, &alignment, &check_request))
        return -1;
    if (chunk_bytes <= 0 || alignment <= 0 || !PyCallable_Check(check_request)) {
        PyErr_SetString(PyExc_ValueError, "Slab: chunk_bytes and alignment > 0, check_request callable");
        return -1;
    }
    if (s->slot_type != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Slab: already initialized");
        return -1;
    }
    s->chunks = PySequence_Tuple(chunks);
    if (s->chunks == NULL)
        return -1;
    s->nchunks = PyTuple_GET_SIZE(s->chunks);
    if (PySequence_Size(ptrs) != s->nchunks || PySequence_Size(sizes) != s->nchunks) {
        PyErr_SetString(PyExc_ValueError, "Slab: one pointer and one size per chunk");
        return -1;
    }
    s->cptr = PyMem_Calloc(s->nchunks ? s->nchunks : 1, sizeof(long long));
    if (s->cptr == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(slot_type);
    s->slot_type = slot_type;
    Py_INCREF(check_request);
    s->check_request = check_request;
    s->chunk_bytes = chunk_bytes, s->alignment = alignment, s->next_id = 1;
    s->live = PyDict_New();
    s->in_flight = PySet_New(NULL);
    if (s->live == NULL || s->in_flight == NULL)
        return -1;
    for (int f = 0; f < NFIELDS; f++) {
        PyObject *d = PyObject_GetAttrString(slot_type, FIELDS[f]);  /* the class's descriptor */
        if (d == NULL)
            return -1;
        s->desc[f] = d;
        if (Py_TYPE(d)->tp_descr_set == NULL || Py_TYPE(d)->tp_descr_get == NULL) {
            PyErr_Format(PyExc_TypeError, "Slab: %R.%s is not a slot field", slot_type, FIELDS[f]);
            return -1;
        }
    }
    for (Py_ssize_t c = 0; c < s->nchunks; c++) {
        PyObject *p = PySequence_GetItem(ptrs, c), *z = PySequence_GetItem(sizes, c);
        long long ptr = p ? PyLong_AsLongLong(p) : -1, size = z ? PyLong_AsLongLong(z) : -1;
        Py_XDECREF(p);
        Py_XDECREF(z);
        if (PyErr_Occurred())
            return -1;
        if (size <= 0 || size > chunk_bytes) {
            PyErr_Format(PyExc_ValueError, "Slab: chunk %zd has %lld bytes (1..chunk_bytes)", c, size);
            return -1;
        }
        s->cptr[c] = ptr;
        if (size > s->max_request)
            s->max_request = size;
        if (add(s, c * chunk_bytes, size) < 0)
            return -1;
    }
    return 0;
}

static void Slab_dealloc(Slab *s) {
    PyMem_Free(s->st), PyMem_Free(s->sz), PyMem_Free(s->ks), PyMem_Free(s->kt), PyMem_Free(s->cptr);
    Py_XDECREF(s->slot_type), Py_XDECREF(s->chunks), Py_XDECREF(s->live);
    Py_XDECREF(s->in_flight), Py_XDECREF(s->check_request);
    for (int f = 0; f < NFIELDS; f++)
        Py_XDECREF(s->desc[f]);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMethodDef Slab_methods[] = {
    {"take", (PyCFunction)Slab_take, METH_O, "A new slot of nbytes, or None when no free extent fits."},
    {"is_live", (PyCFunction)Slab_is_live, METH_O, "True when slot is the allocation at its address."},
    {"free", (PyCFunction)Slab_free, METH_O, "Give a live slot's bytes back."},
    {"set_in_flight", (PyCFunction)(void (*)(void))Slab_set_in_flight, METH_FASTCALL, "Count a slot in flight or not."},
    {"largest", (PyCFunction)Slab_largest, METH_NOARGS, "The largest free extent."},
    {"smaller_than", (PyCFunction)Slab_smaller_than, METH_O, "Free bytes in extents too small for span."},
    {"extents", (PyCFunction)Slab_extents, METH_NOARGS, "(start, size) of every free extent, by start."},
    {"total", (PyCFunction)Slab_total, METH_NOARGS, "Free bytes (checks the two orders agree)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Slab_members[] = {
    {"used", T_LONGLONG, offsetof(Slab, used), READONLY, "bytes handed out (aligned spans)"},
    {"waste", T_LONGLONG, offsetof(Slab, waste), READONLY, "alignment padding inside used spans"},
    {"in_flight_bytes", T_LONGLONG, offsetof(Slab, in_flight_bytes), READONLY, "bytes of slots in flight"},
    {"max_request", T_LONGLONG, offsetof(Slab, max_request), READONLY, "the largest chunk"},
    {"live", T_OBJECT, offsetof(Slab, live), READONLY, "start -> slot"},
    {"in_flight", T_OBJECT, offsetof(Slab, in_flight), READONLY, "slots in flight"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SlabType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._slab.Slab",
    .tp_basicsize = sizeof(Slab),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PinnedPool's slab bookkeeping (slab.py's PySlab in C).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Slab_init,
    .tp_dealloc = (destructor)Slab_dealloc,
    .tp_methods = Slab_methods,
    .tp_members = Slab_members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slab", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__slab(void) {
    if (PyType_Ready(&SlabType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SlabType);
    if (PyModule_AddObject(m, "Slab", (PyObject *)&SlabType) < 0) {
        Py_DECREF(&SlabType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* kvtier.engine.fastpath._fast: the two steps of a submit that cost most on a host whose caches
 * are cold (engine/fastpath/fast.py says why), each as one C call instead of a dozen numpy, torch
 * and ctypes calls. Optional: built by `make` (setup.py, optional=True); without it kvtier runs
 * the same steps in numpy and ctypes (engine/ids.py, engine/fastpath/graphs.py).
 *
 *   check_ids(src, wide, n, num_blocks, seen, out) -> 0 ok | 1 an id out of range | 2 a repeat
 *             (wide: 1 int64, 0 int32, 2 a list or tuple of ints -- 3: an item is no int)
 *   check_ids(src, wide, n, num_blocks, seen, spares) -> the array used | 1 | 2 | None (none free)
 *             (the job's copy is int32: num_blocks <= 2**31, so every checked id fits)
 *   set_simd(on) -> whether the AVX2 pass was on (tests run both passes; off where unsupported)
 *   set_runtime(memcpy_async, graph_launch, event_record, get_device, set_device, event_query)
 *   replay(ids, n, host32, dev32, exec, stream, event, device, guard) -> 0 | step << 32 | cudaError
 *   replay_steps(..., ns)   the same, ns (8 int64) getting the time at entry and after each step
 *
 * No CUDA headers: the runtime's functions arrive as addresses (those of the libcudart torch
 * loaded), with the prototypes below (CUDA 12 and 13 runtime API).
 *
 * Both hold the GIL throughout (as torch's launches do): the runtime calls take microseconds, and
 * giving the GIL away around them (as ctypes does) could leave the submit waiting a whole switch
 * interval (5 ms) to get it back from another Python thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PASS 1
#endif

typedef int (*memcpy_async_t)(void *dst, const void *src, size_t count, int kind, void *stream);
typedef int (*graph_launch_t)(void *exec, void *stream);
typedef int (*event_record_t)(void *event, void *stream);
typedef int (*get_device_t)(int *device);
typedef int (*set_device_t)(int device);
typedef int (*event_query_t)(void *event);

static memcpy_async_t memcpy_async;
static graph_launch_t graph_launch;
static event_record_t event_record;
static get_device_t get_device;
static set_device_t set_device;
static event_query_t event_query;

enum { H2D = 1 };                                     /* cudaMemcpyHostToDevice */
enum { STEP_COPY = 1, STEP_LAUNCH = 2, STEP_RECORD = 3, STEP_DEVICE = 4, STEP_GUARD = 5 };

/* An address: an int, or an object with the buffer protocol (C-contiguous, at least `need`
 * bytes, of items of `itemsize` bytes unless 0: int64 ids read as int32 would be other ids).
 * `view->obj` is set when a buffer was taken: release it with PyBuffer_Release. */
static int address(PyObject *o, Py_ssize_t need, Py_ssize_t itemsize, int writable, void **p, Py_buffer *view) {
    view->obj = NULL;
    if (PyLong_Check(o)) {
        *p = PyLong_AsVoidPtr(o);
        return (*p == NULL && PyErr_Occurred()) ? -1 : 0;
    }
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, view, flags) < 0)
        return -1;
    if (view->len < need || (itemsize && view->itemsize != itemsize)) {
        if (view->len < need)
            PyErr_Format(PyExc_ValueError, "buffer of %zd bytes, needs %zd", view->len, need);
        else
            PyErr_Format(PyExc_ValueError, "buffer of %zd-byte items, needs %zd-byte ones", view->itemsize, itemsize);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    *p = view->buf;
    return 0;
}

static int int_arg(PyObject *o, long long *v) {
    *v = PyLong_AsLongLong(o);
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* 1 if the n ids strictly increase (then none repeats). Stops at the first that does not, so an
 * unordered list costs next to nothing here and a rising one a read of ids just written. Not
 * inlined: inlined, it made the scalar copy loop slower (its code layout). */
static __attribute__((noinline)) int rising(const int32_t *a, long long n) {
    for (long long i = 1; i < n; i++)
        if (a[i] <= a[i - 1])
            return 0;
    return 1;
}

/* The copy and range check, one id at a time: 1 at the first id out of range, else 0; `*up`
 * (unless NULL: a save asks no repeat check) set to whether the ids strictly increase (read back
 * from `out`, just written). The copy is int32: `lim` <= 2**31, so an id in range fits. */
static int copy_scalar(const void *src, int wide, long long n, uint64_t lim, int32_t *out, int *up) {
    if (wide) {
        const int64_t *s = (const int64_t *)src;
        for (long long i = 0; i < n; i++) {
            if ((uint64_t)s[i] >= lim) return 1;
            out[i] = (int32_t)s[i];
        }
    } else {
        const int32_t *s = (const int32_t *)src;
        for (long long i = 0; i < n; i++) {
            if ((uint64_t)(int64_t)s[i] >= lim) return 1;
            out[i] = s[i];
        }
    }
    if (up != NULL)
        *up = rising(out, n);
    return 0;
}

#ifdef HAVE_AVX2_PASS
/* The same in one branch-free AVX2 pass, four ids a step: the copy (narrowed to int32), the range
 * check (unsigned `id < lim` as a signed compare of both with the sign bit flipped) and the
 * rising check (each id against the one before it, loaded again one id back) all at once. Where
 * the ids are cold in memory both passes cost their reads; in cache (or for a load's rising
 * check, a second pass over the ids) this one is faster. */
static inline __attribute__((target("avx2"))) __m256i load4(const void *src, int wide, long long i) {
    if (wide)
        return _mm256_loadu_si256((const __m256i *)((const int64_t *)src + i));
    return _mm256_cvtepi32_epi64(_mm_loadu_si128((const __m128i *)((const int32_t *)src + i)));
}

/* The low 32 bits of four int64 lanes, as four int32 (the checked ids fit). */
static inline __attribute__((target("avx2"))) __m128i low4(__m256i v) {
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
}

static __attribute__((target("avx2"))) int copy_avx2(const void *src, int wide, long long n, uint64_t lim,
                                                     int32_t *out, int *up) {
    const __m256i flip = _mm256_set1_epi64x(INT64_MIN), top = _mm256_set1_epi64x((int64_t)(lim ^ (1ULL << 63)));
    __m256i in = _mm256_set1_epi64x(-1), rise = _mm256_set1_epi64x(-1);  /* all lanes true so far */
    long long i = 0;
    if (n >= 4) {
        __m256i v = load4(src, wide, 0);
        in = _mm256_cmpgt_epi64(top, _mm256_xor_si256(v, flip));
        _mm_storeu_si128((__m128i *)out, low4(v));
        for (i = 4; i + 4 <= n; i += 4) {
            v = load4(src, wide, i);
            in = _mm256_and_si256(in, _mm256_cmpgt_epi64(top, _mm256_xor_si256(v, flip)));
            rise = _mm256_and_si256(rise, _mm256_cmpgt_epi64(v, load4(src, wide, i - 1)));
            _mm_storeu_si128((__m128i *)(out + i), low4(v));
        }
        /* the first vector's own neighbours, compared from the source (the copy may have wrapped
         * an id out of range; then the pass fails on the range anyway) */
        const int64_t a0 = wide ? ((const int64_t *)src)[0] : ((const int32_t *)src)[0];
        const int64_t a1 = wide ? ((const int64_t *)src)[1] : ((const int32_t *)src)[1];
        const int64_t a2 = wide ? ((const int64_t *)src)[2] : ((const int32_t *)src)[2];
        const int64_t a3 = wide ? ((const int64_t *)src)[3] : ((const int32_t *)src)[3];
        if (!(a0 < a1 && a1 < a2 && a2 < a3))
            rise = _mm256_setzero_si256();
    }
    int ok = _mm256_movemask_epi8(in) == -1, upward = _mm256_movemask_epi8(rise) == -1;
    for (; i < n; i++) {  /* the tail (and lists of fewer than four) one at a time */
        const int64_t v = wide ? ((const int64_t *)src)[i] : ((const int32_t *)src)[i];
        const int64_t prev = i == 0 ? 0 : (wide ? ((const int64_t *)src)[i - 1] : ((const int32_t *)src)[i - 1]);
        ok &= (uint64_t)v < lim;
        upward &= i == 0 || v > prev;
        out[i] = (int32_t)v;
    }
    if (up != NULL)
        *up = upward;
    return !ok;
}

static int simd = -1;  /* -1: not asked yet; then whether copy_avx2 runs */
static int simd_on(void) {
    if (simd < 0) {
        __builtin_cpu_init();
        simd = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return simd;
}
#endif

/* The range-checked copy of a list or tuple of n Python ints: 1 at the first out of range, 3 at
 * the first item that is not an exact int or does not fit 64 bits (the caller's numpy path then
 * handles the list and raises what is wrong), else 0. A caller's list (vLLM's block ids) in one
 * C pass, many times faster than numpy's conversion of it (and than PyLong_AsLongLongAndOverflow
 * for each item). */
static inline long long int_value(PyObject *o, int *over) {
    /* An exact int's value, read from its one digit where it has one (no call): the public
     * unstable API from 3.12, the 3.11 struct before it; else the general conversion. */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o))
        return (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
#elif PY_VERSION_HEX >= 0x030B0000
    const Py_ssize_t size = Py_SIZE(o);
    if (size == 0 || size == 1)
        return size ? (long long)((PyLongObject *)o)->ob_digit[0] : 0;
#endif
    return PyLong_AsLongLongAndOverflow(o, over);
}

static int copy_seq(PyObject *seq, long long n, uint64_t lim, int32_t *out, int *up) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int upward = 1;
    for (long long i = 0; i < n; i++) {
        PyObject *o = items[i];
        if (!PyLong_CheckExact(o))
            return 3;  /* bool, float, numpy scalar...: numpy's path decides */
        int over = 0;
        const long long v = int_value(o, &over);
        if (over)
            return 3;  /* past 64 bits: numpy's path says what is wrong, as without the helper */
        if ((uint64_t)v >= lim)
            return 1;
        out[i] = (int32_t)v;
        upward &= i == 0 || out[i] > out[i - 1];
    }
    if (up != NULL)
        *up = upward;
    return 0;
}

/* The range-checked copy, through whichever pass this CPU runs. */
static int copy_ids(const void *src, int wide, long long n, uint64_t lim, int32_t *out, int *up) {
#ifdef HAVE_AVX2_PASS
    if (simd_on())
        return copy_avx2(src, wide, n, lim, out, up);
#endif
    return copy_scalar(src, wide, n, lim, out, up);
}

/* The repeat check of n in-range ids over `seen`, a bit per block in 64-bit words (all zero, left
 * all zero): 0, or 2 for a repeat. Branch-free: each id ORs its bit into its word and keeps what
 * the word held at that bit, two ids a step on two chains (a byte mask with a branch per run of
 * ids is slower, hot or with the caches flushed). Then every word it
 * marked is cleared: one sweep where the mask is no bigger than the ids, else word by word. */
static int repeats(const int32_t *out, long long n, long long num_blocks, uint64_t *seen) {
    uint64_t d0 = 0, d1 = 0;
    long long i = 0;
    const long long words = (num_blocks + 63) / 64;
    if (words <= n)  /* a mask no bigger than the ids: fetched in order first, not miss by miss */
        for (long long w = 0; w < words; w += 8)
            __builtin_prefetch(seen + w, 1);
    for (; i + 2 <= n; i += 2) {
        const uint32_t a = (uint32_t)out[i], b = (uint32_t)out[i + 1];
        const uint64_t ba = 1ULL << (a & 63), bb = 1ULL << (b & 63);
        const uint64_t wa = seen[a >> 6];
        d0 |= wa & ba;
        seen[a >> 6] = wa | ba;
        const uint64_t wb = seen[b >> 6];  /* read after a's store: a == b's word sees a's bit */
        d1 |= wb & bb;
        seen[b >> 6] = wb | bb;
    }
    for (; i < n; i++) {
        const uint32_t a = (uint32_t)out[i];
        const uint64_t ba = 1ULL << (a & 63), wa = seen[a >> 6];
        d0 |= wa & ba;
        seen[a >> 6] = wa | ba;
    }
    if (words <= n)
        memset(seen, 0, (size_t)words * 8);
    else
        for (long long j = 0; j < n; j++)
            seen[(uint32_t)out[j] >> 6] = 0;
    return (d0 | d1) ? 2 : 0;
}

/* The first array of the list `spares` that nothing but the list holds (a reference count of 1,
 * read under the GIL: no job, tracker entry, view or buffer export has it), of exactly `nbytes`;
 * NULL if the first SPARE_PROBES hold none. Its index in *at, its writable buffer in *view (the
 * caller releases it: one export per call, not one to look and another to write). The list is
 * kept in order of use (`check_ids` moves the one it takes to the end), so the first is the one
 * used longest ago. */
#define SPARE_PROBES 4
static PyObject *free_spare(PyObject *spares, Py_ssize_t nbytes, Py_ssize_t *at, Py_buffer *view) {
    const Py_ssize_t len = PyList_GET_SIZE(spares);
    for (Py_ssize_t k = 0; k < len && k < SPARE_PROBES; k++) {
        PyObject *a = PyList_GET_ITEM(spares, k);
        if (Py_REFCNT(a) != 1)
            continue;  /* still someone's ids: writing it would change them */
        Py_buffer v;
        if (PyObject_GetBuffer(a, &v, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            PyErr_Clear();
            continue;
        }
        if (v.len == nbytes && v.itemsize == 4) {
            *at = k;
            *view = v;
            return a;
        }
        PyBuffer_Release(&v);
    }
    return NULL;
}

/* check_ids: copy n ids (int64 if `wide`, else int32) from `src` to an int32 buffer, checking
 * 0 <= id < num_blocks (one unsigned compare: a negative id wraps to a huge value; num_blocks <=
 * 2**31, so every id that passes fits in 32 bits); with `seen` (a bit per block in 64-bit words,
 * (num_blocks + 63) / 64 of them, all zero; None: no check) also that no id repeats, leaving
 * `seen` all zero again -- unless the ids strictly increase, which rules out a repeat without the
 * mask. Bits, not bytes: the marks of a big load touch an eighth of the cache lines. The copy is
 * int32, half the bytes an int64 one writes (and the graph's ids buffer is int32: its fill is a
 * plain copy). The buffer: `out`, or, where `out` is a list, a free array of it (`free_spare`),
 * returned (moved to the list's end) when the ids pass, left where it is when they do not; None
 * (nothing checked) when no array of the list is free. Returns 0 or the array, 1 (an id out of
 * range) or 2 (a repeated id). wide=2: `src` is a list or tuple of n Python ints (`copy_seq`),
 * and 3 means an item is no int: nothing checked, the caller's own path decides. */
static PyObject *check_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "check_ids(src, wide, n, num_blocks, seen, out)");
        return NULL;
    }
    long long wide, n, num_blocks;
    if (int_arg(args[1], &wide) || int_arg(args[2], &n) || int_arg(args[3], &num_blocks))
        return NULL;
    if (n < 0 || num_blocks < 0 || num_blocks > (1LL << 31)) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0 and 0 <= num_blocks <= 2**31");
        return NULL;
    }
    if (wide == 2 && (!(PyList_CheckExact(args[0]) || PyTuple_CheckExact(args[0])) ||
                      PySequence_Fast_GET_SIZE(args[0]) != n)) {  /* a list or tuple of n ints */
        PyErr_SetString(PyExc_ValueError, "check_ids: wide=2 takes a list or tuple of n ints");
        return NULL;
    }
    PyObject *out_obj = args[5], *spares = NULL;
    Py_ssize_t at = 0;
    void *src = NULL, *outp = NULL, *seenp = NULL;
    Py_buffer vs, vo, vm;
    vm.obj = vs.obj = vo.obj = NULL;
    if (PyList_CheckExact(out_obj)) {
        spares = out_obj;
        out_obj = free_spare(spares, (Py_ssize_t)(n * 4), &at, &vo);  /* vo: its buffer, exported */
        if (out_obj == NULL)
            Py_RETURN_NONE;
        outp = vo.buf;
    } else if (address(out_obj, n * 4, 4, 1, &outp, &vo) < 0) {
        return NULL;
    }
    if ((wide != 2 && address(args[0], n * (wide ? 8 : 4), wide ? 8 : 4, 0, &src, &vs) < 0) ||
        (args[4] != Py_None && address(args[4], (num_blocks + 63) / 64 * 8, 8, 1, &seenp, &vm) < 0)) {
        if (vs.obj) PyBuffer_Release(&vs);
        if (vo.obj) PyBuffer_Release(&vo);
        return NULL;
    }
    int32_t *out = (int32_t *)outp;
    int up = 0;
    int *upp = seenp != NULL ? &up : NULL;
    long rc = wide == 2 ? copy_seq(args[0], n, (uint64_t)num_blocks, out, upp)
                        : copy_ids(src, (int)wide, n, (uint64_t)num_blocks, out, upp);
    if (rc == 0 && seenp != NULL && !up)  /* a rising list (the usual request) has no repeat */
        rc = repeats(out, n, num_blocks, (uint64_t *)seenp);
    if (vs.obj) PyBuffer_Release(&vs);
    if (vo.obj) PyBuffer_Release(&vo);
    if (vm.obj) PyBuffer_Release(&vm);
    if (spares == NULL || rc != 0)
        return PyLong_FromLong(rc);
    /* To the list's end (the list's reference moves with it; the caller gets one of its own). */
    Py_INCREF(out_obj);
    if (PyList_SetSlice(spares, at, at + 1, NULL) < 0 || PyList_Append(spares, out_obj) < 0) {
        Py_DECREF(out_obj);
        return NULL;
    }
    return out_obj;
}

/* set_simd(on) -> whether the AVX2 pass was on before; it is turned on only where the CPU has
 * AVX2 (tests run the scalar pass too). */
static PyObject *set_simd(PyObject *self, PyObject *arg) {
    const int want = PyObject_IsTrue(arg);
    if (want < 0)
        return NULL;
#ifdef HAVE_AVX2_PASS
    const int was = simd_on();
    simd = want && __builtin_cpu_supports("avx2");
    return PyBool_FromLong(was);
#else
    return PyBool_FromLong(0);
#endif
}

static PyObject *set_runtime(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "set_runtime(memcpy_async, graph_launch, event_record, get_device, set_device, event_query)");
        return NULL;
    }
    void *p[6];
    for (int i = 0; i < 6; i++) {
        p[i] = PyLong_AsVoidPtr(args[i]);
        if (p[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "set_runtime: a null function address");
            return NULL;
        }
    }
    memcpy_async = (memcpy_async_t)p[0];
    graph_launch = (graph_launch_t)p[1];
    event_record = (event_record_t)p[2];
    get_device = (get_device_t)p[3];
    set_device = (set_device_t)p[4];
    event_query = (event_query_t)p[5];
    Py_RETURN_NONE;
}

/* replay: unless `guard` (an event, 0: none) has yet to complete, copy n int32 ids (checked:
 * 0 <= id < num_blocks) into the pinned int32 buffer `host32`, then on `stream`, with `device` current:
 * cudaMemcpyAsync(dev32 <- host32), cudaGraphLaunch(exec), and cudaEventRecord(event) unless
 * event is 0. Returns 0, or (step << 32) | cudaError: step 5 the guard (cudaErrorNotReady: the
 * buffer is still read by an earlier copy; nothing written or enqueued), 4 switching device
 * (nothing enqueued), 1 the copy (nothing enqueued), 2 the launch (the copy enqueued, the graph
 * not), 3 the record (copy and graph enqueued, the event not recorded).
 * replay_steps: the same with a 10th argument, a writable buffer of NS_STEPS (8) int64 that gets
 * the CLOCK_MONOTONIC ns (Python's perf_counter_ns) at the call's entry, once its arguments are
 * read, after the guard's query, after the ids' fill, after the device check (before the copy),
 * after the copy, the launch and the record (each left 0 if not reached): a submit trace's split
 * of the call. */
#define NS_STEPS 8
/* fill: n checked int32 ids into the pinned buffer the ids copy reads. From STREAM_MIN ids on
 * (x86) the stores stream past the caches: between two submits a 1 GiB DMA passes through the
 * host's last-level cache, so the buffer's lines are rarely there and a plain store first reads
 * each one. Streamed stores write whole lines
 * without reading them. Below that, memcpy. */
#define STREAM_MIN 2048
static void fill(const int32_t *ids, int32_t *dst, long long n) {
    long long i = 0;
#if defined(__SSE2__)
    if (n >= STREAM_MIN && ((uintptr_t)dst & 15) == 0) {
        for (; i + 8 <= n; i += 8) {
            const __m128i *s = (const __m128i *)(ids + i);
            _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128(s));
            _mm_stream_si128((__m128i *)(dst + i + 4), _mm_loadu_si128(s + 1));
        }
        /* Streamed stores are weakly ordered: without the fence the copy enqueued next could
         * read the buffer before they reached memory (old ids, wrong blocks). */
        _mm_sfence();
    }
#endif
    if (i < n)
        memcpy(dst + i, ids + i, (size_t)(n - i) * sizeof(int32_t));
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static PyObject *replay_impl(PyObject *const *args, Py_ssize_t nargs, int traced) {
    const int64_t entry = traced ? now_ns() : 0;
    const Py_ssize_t want = traced ? 10 : 9;
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, traced
            ? "replay_steps(ids, n, host32, dev32, exec, stream, event, device, guard, ns)"
            : "replay(ids, n, host32, dev32, exec, stream, event, device, guard)");
        return NULL;
    }
    if (memcpy_async == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "replay: set_runtime was not called");
        return NULL;
    }
    long long n, device;
    if (int_arg(args[1], &n) || int_arg(args[7], &device))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0");
        return NULL;
    }
    void *ids_p, *host_p, *dev32, *exec, *stream, *event, *guard, *ns_p = NULL;
    Py_buffer vi, vh, vt;
    vt.obj = NULL;
    if (address(args[0], n * 4, 4, 0, &ids_p, &vi) < 0)
        return NULL;
    if (address(args[2], n * 4, 4, 1, &host_p, &vh) < 0) {
        if (vi.obj) PyBuffer_Release(&vi);
        return NULL;
    }
    if (traced && address(args[9], NS_STEPS * 8, 8, 1, &ns_p, &vt) < 0) {
        if (vi.obj) PyBuffer_Release(&vi);
        if (vh.obj) PyBuffer_Release(&vh);
        return NULL;
    }
    PyObject *const ptr_args[5] = {args[3], args[4], args[5], args[6], args[8]};
    void **dst[5] = {&dev32, &exec, &stream, &event, &guard};
    for (int i = 0; i < 5; i++) {
        *dst[i] = PyLong_AsVoidPtr(ptr_args[i]);
        if (*dst[i] == NULL && PyErr_Occurred()) {
            if (vi.obj) PyBuffer_Release(&vi);
            if (vh.obj) PyBuffer_Release(&vh);
            if (vt.obj) PyBuffer_Release(&vt);
            return NULL;
        }
    }
    int64_t *ns = (int64_t *)ns_p;
    if (ns != NULL) {
        memset(ns, 0, NS_STEPS * sizeof(int64_t));
        ns[0] = entry;
        ns[1] = now_ns();
    }
    long long out = 0;
    int rc, prev = -1;
    if (guard != NULL && (rc = event_query(guard)) != 0) {
        out = ((long long)STEP_GUARD << 32) | (unsigned)rc;   /* the buffer's last copy may not have read it */
        goto done;
    }
    if (ns != NULL) ns[2] = now_ns();
    int32_t *host32 = (int32_t *)host_p;
    fill((const int32_t *)ids_p, host32, n);
    if (ns != NULL) ns[3] = now_ns();
    if ((rc = get_device(&prev)) != 0) {
        out = ((long long)STEP_DEVICE << 32) | (unsigned)rc;
        goto done;
    }
    if (prev != device && (rc = set_device((int)device)) != 0) {
        out = ((long long)STEP_DEVICE << 32) | (unsigned)rc;
        goto done;
    }
    if (ns != NULL) ns[4] = now_ns();
    if ((rc = memcpy_async(dev32, host32, (size_t)n * 4, H2D, stream)) != 0) {
        out = ((long long)STEP_COPY << 32) | (unsigned)rc;
    } else {
        if (ns != NULL) ns[5] = now_ns();
        if ((rc = graph_launch(exec, stream)) != 0) {
            out = ((long long)STEP_LAUNCH << 32) | (unsigned)rc;
        } else {
            if (ns != NULL) ns[6] = now_ns();
            if (event != NULL && (rc = event_record(event, stream)) != 0)
                out = ((long long)STEP_RECORD << 32) | (unsigned)rc;
            else if (ns != NULL)
                ns[7] = now_ns();
        }
    }
    if (prev != device)
        set_device(prev);                             /* the caller's device stays current */
done:
    if (vi.obj) PyBuffer_Release(&vi);
    if (vh.obj) PyBuffer_Release(&vh);
    if (vt.obj) PyBuffer_Release(&vt);
    return PyLong_FromLongLong(out);
}

static PyObject *replay(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return replay_impl(args, nargs, 0);
}

static PyObject *replay_steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return replay_impl(args, nargs, 1);
}

static PyMethodDef methods[] = {
    {"check_ids", (PyCFunction)(void (*)(void))check_ids, METH_FASTCALL, "Copy and check block ids."},
    {"set_simd", (PyCFunction)set_simd, METH_O, "Turn the AVX2 pass of check_ids on or off."},
    {"set_runtime", (PyCFunction)(void (*)(void))set_runtime, METH_FASTCALL, "The runtime's function addresses."},
    {"replay", (PyCFunction)(void (*)(void))replay, METH_FASTCALL, "Ids copy, graph launch, event record."},
    {"replay_steps", (PyCFunction)(void (*)(void))replay_steps, METH_FASTCALL, "replay, timing each runtime call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&module); }

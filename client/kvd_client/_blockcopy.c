/* Runs in a TP worker: the native block copier behind kvd_client.backends.native.
 *
 * One call copies the pages of a job: piece (i, l) is layer l's page of the
 * i-th block pair,
 *
 *     dst_base[l] + dst_ids[i] * dst_stride[l]  <-  src_base[l] + src_ids[i] * src_stride[l]
 *
 * sizes[l] bytes, block by block (every layer of pair 0, then of pair 1, ...).
 * The caller has checked every id and address (kvd_client.copy_plan.check_job
 * and the views built over the tensors); this file trusts them.
 *
 * Why it exists: a per-layer slot is many small pages (512 bytes at 32 layers
 * and 16 KiB slots) at random places. A torch gather copies each with plain
 * stores, which first read every destination line and then wait on memory
 * for it; on the development VM that moved half the bytes per second of one
 * contiguous copy. Streaming (non-temporal) stores of whole 64-byte lines
 * write without the read. The caller sorts the pairs by device block, so each
 * layer's device pages are one ascending stream (the prefetchers follow one
 * per layer) while each pool slot is one contiguous run of pages: both sides
 * move in order. `kvd bench transfer` gives the figures.
 *
 * Streaming stores are used only when asked (large jobs, whose destination
 * would not stay in cache anyway) and only for pieces whose destination and
 * size are multiples of 64 bytes; other pieces use memcpy. Each worker thread
 * ends with a store fence, so every byte is visible before the call returns.
 * The GIL is released during the copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define KVD_X86 1
#include <immintrin.h>
#endif

#define MAX_THREADS 64
#define LINE 64

typedef void (*stream_fn)(char *dst, const char *src, size_t n);

typedef struct {
    int64_t num_layers;
    const int64_t *dst_ids, *src_ids;
    const int64_t *dst_base, *dst_stride, *src_base, *src_stride, *sizes;
    stream_fn stream; /* NULL: memcpy only */
    int64_t begin, end; /* pieces [begin, end), piece k = (pair k / layers, layer k % layers) */
} job_t;

#ifdef KVD_X86
__attribute__((target("avx512f"))) static void stream_avx512(char *d, const char *s, size_t n)
{
    for (size_t o = 0; o < n; o += LINE) {
        __m512i x = _mm512_loadu_si512((const void *)(s + o));
        _mm512_stream_si512((void *)(d + o), x);
    }
}

__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n)
{
    for (size_t o = 0; o < n; o += LINE) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + o));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + o + 32));
        _mm256_stream_si256((__m256i *)(d + o), a);
        _mm256_stream_si256((__m256i *)(d + o + 32), b);
    }
}

static void stream_sse2(char *d, const char *s, size_t n)
{
    for (size_t o = 0; o < n; o += LINE) {
        for (size_t k = 0; k < LINE; k += 16) {
            __m128i x = _mm_loadu_si128((const __m128i *)(s + o + k));
            _mm_stream_si128((__m128i *)(d + o + k), x);
        }
    }
}

static stream_fn best_stream(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return stream_avx512;
    if (__builtin_cpu_supports("avx2"))
        return stream_avx2;
    return stream_sse2;
}

static const char *stream_name(stream_fn fn)
{
    if (fn == stream_avx512)
        return "avx512";
    if (fn == stream_avx2)
        return "avx2";
    return "sse2";
}
#else
static stream_fn best_stream(void) { return NULL; }
static const char *stream_name(stream_fn fn) { (void)fn; return "none"; }
#endif

static inline void copy_piece(const job_t *j, int64_t i, int64_t l)
{
    char *d = (char *)(intptr_t)(j->dst_base[l] + j->dst_ids[i] * j->dst_stride[l]);
    const char *s = (const char *)(intptr_t)(j->src_base[l] + j->src_ids[i] * j->src_stride[l]);
    size_t n = (size_t)j->sizes[l];
    if (j->stream != NULL && ((uintptr_t)d % LINE) == 0 && n % LINE == 0)
        j->stream(d, s, n);
    else
        memcpy(d, s, n);
}

static void *run_range(void *arg)
{
    const job_t *j = (const job_t *)arg;
    int64_t layers = j->num_layers;
    int64_t i = j->begin / layers, l = j->begin % layers;
    for (int64_t k = j->begin; k < j->end; k++) {
        copy_piece(j, i, l);
        if (++l == layers) {
            l = 0;
            i++;
        }
    }
#ifdef KVD_X86
    if (j->stream != NULL)
        _mm_sfence();
#endif
    return NULL;
}

static stream_fn g_stream;

static PyObject *copy_blocks(PyObject *self, PyObject *args)
{
    (void)self;
    Py_ssize_t num_blocks, num_layers, threads;
    unsigned long long dst_ids, src_ids, dst_base, dst_stride, src_base, src_stride, sizes;
    int streaming;
    if (!PyArg_ParseTuple(args, "nnKKKKKKKpn", &num_blocks, &num_layers, &dst_ids, &src_ids,
                          &dst_base, &dst_stride, &src_base, &src_stride, &sizes, &streaming,
                          &threads))
        return NULL;
    if (num_blocks < 0 || num_layers < 1) {
        PyErr_SetString(PyExc_ValueError, "copy_blocks: need num_blocks >= 0 and num_layers >= 1");
        return NULL;
    }
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "copy_blocks: threads must be in [1, %d]", MAX_THREADS);
        return NULL;
    }
    /* pieces * (t + 1) below must not overflow either. */
    if (num_blocks > INT64_MAX / num_layers / MAX_THREADS) {
        PyErr_SetString(PyExc_OverflowError, "copy_blocks: too many pieces");
        return NULL;
    }
    int64_t pieces = (int64_t)num_blocks * num_layers;
    if (pieces == 0)
        Py_RETURN_NONE;
    if (threads > pieces)
        threads = (Py_ssize_t)pieces;
    job_t jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    job_t base = {
        .num_layers = num_layers,
        .dst_ids = (const int64_t *)(uintptr_t)dst_ids,
        .src_ids = (const int64_t *)(uintptr_t)src_ids,
        .dst_base = (const int64_t *)(uintptr_t)dst_base,
        .dst_stride = (const int64_t *)(uintptr_t)dst_stride,
        .src_base = (const int64_t *)(uintptr_t)src_base,
        .src_stride = (const int64_t *)(uintptr_t)src_stride,
        .sizes = (const int64_t *)(uintptr_t)sizes,
        .stream = streaming ? g_stream : NULL,
    };
    int joined[MAX_THREADS] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].begin = pieces * t / threads;
        jobs[t].end = pieces * (t + 1) / threads;
    }
    /* Helpers take shares 1..; this thread copies share 0, then joins them.
       A helper that cannot start has its share copied here instead. */
    for (Py_ssize_t t = 1; t < threads; t++) {
        joined[t] = pthread_create(&tids[t], NULL, run_range, &jobs[t]) == 0;
        if (!joined[t])
            run_range(&jobs[t]);
    }
    run_range(&jobs[0]);
    for (Py_ssize_t t = 1; t < threads; t++) {
        if (joined[t])
            pthread_join(tids[t], NULL);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *streaming_kind(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyUnicode_FromString(g_stream == NULL ? "none" : stream_name(g_stream));
}

static PyMethodDef methods[] = {
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "copy_blocks(num_blocks, num_layers, dst_ids, src_ids, dst_base, dst_stride, src_base, "
     "src_stride, sizes, streaming, threads): copy every layer's page of every "
     "block pair; the arrays are addresses of int64 data (see kvd_client.backends.native)."},
    {"streaming_kind", streaming_kind, METH_NOARGS,
     "The streaming-store copy this CPU uses: 'avx512', 'avx2', 'sse2' or 'none'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvd_client._blockcopy",
    "Native block copier of the CPU transfer backend.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__blockcopy(void)
{
    g_stream = best_stream();
    return PyModule_Create(&module);
}

/* Runs in the engine's scheduler process: the ready table's probe loop in C (SPEC section 15).

   The same reads as kvd_client/ready_table.py (ReadyTable.lookup and .state),
   whose module docstring pictures the layout: per key, CRC-32 (zlib) picks the
   bucket, linear probing finds it, and a bucket counts only if its sequence
   counter is even and unchanged across the read (a seqlock). One call looks up
   a whole batch of keys, so a lookup of 64 keys costs one call from Python.

   lookup(table, keys, read_tries, stale_ns) -> hits >= 0, or -1 (the first key
   that is not ready is being stored: None), or -2 (the epoch is odd or changed,
   or the daemon has not written alive_ns for stale_ns: ask the daemon). `table` is any object with the buffer protocol (the read-only
   mmap); `keys` a list of bytes. The GIL is held: the loop is short and reads
   memory only.

   x86-64 orders loads (TSO); the compiler barriers below keep the compiler
   from reordering the reads of the counter and of the bucket. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#define HEADER_BYTES 64
#define EPOCH_OFFSET 32
#define ALIVE_OFFSET 40
#define BUCKET_BYTES 72
#define KEY_OFFSET 8
#define STATE_EMPTY 0
#define STATE_STORING 1
#define STATE_READY 2
#define STATE_GONE 3

#define BARRIER() __asm__ __volatile__("" ::: "memory")

static uint64_t load64(const volatile unsigned char *p)
{
    uint64_t v;
    memcpy(&v, (const void *)p, sizeof v);
    return v;
}

static uint32_t load32(const volatile unsigned char *p)
{
    uint32_t v;
    memcpy(&v, (const void *)p, sizeof v);
    return v;
}

/* READY, STORING, or EMPTY (absent, or a bucket that kept changing: a miss). */
static int key_state(const volatile unsigned char *base, uint64_t mask, const unsigned char *key,
                     Py_ssize_t n, int tries)
{
    uint64_t i = crc32(0L, key, (uInt)n) & mask;
    for (uint64_t probes = 0; probes <= mask; probes++) {
        const volatile unsigned char *b = base + HEADER_BYTES + i * BUCKET_BYTES;
        int state = STATE_EMPTY, same = 0, settled = 0;
        for (int t = 0; t < tries; t++) {
            if (t > 0)
                __builtin_ia32_pause(); /* the writer is mid-bucket: give it a moment */
            uint32_t seq = load32(b);
            BARRIER();
            if (seq & 1)
                continue;
            state = b[4];
            same = b[5] == n && memcmp((const void *)(b + KEY_OFFSET), key, (size_t)n) == 0;
            BARRIER();
            if (load32(b) == seq) {
                settled = 1;
                break;
            }
        }
        if (!settled || state == STATE_EMPTY)
            return STATE_EMPTY;
        if (same && state != STATE_GONE) /* GONE: a tombstone; the probe goes on */
            return state;
        i = (i + 1) & mask;
    }
    return STATE_EMPTY;
}

static PyObject *lookup(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *table, *keys;
    int tries;
    unsigned long long stale_ns;
    if (!PyArg_ParseTuple(args, "OO!iK", &table, &PyList_Type, &keys, &tries, &stale_ns))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(table, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const volatile unsigned char *base = view.buf;
    if (view.len < HEADER_BYTES) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "ready table shorter than its header");
        return NULL;
    }
    uint64_t num_buckets = load64(base + 16);
    if (num_buckets == 0 || (num_buckets & (num_buckets - 1)) ||
        num_buckets > ((uint64_t)view.len - HEADER_BYTES) / BUCKET_BYTES) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "not a whole ready table");
        return NULL;
    }
    long result = 0;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); /* time.monotonic_ns()'s clock */
    uint64_t now_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    uint64_t alive_ns = load64(base + ALIVE_OFFSET);
    uint64_t epoch = load64(base + EPOCH_OFFSET);
    BARRIER();
    if ((epoch & 1) || now_ns - alive_ns > stale_ns) {
        result = -2; /* reset under way, pool dropped, or its daemon stopped writing */
    } else {
        Py_ssize_t count = PyList_GET_SIZE(keys);
        for (Py_ssize_t k = 0; k < count; k++) {
            PyObject *item = PyList_GET_ITEM(keys, k);
            if (!PyBytes_Check(item)) {
                PyBuffer_Release(&view);
                PyErr_SetString(PyExc_TypeError, "keys must be bytes");
                return NULL;
            }
            Py_ssize_t n = PyBytes_GET_SIZE(item);
            int state = n <= 64 && n > 0
                            ? key_state(base, num_buckets - 1,
                                        (const unsigned char *)PyBytes_AS_STRING(item), n, tries)
                            : STATE_EMPTY;
            if (state == STATE_READY) {
                result++;
                continue;
            }
            if (state == STATE_STORING)
                result = -1;
            break;
        }
        BARRIER();
        if (load64(base + EPOCH_OFFSET) != epoch)
            result = -2;
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
    {"lookup", lookup, METH_VARARGS,
     "lookup(table, keys, read_tries, stale_ns) -> hits, -1 (being stored: None) or -2 "
     "(reset, dropped or stale: ask the daemon); the reads of ReadyTable.lookup."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvd_client._readytable",
    "The ready table's probe loop, for lookups without a round trip.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__readytable(void) { return PyModule_Create(&module); }

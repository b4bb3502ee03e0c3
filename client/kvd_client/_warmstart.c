/* Runs in the daemon: a warm restart's per-block loops in C (SPEC section 13).

   The same work as the Python in kvd/io/region.py (SlotTable.ready_entries)
   and kvd/io/ready_table.py (ReadyTableWriter.set_states on a fresh table),
   a million blocks in well under a second instead of several. The layouts are
   those pictured in kvd_client/segment.py (the slot table) and
   kvd_client/ready_table.py (the ready table); the tests check that both
   paths give the same answer.

   scan(table, base, n) -> (slots, keys, refused, last_seq, slot_of)
     Reads the n slot-table entries at `base` of `table` (any buffer: the
     daemon's mapping of the segment's table pages). READY entries whose
     key_len is 1..64 and whose crc (zlib crc32 of key_len u8, seq u64 LE,
     the key zero-padded to 64 bytes) holds are kept, a key held by several
     kept entries going to the highest seq (on a tie, the lowest slot).
     `slots` and `keys` list the kept, oldest store first (by seq, then slot);
     `refused` lists the slots of every other READY entry; `last_seq` is the
     highest seq kept (0 if none); `slot_of` is dict(zip(keys, slots)), built
     here as the keys are made (CPython presizes a dict to 2**17 slots at
     most: it still grows a few times at 1M keys). The entries' checks run on
     up to MAX_THREADS threads (those this process may run on) without the
     GIL; each entry is read once, and what is kept comes from that copy.

   fill(table, keys, mask) -> written
     Writes each key of `keys` (at most 64 bytes; longer ones are skipped)
     READY into the empty ready table `table` (its writable mapping), whose
     epoch the caller made odd: readers ask the daemon instead until it is
     even again, so no bucket's sequence counter moves. Home bucket
     crc32(key) & mask, then linear probing to the first empty bucket. The
     keys must be distinct. They go in in the order of their home buckets, so
     the buckets a key lands in may differ from a fill in list order (any order
     makes a valid table). It runs without the GIL: other threads go on
     meanwhile, but no other writer may touch the buckets, and `keys` must be
     the caller's own list, which nothing changes until it returns. A list with
     something else than bytes in it is a TypeError, the table left as it was;
     a mask that is not a power of two less one, or that the table is too
     small for, a ValueError. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "_warmstart.h"

/* kvd_client/ready_table.py */
#define TABLE_HEADER 64
#define BUCKET_BYTES 72
#define BUCKET_KEY 8
#define STATE_EMPTY 0
#define STATE_READY 2

typedef struct {
    const unsigned char *data;
    size_t len;
    uint64_t bucket;
} fill_t;

static PyObject *fill(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer buf;
    PyObject *keys;
    unsigned long long mask;
    PyObject *mask_obj;
    if (!PyArg_ParseTuple(args, "w*O!O!", &buf, &PyList_Type, &keys, &PyLong_Type, &mask_obj))
        return NULL;
    mask = PyLong_AsUnsignedLongLong(mask_obj); /* a negative or too big mask: an error */
    if (mask == (unsigned long long)-1 && PyErr_Occurred()) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    PyObject *out = NULL;
    fill_t *items = NULL, *order = NULL;
    size_t *count = NULL;
    if (buf.len < TABLE_HEADER ||
        mask >= (unsigned long long)(buf.len - TABLE_HEADER) / BUCKET_BYTES ||
        (mask & (mask + 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "the ready table is smaller than its mask says");
        goto done;
    }
    Py_ssize_t nkeys = PyList_GET_SIZE(keys);
    if ((unsigned long long)nkeys > mask / 2 + 1) {
        PyErr_SetString(PyExc_ValueError, "more keys than the table holds at half full");
        goto done;
    }
    items = malloc(sizeof(fill_t) * (size_t)(nkeys > 0 ? nkeys : 1));
    order = malloc(sizeof(fill_t) * (size_t)(nkeys > 0 ? nkeys : 1));
    count = calloc(65536, sizeof(size_t));
    if (items == NULL || order == NULL || count == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *base = (unsigned char *)buf.buf + TABLE_HEADER;
    Py_ssize_t m = 0;
    int not_bytes = 0;
    /* Without the GIL from here on: the list and its keys only read, never
       referenced anew (the caller's reference keeps them, and the list must be
       its own: nothing may change it meanwhile; bytes never change). */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < nkeys; j++) {
        PyObject *key = PyList_GET_ITEM(keys, j);
        if (!PyBytes_Check(key)) {
            not_bytes = 1;
            break;
        }
        if (PyBytes_GET_SIZE(key) > MAX_KEY)
            continue;
        items[m].data = (const unsigned char *)PyBytes_AS_STRING(key);
        items[m].len = (size_t)PyBytes_GET_SIZE(key);
        m++;
    }
    if (!not_bytes) {
        /* Each key's home bucket, then the keys in the order of their home
           buckets' top 16 bits (a counting sort): the writes sweep the table
           once, front to back, instead of landing anywhere. */
        int bits = 0;
        while (bits < 64 && (mask >> bits) != 0)
            bits++;
        int shift = bits > 16 ? bits - 16 : 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            items[j].bucket = crc32(0L, items[j].data, (uInt)items[j].len) & mask;
            count[items[j].bucket >> shift]++;
        }
        counts_to_starts(count);
        for (Py_ssize_t j = 0; j < m; j++)
            order[count[items[j].bucket >> shift]++] = items[j];
        for (Py_ssize_t j = 0; j < m; j++) {
            uint64_t i = order[j].bucket;
            while (base[i * BUCKET_BYTES + 4] != STATE_EMPTY)
                i = (i + 1) & mask;
            unsigned char *b = base + i * BUCKET_BYTES;
            memcpy(b + BUCKET_KEY, order[j].data, order[j].len);
            b[5] = (unsigned char)order[j].len;
            b[4] = STATE_READY;
        }
    }
    Py_END_ALLOW_THREADS
    if (not_bytes) {
        PyErr_SetString(PyExc_TypeError, "fill() takes a list of bytes");
        goto done;
    }
    out = PyLong_FromSsize_t(m);
done:
    free(items);
    free(order);
    free(count);
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", warmstart_scan, METH_VARARGS,
     "scan(table, base, n) -> (slots, keys, refused, last_seq, slot_of): the READY slot-table "
     "entries whose crc holds, oldest first; SlotTable.ready_entries's reads."},
    {"fill", fill, METH_VARARGS,
     "fill(table, keys, mask) -> written: each key READY in an empty ready table."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvd_client._warmstart",
    "A warm restart's per-block loops: the slot-table scan and the ready-table fill.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__warmstart(void) { return PyModule_Create(&module); }

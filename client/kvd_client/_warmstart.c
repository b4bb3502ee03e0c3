/* Runs in the daemon: a warm restart's per-block loops in C (SPEC section 13).

   The same work as the Python in kvd/io/region.py (SlotTable.ready_entries)
   and kvd/io/ready_table.py (ReadyTableWriter.set_states on a fresh table),
   a million blocks in well under a second instead of several. The layouts are
   those pictured in kvd_client/segment.py (the slot table) and
   kvd_client/ready_table.py (the ready table); the tests check that both
   paths give the same answer.

   scan(table, base, n) -> (slots, keys, refused, last_seq)
     Reads the n slot-table entries at `base` of `table` (any buffer: the
     daemon's mapping of the segment's table pages). READY entries whose
     key_len is 1..64 and whose crc (zlib crc32 of key_len u8, seq u64 LE,
     the key zero-padded to 64 bytes) holds are kept, a key held by several
     kept entries going to the highest seq (on a tie, the lowest slot).
     `slots` and `keys` list the kept, oldest store first (by seq, then slot);
     `refused` lists the slots of every other READY entry; `last_seq` is the
     highest seq kept (0 if none).

   fill(table, keys, mask) -> written
     Writes each key of `keys` (at most 64 bytes; longer ones are skipped)
     READY into the empty ready table `table`, the writable mapping of a table
     no reader has seen yet (so no sequence counter moves): bucket
     crc32(key) & mask, then linear probing to the first empty bucket. The
     keys must be distinct. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

/* kvd_client/segment.py */
#define ENTRY_BYTES 80
#define ENTRY_READY 1
#define ENTRY_CRC 4
#define ENTRY_SEQ 8
#define ENTRY_KEY 16
#define MAX_KEY 64
/* kvd_client/ready_table.py */
#define TABLE_HEADER 64
#define BUCKET_BYTES 72
#define BUCKET_KEY 8
#define STATE_EMPTY 0
#define STATE_READY 2

typedef struct {
    uint64_t seq;
    Py_ssize_t slot;
    unsigned int klen; /* read once: the table may change under a hostile mapper */
} kept_t;

static int by_seq_then_slot(const void *a, const void *b)
{
    const kept_t *x = a, *y = b;
    if (x->seq != y->seq)
        return x->seq < y->seq ? -1 : 1;
    return (x->slot > y->slot) - (x->slot < y->slot);
}

static uint64_t read_u64le(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t read_u32le(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* FNV-1a, 64 bits: a hash for the set of kept keys, not part of any format. */
static uint64_t key_hash(const unsigned char *p, unsigned int n)
{
    uint64_t h = 1469598103934665603ULL;
    for (unsigned int i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

static int append_slot(PyObject *list, Py_ssize_t slot)
{
    PyObject *v = PyLong_FromSsize_t(slot);
    if (v == NULL)
        return -1;
    int rc = PyList_Append(list, v);
    Py_DECREF(v);
    return rc;
}

static PyObject *scan(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer buf;
    Py_ssize_t base, n;
    if (!PyArg_ParseTuple(args, "y*nn", &buf, &base, &n))
        return NULL;
    PyObject *slots = NULL, *keys = NULL, *refused = NULL, *out = NULL;
    kept_t *kept = NULL;
    Py_ssize_t *set = NULL;
    if (base < 0 || n < 0 || n > (buf.len - base) / ENTRY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "the slot table lies outside the buffer");
        goto done;
    }
    kept = malloc(sizeof(kept_t) * (size_t)(n > 0 ? n : 1));
    refused = PyList_New(0);
    if (kept == NULL || refused == NULL) {
        if (kept == NULL)
            PyErr_NoMemory();
        goto done;
    }
    const unsigned char *table = (const unsigned char *)buf.buf + base;
    Py_ssize_t m = 0;
    for (Py_ssize_t slot = 0; slot < n; slot++) {
        const unsigned char *e = table + slot * ENTRY_BYTES;
        if (e[0] != ENTRY_READY)
            continue;
        unsigned int klen = e[1];
        int good = 0;
        if (klen >= 1 && klen <= MAX_KEY) {
            unsigned char body[1 + 8 + MAX_KEY] = {0};
            body[0] = (unsigned char)klen;
            memcpy(body + 1, e + ENTRY_SEQ, 8);
            memcpy(body + 9, e + ENTRY_KEY, klen);
            good = (uint32_t)crc32(0L, body, sizeof body) == read_u32le(e + ENTRY_CRC);
        }
        if (good) {
            kept[m].seq = read_u64le(e + ENTRY_SEQ);
            kept[m].slot = slot;
            kept[m].klen = klen;
            m++;
        } else if (append_slot(refused, slot) < 0) {
            goto done;
        }
    }
    qsort(kept, (size_t)m, sizeof(kept_t), by_seq_then_slot);
    /* Newest first: a key's first entry met wins. Runs of equal seq are walked
       from their lowest slot, so on a tie the lowest slot wins. A key is looked
       for in an open-addressing set of kept entries (indexes into `kept`). */
    size_t cap = 16;
    while (cap < 2 * (size_t)m)
        cap <<= 1;
    set = malloc(sizeof(Py_ssize_t) * cap);
    if (set == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t c = 0; c < cap; c++)
        set[c] = -1;
    Py_ssize_t winners = 0;
    Py_ssize_t i = m;
    while (i > 0) {
        Py_ssize_t run_end = i, run_start = i - 1;
        while (run_start > 0 && kept[run_start - 1].seq == kept[i - 1].seq)
            run_start--;
        for (Py_ssize_t j = run_start; j < run_end; j++) { /* lowest slot first */
            const unsigned char *e = table + kept[j].slot * ENTRY_BYTES;
            unsigned int klen = kept[j].klen;
            size_t c = (size_t)key_hash(e + ENTRY_KEY, klen) & (cap - 1);
            int dup = 0;
            while (set[c] >= 0) {
                const kept_t *other = &kept[set[c]];
                const unsigned char *o = table + other->slot * ENTRY_BYTES;
                if (other->klen == klen && memcmp(o + ENTRY_KEY, e + ENTRY_KEY, klen) == 0) {
                    dup = 1;
                    break;
                }
                c = (c + 1) & (cap - 1);
            }
            if (dup) {
                if (append_slot(refused, kept[j].slot) < 0)
                    goto done;
                kept[j].slot = -1; /* dropped */
            } else {
                set[c] = j;
                winners++;
            }
        }
        i = run_start;
    }
    slots = PyList_New(winners);
    keys = PyList_New(winners);
    if (slots == NULL || keys == NULL)
        goto done;
    uint64_t last_seq = 0;
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        if (kept[j].slot < 0)
            continue;
        const unsigned char *e = table + kept[j].slot * ENTRY_BYTES;
        PyObject *slot = PyLong_FromSsize_t(kept[j].slot);
        PyObject *key = PyBytes_FromStringAndSize((const char *)e + ENTRY_KEY, kept[j].klen);
        if (slot == NULL || key == NULL) {
            Py_XDECREF(slot);
            Py_XDECREF(key);
            goto done;
        }
        PyList_SET_ITEM(slots, k, slot);
        PyList_SET_ITEM(keys, k, key);
        last_seq = kept[j].seq;
        k++;
    }
    out = Py_BuildValue("(OOOK)", slots, keys, refused, (unsigned long long)last_seq);
done:
    free(kept);
    free(set);
    Py_XDECREF(slots);
    Py_XDECREF(keys);
    Py_XDECREF(refused);
    PyBuffer_Release(&buf);
    return out;
}

static PyObject *fill(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer buf;
    PyObject *keys;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "w*O!K", &buf, &PyList_Type, &keys, &mask))
        return NULL;
    PyObject *out = NULL;
    if (buf.len < TABLE_HEADER ||
        (unsigned long long)(buf.len - TABLE_HEADER) / BUCKET_BYTES < mask + 1) {
        PyErr_SetString(PyExc_ValueError, "the ready table is smaller than its mask says");
        goto done;
    }
    unsigned char *base = (unsigned char *)buf.buf + TABLE_HEADER;
    Py_ssize_t written = 0, nkeys = PyList_GET_SIZE(keys);
    if ((unsigned long long)nkeys > mask / 2 + 1) {
        PyErr_SetString(PyExc_ValueError, "more keys than the table holds at half full");
        goto done;
    }
    for (Py_ssize_t j = 0; j < nkeys; j++) {
        PyObject *key = PyList_GET_ITEM(keys, j);
        char *data;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(key, &data, &len) < 0)
            goto done;
        if (len > MAX_KEY)
            continue;
        uint64_t i = crc32(0L, (const unsigned char *)data, (uInt)len) & mask;
        while (base[i * BUCKET_BYTES + 4] != STATE_EMPTY)
            i = (i + 1) & mask;
        unsigned char *b = base + i * BUCKET_BYTES;
        memcpy(b + BUCKET_KEY, data, (size_t)len);
        b[5] = (unsigned char)len;
        b[4] = STATE_READY;
        written++;
    }
    out = PyLong_FromSsize_t(written);
done:
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(table, base, n) -> (slots, keys, refused, last_seq): the READY slot-table "
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

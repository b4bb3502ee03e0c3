/* Runs in the daemon: a warm restart's slot-table scan, `kvd_client._warmstart.scan`.

   What it answers is in _warmstart.c, the module's other half. */

#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "_warmstart.h"

/* kvd_client/segment.py */
#define ENTRY_BYTES 80
#define ENTRY_READY 1
#define ENTRY_CRC 4
#define ENTRY_SEQ 8
#define ENTRY_KEY 16

/* A kept entry: what was read of it once, when its crc was checked (the
   table may change under a hostile mapper meanwhile: nothing is read twice). */
typedef struct {
    uint64_t seq;
    Py_ssize_t slot;
    const unsigned char *key; /* its copy, in the scan's key store */
    unsigned int klen;
} kept_t;

typedef struct {
    Py_ssize_t j; /* into kept */
    uint64_t hash;
} visit_t;

#define PREFETCH 16

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

/* A hash for the set of kept keys, not part of any format: the key's 8-byte
   words, each folded in with a multiply (the mixers of MurmurHash3's fmix64). */
static uint64_t key_hash(const unsigned char *p, unsigned int n)
{
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ n;
    unsigned int i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, p + i, n - i);
        h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    }
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    return h;
}

/* Sorts `kept` (in slot order) by seq, stably, so that equal seqs stay in
   slot order: nothing to do when the seqs already rise (entries written in
   slot order), else an LSD radix sort, 16 bits a pass, as many passes as the
   highest seq needs. -1 when out of memory. */
static int sort_by_seq(kept_t *kept, Py_ssize_t m)
{
    uint64_t top = 0;
    int sorted = 1;
    for (Py_ssize_t j = 0; j < m; j++) {
        if (j > 0 && kept[j].seq < kept[j - 1].seq)
            sorted = 0;
        if (kept[j].seq > top)
            top = kept[j].seq;
    }
    if (sorted)
        return 0;
    kept_t *tmp = malloc(sizeof(kept_t) * (size_t)m);
    size_t *count = malloc(sizeof(size_t) * 65536);
    if (tmp == NULL || count == NULL) {
        free(tmp);
        free(count);
        return -1;
    }
    kept_t *from = kept, *to = tmp;
    for (int shift = 0; shift < 64 && (top >> shift) != 0; shift += 16) {
        memset(count, 0, sizeof(size_t) * 65536);
        for (Py_ssize_t j = 0; j < m; j++)
            count[(from[j].seq >> shift) & 0xFFFF]++;
        counts_to_starts(count);
        for (Py_ssize_t j = 0; j < m; j++)
            to[count[(from[j].seq >> shift) & 0xFFFF]++] = from[j];
        kept_t *t = from;
        from = to;
        to = t;
    }
    if (from != kept)
        memcpy(kept, from, sizeof(kept_t) * (size_t)m);
    free(tmp);
    free(count);
    return 0;
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

/* One thread's share of the entries' checks: slots lo..hi-1. */
typedef struct {
    const unsigned char *table;
    Py_ssize_t lo, hi;
    kept_t *kept; /* room for hi - lo */
    unsigned char *keys; /* room for (hi - lo) * MAX_KEY: the kept keys' copies, packed */
    Py_ssize_t num_kept;
    Py_ssize_t *bad; /* room for hi - lo: READY entries that failed */
    Py_ssize_t num_bad;
} check_t;

#define MAX_THREADS 8
#define MIN_PER_THREAD 65536

static void *check_range(void *arg)
{
    check_t *c = arg;
    c->num_kept = c->num_bad = 0;
    unsigned char *store = c->keys;
    for (Py_ssize_t slot = c->lo; slot < c->hi; slot++) {
        const unsigned char *e = c->table + slot * ENTRY_BYTES;
        if (e[0] != ENTRY_READY)
            continue;
        unsigned int klen = e[1];
        int good = 0;
        unsigned char body[1 + 8 + MAX_KEY] = {0};
        if (klen >= 1 && klen <= MAX_KEY) {
            body[0] = (unsigned char)klen;
            memcpy(body + 1, e + ENTRY_SEQ, 8);
            memcpy(body + 9, e + ENTRY_KEY, klen);
            good = (uint32_t)crc32(0L, body, sizeof body) == read_u32le(e + ENTRY_CRC);
        }
        if (good) { /* what the crc covered, from the copy it was computed on */
            kept_t *k = &c->kept[c->num_kept++];
            k->seq = read_u64le(body + 1);
            k->slot = slot;
            k->klen = klen;
            memcpy(store, body + 9, klen);
            k->key = store;
            store += klen;
        } else {
            c->bad[c->num_bad++] = slot;
        }
    }
    return NULL;
}

PyObject *warmstart_scan(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer buf;
    Py_ssize_t base, n;
    if (!PyArg_ParseTuple(args, "y*nn", &buf, &base, &n))
        return NULL;
    PyObject *slots = NULL, *keys = NULL, *refused = NULL, *slot_of = NULL, *out = NULL;
    kept_t *kept = NULL;
    Py_ssize_t *bad = NULL;
    unsigned char *keystore = NULL;
    uint64_t *set = NULL;
    visit_t *visit = NULL;
    if (base < 0 || n < 0 || n > (buf.len - base) / ENTRY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "the slot table lies outside the buffer");
        goto done;
    }
    if (n >= 0xFFFFFFFFLL) { /* an index into `kept` + 1 fits 32 bits */
        PyErr_SetString(PyExc_ValueError, "a slot table of 2**32 - 1 entries or more");
        goto done;
    }
    kept = malloc(sizeof(kept_t) * (size_t)(n > 0 ? n : 1));
    bad = malloc(sizeof(Py_ssize_t) * (size_t)(n > 0 ? n : 1));
    /* Room for every key at its longest; only the pages the keys use are touched. */
    keystore = malloc((size_t)MAX_KEY * (size_t)(n > 0 ? n : 1));
    refused = PyList_New(0);
    if (kept == NULL || bad == NULL || keystore == NULL || refused == NULL) {
        if (refused != NULL)
            PyErr_NoMemory();
        goto done;
    }
    const unsigned char *table = (const unsigned char *)buf.buf + base;
    /* The entries' checks, in slot ranges on up to MAX_THREADS threads without
       the GIL; each range's kept entries then follow the one before's. */
    int nthreads = 1;
    cpu_set_t allowed;
    long cpus = sched_getaffinity(0, sizeof allowed, &allowed) == 0 ? CPU_COUNT(&allowed) : 1;
    while (nthreads < MAX_THREADS && nthreads < cpus && (Py_ssize_t)nthreads * MIN_PER_THREAD < n)
        nthreads++;
    check_t parts[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < nthreads; t++) {
        parts[t].table = table;
        parts[t].lo = n * t / nthreads;
        parts[t].hi = n * (t + 1) / nthreads;
        parts[t].kept = kept + parts[t].lo;
        parts[t].bad = bad + parts[t].lo;
        parts[t].keys = keystore + (size_t)parts[t].lo * MAX_KEY;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&threads[t], NULL, check_range, &parts[t]) == 0;
    check_range(&parts[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t])
            pthread_join(threads[t], NULL);
        else
            check_range(&parts[t]); /* no thread to be had: here, then */
    }
    Py_END_ALLOW_THREADS
    Py_ssize_t m = 0;
    for (int t = 0; t < nthreads; t++) {
        memmove(kept + m, parts[t].kept, sizeof(kept_t) * (size_t)parts[t].num_kept);
        m += parts[t].num_kept;
        for (Py_ssize_t i = 0; i < parts[t].num_bad; i++)
            if (append_slot(refused, parts[t].bad[i]) < 0)
                goto done;
    }
    if (sort_by_seq(kept, m) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    /* Newest first: a key's first entry met wins. Runs of equal seq are walked
       from their lowest slot, so on a tie the lowest slot wins. A key is looked
       for in an open-addressing set of kept entries: each bucket holds 1 + the
       index into `kept` (0: empty) in its low 32 bits and the top 32 bits of
       the key's hash above, so that only a key of equal hash is compared. */
    size_t cap = 16;
    while (cap < 2 * (size_t)m)
        cap <<= 1;
    set = calloc(cap, sizeof(uint64_t));
    if (set == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* The order of the walk, and each key's hash, first: the walk then asks
       for the set's bucket of the key PREFETCH places ahead, so that the
       buckets' cache misses overlap instead of coming one after another. */
    visit = malloc(sizeof(visit_t) * (size_t)(m > 0 ? m : 1));
    if (visit == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t v = 0, i = m;
    while (i > 0) {
        Py_ssize_t run_start = i - 1;
        while (run_start > 0 && kept[run_start - 1].seq == kept[i - 1].seq)
            run_start--;
        for (Py_ssize_t j = run_start; j < i; j++) { /* lowest slot first */
            visit[v].j = j;
            visit[v].hash = key_hash(kept[j].key, kept[j].klen);
            v++;
        }
        i = run_start;
    }
    Py_ssize_t winners = 0;
    for (v = 0; v < m; v++) {
        if (v + PREFETCH < m)
            __builtin_prefetch(&set[visit[v + PREFETCH].hash & (cap - 1)], 1);
        Py_ssize_t j = visit[v].j;
        unsigned int klen = kept[j].klen;
        uint64_t tag = visit[v].hash & 0xFFFFFFFF00000000ULL;
        size_t c = (size_t)visit[v].hash & (cap - 1);
        int dup = 0;
        while (set[c] != 0) {
            if ((set[c] & 0xFFFFFFFF00000000ULL) == tag) {
                const kept_t *other = &kept[(set[c] & 0xFFFFFFFFULL) - 1];
                if (other->klen == klen && memcmp(other->key, kept[j].key, klen) == 0) {
                    dup = 1;
                    break;
                }
            }
            c = (c + 1) & (cap - 1);
        }
        if (dup) {
            if (append_slot(refused, kept[j].slot) < 0)
                goto done;
            kept[j].slot = -1; /* dropped */
        } else {
            set[c] = tag | (uint64_t)(j + 1);
            winners++;
        }
    }
    slots = PyList_New(winners);
    keys = PyList_New(winners);
    /* Presized as far as CPython goes (2**17 slots). */
#if PY_VERSION_HEX < 0x030D0000
    slot_of = _PyDict_NewPresized(winners);
#else
    slot_of = PyDict_New(); /* the presizing call is internal from 3.13 on */
#endif
    if (slots == NULL || keys == NULL || slot_of == NULL)
        goto done;
    uint64_t last_seq = 0;
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        if (kept[j].slot < 0)
            continue;
        PyObject *slot = PyLong_FromSsize_t(kept[j].slot);
        PyObject *key = PyBytes_FromStringAndSize((const char *)kept[j].key, kept[j].klen);
        if (slot == NULL || key == NULL) {
            Py_XDECREF(slot);
            Py_XDECREF(key);
            goto done;
        }
        PyList_SET_ITEM(slots, k, slot);
        PyList_SET_ITEM(keys, k, key);
        if (PyDict_SetItem(slot_of, key, slot) < 0)
            goto done;
        last_seq = kept[j].seq;
        k++;
    }
    out = Py_BuildValue("(OOOKO)", slots, keys, refused, (unsigned long long)last_seq, slot_of);
done:
    free(kept);
    free(bad);
    free(keystore);
    free(set);
    free(visit);
    Py_XDECREF(slots);
    Py_XDECREF(keys);
    Py_XDECREF(refused);
    Py_XDECREF(slot_of);
    PyBuffer_Release(&buf);
    return out;
}

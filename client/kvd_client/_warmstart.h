/* Runs in the daemon: the two halves of `kvd_client._warmstart` (_warmstart.c, _warmscan.c). */

#ifndef KVD_WARMSTART_H
#define KVD_WARMSTART_H

#include <Python.h>

/* kvd_client/segment.py, kvd_client/ready_table.py: the longest key. */
#define MAX_KEY 64

/* Turns the counts of a counting sort's 65,536 bins into each bin's first
   place (an exclusive prefix sum). */
static inline void counts_to_starts(size_t *count)
{
    size_t at = 0;
    for (size_t d = 0; d < 65536; d++) {
        size_t c = count[d];
        count[d] = at;
        at += c;
    }
}

/* scan(table, base, n): see _warmstart.c. */
PyObject *warmstart_scan(PyObject *self, PyObject *args);

#endif

/* Runs in the daemon: the two halves of `kvd_client._warmstart` (_warmstart.c, _warmscan.c). */

#ifndef KVD_WARMSTART_H
#define KVD_WARMSTART_H

#include <Python.h>

/* kvd_client/segment.py, kvd_client/ready_table.py: the longest key. */
#define MAX_KEY 64

/* scan(table, base, n): see _warmstart.c. */
PyObject *warmstart_scan(PyObject *self, PyObject *args);

#endif

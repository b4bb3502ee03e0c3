"""Runs in the daemon (pure core): the index, its policies, ownership and the job state machine.

Nothing in this folder does I/O: no sockets, files, clocks, threads or
processes (`tests/unit/test_purity.py` walks the folder to prove it). From
`kvd_client` it takes only wire-free types (`kvd_client.errors`,
`kvd_client.types`); the shell around it (`kvd.control`, `kvd.io`) turns
requests into calls and results into replies.

- `index`: `BlockIndex` and its eviction policies (SPEC section 4)
- `ownership`: `OwnedIndex`, who prepared which store and pinned which block
- `jobs`: the transfer-job state machine, reported vs settled (SPEC section 5)
"""

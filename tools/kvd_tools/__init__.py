"""Runs in the operator's shell and in tests: kvd's operator tools (distribution `kvd-tools`).

They need torch and numpy, which the daemon never does, so they install apart
from it (`pip install ./tools`, or `kvd-tools` from an index):

- `bench`: `kvd bench SUITE` (SPEC section 10)
- `demo`: `kvd demo`, a small TP inference engine that caches in kvd
- `soak`: the daemon under faults (`kvd bench soak`)
- `launcher`: a kvd daemon as a child process, with the flags tests use
- `harness`: the engine side that the demo, the soak and the tests share
"""

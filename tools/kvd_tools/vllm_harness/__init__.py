"""Runs in the tests' and `kvd bench vllm`'s processes: real vLLM engines for kvd's plug-in.

`engine` runs inside a vLLM engine child; `driver` starts and drives one from
the parent; `offload_config` builds vLLM's `OffloadingConfig` without an
engine, as vLLM's own tests do. Importing this package imports no vLLM.
"""

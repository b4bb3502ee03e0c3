"""Runs in the operator's shell: `kvd bench` suites (SPEC section 10)."""

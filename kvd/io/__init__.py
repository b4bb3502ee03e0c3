"""Runs in the daemon: the event loop and the OS resources it owns.

The control socket and its frames (`server`), the KV-event publisher
(`events`), Prometheus metrics (`metrics`), systemd notifications (`notify`)
and the shared-memory segments (`region`).
"""

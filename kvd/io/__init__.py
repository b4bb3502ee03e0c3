"""Runs in the daemon: the event loop and the OS resources it owns.

The event loop (`server`), the control socket (`control_socket`), the KV-event publisher
(`events`), Prometheus metrics (`metrics`), systemd notifications (`notify`)
and the shared-memory segments (`region`).
"""

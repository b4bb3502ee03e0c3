"""Runs in the daemon: the handlers of typed requests, sessions, pools and transfers.

No sockets here: `kvd.io.server` feeds frames in and sends what the handlers
leave in their outbox; clocks come in as `now`.
"""

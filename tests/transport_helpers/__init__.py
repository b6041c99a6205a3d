"""Helpers for tests/transport/test_transport.py: a peer process and the echo behaviour it shares
with agents created inside the test process."""

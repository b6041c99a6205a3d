"""The RRef protocol, sans I/O: ids, the message table, and the RRef context with its drops, records and audit.

Nothing here sends, waits or starts a thread: the context takes an event, updates its maps
under one lock and returns the actions (messages) its caller performs after releasing it.
"""

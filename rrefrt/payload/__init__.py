"""Payload bytes: how values become frames and back (serialization, the buffer codecs for
tensors and arrays, device maps and placement, the lazy torch import).

Never imports the runtime, the API or the transport.
"""

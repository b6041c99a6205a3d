"""The ZeroMQ transport: one ROUTER socket per process, its data loop, the mesh of
peers, heartbeats over an echo socket, CURVE security and the join policy.
"""

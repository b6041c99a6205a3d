"""Group discovery: the rendezvous store (server, client and wire), torch's store as an
alternative, the static rendezvous, the environment contract shared with launchers, and
dynamic membership (workers that join and leave a running group).
"""

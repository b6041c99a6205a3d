"""Running torch's own RPC test suite against rrefrt through a module alias (see suite.py)."""

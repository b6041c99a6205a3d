"""The launcher's view of the environment contract: re-exported from ``rrefrt.group.environment``
(standard library only), which the runtime also reads. The runtime never imports the
launcher; the launcher may import the contract."""

from rrefrt.group.environment import EnvError, detect_engine, expand_hostlist, hosted_store, resolve_env

__all__ = ["EnvError", "resolve_env", "detect_engine", "hosted_store", "expand_hostlist"]

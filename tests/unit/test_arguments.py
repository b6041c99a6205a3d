"""Bad arguments fail at once, with an ArgumentError naming the argument (rrefrt/arguments.py):
RpcBackendOptions, init_rpc and shutdown, without a group (issue 21 item 4). The calls'
own arguments are checked against a running group in tests/cluster/test_rpc.py."""

from __future__ import annotations

import enum
import math
import time

import numpy as np
import pytest

import rrefrt
from rrefrt.errors import ArgumentError
from tests.support import free_port

pytestmark = pytest.mark.timeout(60)

#: option, bad value, a phrase of the message
BAD_OPTIONS = [
    ("rpc_timeout", math.nan, "finite"),
    ("rpc_timeout", math.inf, "finite"),
    ("rpc_timeout", -1.0, ">= 0"),
    ("rpc_timeout", True, "number of seconds"),
    ("rpc_timeout", "60", "incompatible constructor arguments"),
    ("init_timeout", math.nan, "finite"),
    ("init_timeout", math.inf, "finite"),
    ("init_timeout", 0, "> 0"),
    ("init_timeout", False, "number of seconds"),
    ("shutdown_timeout", math.nan, "finite"),
    ("shutdown_timeout", -math.inf, "finite"),
    ("shutdown_timeout", 0, "> 0"),
    ("heartbeat_interval", math.nan, "finite"),
    ("heartbeat_interval", math.inf, "finite"),
    ("heartbeat_interval", 0, "> 0"),
    ("heartbeat_interval", 5.0, "at least twice heartbeat_interval"),  # with the default timeout 3 s
    ("heartbeat_timeout", 1.0, "at least twice heartbeat_interval"),  # with the default interval 1 s
    ("heartbeat_timeout", math.inf, "finite"),
    ("heartbeat_timeout", "3", "number of seconds"),
    ("num_worker_threads", 0, ">= 1"),
    ("num_worker_threads", -4, ">= 1"),
    ("num_worker_threads", True, "a bool"),
    ("num_worker_threads", 4.0, "an int"),
    ("num_worker_threads", "4", "an int"),
    ("max_message_size", -1, "bytes > 0"),
    ("max_message_size", 0, "bytes > 0"),
    ("max_message_size", 1e9, "bytes > 0"),
    ("max_message_size", True, "a bool"),
    ("strict_rref_leaks", "false", "True or False"),
    ("strict_rref_leaks", 2, "True or False"),
    ("devices", "cuda:0", "list of devices"),
    ("device_maps", [("w1", {0: 1})], "dict"),
    ("secret", "", "non-empty"),
    ("unpickle_allowlist", "mod.fn", "module.qualname"),
]


@pytest.mark.parametrize("option, value, phrase", BAD_OPTIONS, ids=lambda x: repr(x)[:30])
def test_a_bad_option_is_refused_at_construction_naming_it(option, value, phrase):
    with pytest.raises(ArgumentError, match=option) as info:
        rrefrt.RpcBackendOptions(**{option: value})
    assert phrase in str(info.value), str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_the_heartbeat_rule_is_checked_on_the_pair():
    with pytest.raises(ArgumentError, match=r"heartbeat_timeout \(1.0 s\) must be at least twice heartbeat_interval \(5.0 s\)"):
        rrefrt.RpcBackendOptions(heartbeat_interval=5, heartbeat_timeout=1)
    opts = rrefrt.RpcBackendOptions(heartbeat_interval=0.2, heartbeat_timeout=0.4)  # twice: the least
    assert (opts.heartbeat_interval, opts.heartbeat_timeout) == (0.2, 0.4)


def test_good_options_take_their_canonical_form():
    opts = rrefrt.RpcBackendOptions(
        rpc_timeout=np.float32(2.5), init_timeout=10, num_worker_threads=np.int64(4), max_message_size=np.int32(1 << 20),
        strict_rref_leaks=1, devices=("cpu",), unpickle_allowlist=(n for n in ["os.path.join"]),
    )
    assert opts.rpc_timeout == 2.5 and type(opts.rpc_timeout) is float
    assert opts.init_timeout == 10.0 and type(opts.init_timeout) is float
    assert opts.num_worker_threads == 4 and type(opts.num_worker_threads) is int
    assert opts.max_message_size == 1 << 20 and type(opts.max_message_size) is int
    assert opts.strict_rref_leaks is True and opts.devices == ["cpu"]
    assert opts.unpickle_allowlist == ["os.path.join"]  # a generator is read once, not emptied
    assert rrefrt.RpcBackendOptions(rpc_timeout=0).rpc_timeout == 0.0  # 0: no timeout


class _TorchLikeBackend(enum.Enum):  # torch's BackendType is an enum built at run time
    TENSORPIPE = 1
    OTHER = 2


#: init_rpc keyword, bad value, the argument the message names
BAD_INIT = [
    ("backend", "bogus", "Argument backend must be a member of BackendType"),
    ("backend", "TENSORPIPE", "Argument backend must be a member of BackendType"),  # torch refuses a string too
    ("backend", _TorchLikeBackend.OTHER, "Argument backend"),
    ("rank", "0", "rank must be an int"),
    ("rank", 0.0, "rank must be an int"),
    ("rank", True, "rank must be an int"),
    ("rank", -2, "rank must be an int >= 0"),
    ("world_size", 2.0, "world_size must be an int"),
    ("world_size", 0, "world_size must be an int >= 1"),
    ("world_size", "2", "world_size must be an int"),
    ("world_size", True, "world_size must be an int"),
]


@pytest.mark.parametrize("arg, value, phrase", BAD_INIT, ids=lambda x: repr(x)[:30])
def test_a_bad_init_rpc_argument_is_refused_at_once(arg, value, phrase):
    # before this check, rank=0.0 waited the whole init_timeout ("rank(s) 0 never joined")
    kwargs = {"rank": 0, "world_size": 1, arg: value}
    opts = rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}", init_timeout=20)
    t0 = time.monotonic()
    with pytest.raises(ArgumentError) as info:
        rrefrt.init_rpc("w0", rpc_backend_options=opts, **kwargs)
    assert phrase in str(info.value), str(info.value)
    assert time.monotonic() - t0 < 2.0
    assert rrefrt.state.current_or_none() is None


def test_init_rpc_checks_options_set_after_construction():
    opts = rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}", init_timeout=20)
    opts.rpc_timeout = math.nan
    with pytest.raises(ArgumentError, match="rpc_timeout must be a finite number"):
        rrefrt.init_rpc("w0", rank=0, world_size=1, rpc_backend_options=opts)
    assert rrefrt.state.current_or_none() is None


def test_init_rpc_takes_torchs_backend_member_and_numpy_ranks():
    opts = rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}", init_timeout=20)
    rrefrt.init_rpc("w0", backend=_TorchLikeBackend.TENSORPIPE, rank=np.int64(0), world_size=np.int32(1),
                    rpc_backend_options=opts)
    try:
        assert rrefrt.get_worker_info() == rrefrt.WorkerInfo("w0", 0) and type(rrefrt.get_worker_info().id) is int
    finally:
        rrefrt.shutdown()


@pytest.mark.parametrize("kwargs, phrase", [
    ({"timeout": math.nan}, "timeout must be a finite number"),
    ({"timeout": math.inf}, "timeout must be a finite number"),
    ({"timeout": "5"}, "timeout must be a number of seconds"),
    ({"graceful": "no"}, "graceful must be True or False"),
], ids=str)
def test_bad_shutdown_arguments_are_refused(kwargs, phrase):
    with pytest.raises(ArgumentError, match=phrase):
        rrefrt.shutdown(**kwargs)

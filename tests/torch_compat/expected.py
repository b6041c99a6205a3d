"""Which of torch's RPC tests rrefrt is expected to fail, and why; what CI runs.

Data only (read by tests/test_torch_compat.py and tests/torch_compat/report.py). Keys are
"Class.test" with Class one of RpcTest, TensorPipeAgentRpcTest (torch's names).
Every entry has a cause (one of CAUSES) and a one-line reason. When a fix lands and a test
passes, delete its entry (the full run reports it as "now passes") and consider adding it to
CI_PASSING. Measured on torch 2.13.0+cpu: docs/compatibility.md has the table.
"""

from __future__ import annotations

#: cause -> outlook. "being fixed": other work of issue 12 is expected to flip these tests.
CAUSES: dict[str, str] = {
    "futures-interop": "being fixed (issue 12 item 1): rrefrt futures accepted by torch.futures.wait_all/collect_all",
    "future-semantics": "being fixed (items 2, 11): torch's Future checks and exception types",
    "async-proxy": "being fixed (item 3): @async_execution through RRef proxies",
    "rref-details": "being fixed (items 6, 8, 12): RRef helpers and details torch programs use",
    "error-texts": "being fixed (item 7): torch's phrases inside rrefrt's messages",
    "error-types": "being fixed (item 11): torch's exception types (a subclass of both is fine)",
    "tensor-layout": "open (item 5): keep strides of non-contiguous tensors",
    "dist-autograd": "until distributed autograd lands (being built separately)",
    "profiling": "open (item 8): RPC events in torch.autograd.profiler; expected to differ until then",
    "torchscript": "expected to differ: rrefrt does not run TorchScript RPC",
    "private": "expected to differ: the test calls private torch.distributed.rpc internals",
    "rref-format": "expected to differ: rrefrt prints RRef ids as <worker id>:<n> (API.md), torch as GloballyUniqueId(created_on=.., local_id=..)",
    "one-backend": "expected to differ: rrefrt has one backend, there is nothing to infer or mismatch",
    "worker-info": "open: WorkerInfo could validate names as torch does",
    "logging": "expected to differ: rrefrt logs through logging and adds no handler",
}

EXPECTED_TO_DIFFER: dict[str, tuple[str, str]] = {}


def _group(cause: str, reason: str, *names: str) -> None:
    assert cause in CAUSES, cause
    for name in names:
        EXPECTED_TO_DIFFER[name] = (cause, reason)


_group(
    'futures-interop',
    'torch.futures.wait_all/collect_all (torch._C._collect_all) reject rrefrt futures',
    'RpcTest.test_future_wait_twice',
    'RpcTest.test_graceful_shutdown_with_uneven_workload',
    'RpcTest.test_my_parameter_server',
    'RpcTest.test_py_tensors_multi_async_call',
    'RpcTest.test_stress_heavy_rpc',
    'RpcTest.test_stress_light_rpc',
    'RpcTest.test_wait_all_exit_early_builtin',
    'RpcTest.test_wait_all_exit_early_python',
    'RpcTest.test_wait_all_with_exception',
    'RpcTest.test_wait_all_with_partial_exception',
    'TensorPipeAgentRpcTest.test_my_parameter_server_sparse',
    'TensorPipeAgentRpcTest.test_stress_heavy_rpc_sparse',
)
_group(
    'future-semantics',
    "@async_execution returning a non-Future raises TypeError, torch raises RuntimeError('Functions decorated with @rpc.async_function must return a torch.futures.Future')",
    'RpcTest.test_async_function_wrong_return_type',
    'RpcTest.test_async_function_wrong_return_type_async',
    'RpcTest.test_async_function_wrong_return_type_remote',
)
_group(
    'future-semantics',
    'Future.then(None) / a callback of the wrong signature must raise TypeError at once (torch checks the callback)',
    'RpcTest.test_callback_none',
    'RpcTest.test_callback_wrong_arg_num',
    'RpcTest.test_callback_wrong_arg_type',
)
_group(
    'future-semantics',
    'set_result on a completed Future raises concurrent.futures.InvalidStateError, torch raises RuntimeError',
    'RpcTest.test_mark_future_twice',
)
_group(
    'async-proxy',
    "@async_execution methods called through RRef proxies try to pickle the returned Future ('cannot pickle _thread.RLock')",
    'RpcTest.test_async_class_rref_proxy',
    'RpcTest.test_async_class_rref_proxy_async',
    'RpcTest.test_async_class_rref_proxy_remote',
)
_group(
    'rref-details',
    'RRef._get_future() is missing',
    'RpcTest.test_rref_timeout',
    'TensorPipeAgentRpcTest.test_rref_proxy_timeout',
)
_group(
    'rref-details',
    'RRef._get_type() is missing',
    'RpcTest.test_rref_type_blocking',
    'RpcTest.test_rref_type_non_blocking',
    'RpcTest.test_rref_type_owner_blocking',
    'RpcTest.test_rref_type_owner_non_blocking',
    'RpcTest.test_rref_type_slow_init',
    'RpcTest.test_rref_type_with_error_blocking',
    'RpcTest.test_rref_type_with_error_non_blocking',
    'TensorPipeAgentRpcTest.test_rref_get_type_timeout_blocking',
    'TensorPipeAgentRpcTest.test_rref_get_type_timeout_non_blocking',
)
_group(
    'rref-details',
    'a proxy call of a method that does not exist must raise AttributeError',
    'RpcTest.test_rref_proxy_non_exist',
)
_group(
    'rref-details',
    'an RRef received as an argument is not yet confirmed_by_owner() when the function runs',
    'RpcTest.test_user_rrefs_confirmed',
    'RpcTest.test_user_rrefs_confirmed_remote',
)
_group(
    'rref-details',
    "pickling an RRef outside RPC must raise RuntimeError('Can not pickle rref in python pickler')",
    'RpcTest.test_rref_py_pickle_not_supported',
)
_group(
    'error-texts',
    "a remote exception that cannot be rebuilt: torch's phrase 'Original exception on remote side was' (rrefrt raises RemoteError with the type name)",
    'RpcTest.test_custom_exception_throw_during_reconstruction',
)
_group(
    'error-texts',
    "a torch op with arguments matching no schema: torch raises RuntimeError('Overloaded torch operator invoked from Python failed to match any schema'), rrefrt re-raises the op's TypeError",
    'TensorPipeAgentRpcTest.test_op_with_invalid_args',
)
_group(
    'error-texts',
    "call after shutdown / before init: torch's phrases 'RPC has not been initialized' / 'Current RPC agent is not set'",
    'RpcTest.test_pg_init_no_rpc_init',
    'RpcTest.test_shutdown_followed_by_rpc',
)
_group(
    'error-texts',
    "calling a function the callee cannot unpickle: torch's phrase 'RPC pickler does not serialize'",
    'RpcTest.test_function_not_on_callee',
)
_group(
    'error-texts',
    "init_rpc with a duplicate name: torch's phrase 'is not unique' is not in rrefrt's message",
    'RpcTest.test_duplicate_name_2',
)
_group(
    'error-texts',
    "re-init under tcp:// init: torch's test expects 'Address already in use' on rank 0 (rrefrt: 'RPC is already initialized', the phrase torch's file:// branch expects)",
    'RpcTest.test_reinit',
)
_group(
    'error-texts',
    "to_here() on an RRef deleted by shutdown: torch's phrase 'Cannot call to_here() on it after deletion.'",
    'RpcTest.test_use_rref_after_shutdown',
)
_group(
    'error-texts',
    "unknown destination: torch's phrase 'could not find destination'",
    'RpcTest.test_worker_id',
)
_group(
    'error-types',
    'a float destination must raise ValueError (rrefrt: TypeError)',
    'RpcTest.test_send_to_rank',
)
_group(
    'error-types',
    "init_rpc argument checks: backend='TENSORPIPE' (a string) and a non-RpcBackendOptions must raise TypeError with torch's text",
    'RpcTest.test_wrong_types',
)
_group(
    'error-types',
    'rpc_timeout given as a timedelta must raise TypeError (rrefrt: ValueError)',
    'TensorPipeAgentRpcTest.test_tensorpipe_options_throw_on_timedelta_timeout',
)
_group(
    'tensor-layout',
    "non-contiguous tensors and views arrive contiguous; torch keeps strides and the view's storage",
    'RpcTest.test_non_cont_tensors',
)
_group(
    'dist-autograd',
    'RRef.backward() needs distributed autograd',
    'RpcTest.test_owner_rref_backward',
    'RpcTest.test_user_rref_backward',
)
_group(
    'profiling',
    'RPC calls are not recorded in torch.autograd.profiler',
    'RpcTest.test_profiler_export_trace',
    'RpcTest.test_profiler_remote_events_profiled',
    'RpcTest.test_profiler_remote_events_profiled_single_threaded',
    'RpcTest.test_profiler_rpc_memory',
    'RpcTest.test_profiler_rpc_record_shapes',
    'RpcTest.test_profiler_with_async_rpc_builtin',
    'RpcTest.test_profiler_with_async_rpc_builtin_single_threaded',
    'RpcTest.test_profiler_with_async_rpc_udf',
    'RpcTest.test_profiler_with_async_rpc_udf_single_threaded',
    'RpcTest.test_profiler_with_autograd_context',
    'RpcTest.test_profiler_with_autograd_context_single_threaded',
    'RpcTest.test_profiler_with_remote_builtin',
    'RpcTest.test_profiler_with_remote_builtin_single_threaded',
    'RpcTest.test_profiler_with_remote_udf',
    'RpcTest.test_profiler_with_remote_udf_single_threaded',
    'RpcTest.test_profiler_with_sync_rpc_builtin',
    'RpcTest.test_profiler_with_sync_rpc_builtin_single_threaded',
    'RpcTest.test_profiler_with_sync_rpc_udf',
    'RpcTest.test_profiler_with_sync_rpc_udf_single_threaded',
    'RpcTest.test_rpc_profiling_async_function',
    'RpcTest.test_rpc_profiling_async_function_single_threaded',
    'RpcTest.test_rpc_profiling_remote_record_function',
)
_group(
    'profiling',
    'record_function callbacks on RPC futures (torch.ops.profiler._call_end_callbacks_on_jit_fut needs a torch C++ Future)',
    'RpcTest.test_async_record_function_cbs_jit_call',
    'RpcTest.test_async_record_function_double_end_callbacks',
    'RpcTest.test_async_record_function_legacy',
)
_group(
    'profiling',
    'server-side global profiler (rpc._server_process_global_profile) and GIL profiling (rpc.enable_gil_profiling) are torch-agent features',
    'RpcTest.test_disable_gil_profiling',
    'RpcTest.test_server_process_global_profiler',
)
_group(
    'torchscript',
    'TorchScript RPC: a ScriptFunction cannot be pickled; rrefrt does not run TorchScript calls',
    'RpcTest.test_profiler_with_script_async_rpc',
    'RpcTest.test_profiler_with_script_async_rpc_single_threaded',
    'RpcTest.test_profiler_with_script_remote_rpc',
    'RpcTest.test_profiler_with_script_remote_rpc_single_threaded',
    'RpcTest.test_profiler_with_script_sync_rpc',
    'RpcTest.test_profiler_with_script_sync_rpc_single_threaded',
    'RpcTest.test_stress_heavy_rpc_torchscript',
    'RpcTest.test_wait_all_exit_early_script_function',
)
_group(
    'private',
    'calls rpc._init_rpc_backend with a torch store (private)',
    'RpcTest.test_duplicate_name',
)
_group(
    'private',
    'calls rpc.api._wait_all_workers (private)',
    'RpcTest.test_wait_all_workers_dense',
    'RpcTest.test_wait_all_workers_twice_dense',
    'TensorPipeAgentRpcTest.test_wait_all_workers_twice_sparse',
)
_group(
    'private',
    "calls rpc.api.get_worker_info (torch's api submodule, not aliased)",
    'RpcTest.test_worker_info_pickle',
)
_group(
    'private',
    'calls torch.distributed.rpc.api._all_gather / _barrier (private)',
    'RpcTest.test_all_gather',
    'RpcTest.test_all_gather_timeout',
    'RpcTest.test_rpc_barrier_all',
    'RpcTest.test_rpc_barrier_multithreaded',
    'RpcTest.test_rpc_barrier_partial_subset',
    'RpcTest.test_rpc_barrier_subset',
)
_group(
    'private',
    "compares rrefrt's debug info with torch's _get_debug_info, the agent's and dist_autograd's",
    'RpcTest.test_debug_info',
)
_group(
    'private',
    'mocks rpc.api._delete_all_user_and_unforked_owner_rrefs / _broadcast_to_followers (private); rrefrt logs leaks unless strict_rref_leaks=True',
    'RpcTest.test_rref_leak',
    'RpcTest.test_shutdown_errors',
)
_group(
    'private',
    "reads torch's RPC agent (rpc.api._get_current_rpc_agent, private)",
    'RpcTest.test_get_worker_infos',
    'TensorPipeAgentRpcTest.test_infer_backend_from_options',
    'TensorPipeAgentRpcTest.test_set_and_get_num_worker_threads',
)
_group(
    'private',
    'registers a backend through rpc.backend_registry (private)',
    'RpcTest.test_register_rpc_backend_and_set_and_start_rpc_backend',
)
_group(
    'private',
    'sets the default timeout with rpc._set_rpc_timeout (private)',
    'RpcTest.test_default_timeout_used',
    'RpcTest.test_handle_send_exceptions',
    'RpcTest.test_rpc_timeouts',
)
_group(
    'private',
    'uses rpc.api._wait_all and its thread-local future list (private)',
    'RpcTest.test_wait_all',
    'RpcTest.test_wait_all_multiple_call',
    'RpcTest.test_wait_all_raise_in_user_func',
    'RpcTest.test_wait_all_timeout',
)
_group(
    'one-backend',
    'init_rpc with a foreign RpcBackendOptions subclass must raise TypeError; rrefrt has one backend and accepts any RpcBackendOptions',
    'RpcTest.test_cannot_infer_backend_from_options',
    'TensorPipeAgentRpcTest.test_mismatched_type_for_options',
)
_group(
    'worker-info',
    "WorkerInfo(name, id) does not validate names (torch: 'Worker name must match ...', 'must be non-empty', 'shorter than 128')",
    'RpcTest.test_invalid_names',
)
_group(
    'logging',
    "the callee does not print a remote function's exception to stderr (rrefrt logs to logging.getLogger('rrefrt') and adds no handler)",
    'RpcTest.test_py_raise_in_user_func',
)

_group(
    'rref-format',
    "the test matches torch's RRef text: GloballyUniqueId(created_on=.., local_id=..) with torch's numbering",
    'RpcTest.test_local_value_not_on_owner',
    'RpcTest.test_rref_str',
)
_group(
    'torchscript',
    'needs RRef._get_future() (being added) and then runs a TorchScript function remotely',
    'RpcTest.test_rref_get_future',
)
_group(
    'private',
    'torch.futures.wait_all over rrefrt futures (being fixed), then rpc.api._wait_all_workers (private)',
    'TensorPipeAgentRpcTest.test_wait_all_workers_sparse',
)

#: Tests that pass today and run in CI (the whole file, xfails included: about 18 s on 2
#: idle cores, about a minute on 2 cores shared by 8 people): calls of every kind, remote exceptions, RRefs passed around and
#: proxied, async_execution, futures, sparse tensors, the RRef-context counters (through the
#: alias's adapter). Every other passing test is listed in docs/compatibility.md.
CI_PASSING: list[str] = [
    "RpcTest.test_self_add",
    "RpcTest.test_add",
    "RpcTest.test_py_class_constructor",
    "RpcTest.test_nested_rpc",
    "RpcTest.test_py_function_exception",
    "RpcTest.test_rpc_return_rref",
    "RpcTest.test_return_local_rrefs",
    "RpcTest.test_rref_forward_chain",
    "RpcTest.test_rref_proxy_class",
    "RpcTest.test_async_function_simple",
    "RpcTest.test_async_class_method",
    "RpcTest.test_return_future",
    "RpcTest.test_future_done_exception",
    "RpcTest.test_callback_with_error",
    "RpcTest.test_world_size_one",
    "RpcTest.test_rref_context_debug_info",
    "TensorPipeAgentRpcTest.test_py_sparse_tensors_in_container",
    "TensorPipeAgentRpcTest.test_dynamic_rpc_init_rpc",  # 4 workers join and leave a dynamic group at once
]

#: A few "being fixed" tests, run in CI as non-strict xfails: each XPASSes when its fix lands.
CI_EXPECTED_TO_DIFFER: list[str] = [
    "RpcTest.test_future_wait_twice",
    "RpcTest.test_callback_none",
    "RpcTest.test_async_class_rref_proxy",
    "RpcTest.test_rref_type_blocking",
    "RpcTest.test_user_rrefs_confirmed",
    "RpcTest.test_duplicate_name_2",
]

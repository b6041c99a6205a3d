"""tests/unit: logic tested in this process only. No test here may start a process (they
run in seconds, anywhere); the guard below makes any attempt fail the test."""

from __future__ import annotations

import os

import _posixsubprocess
import pytest


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a test in tests/unit tried to start a process: move it to the layer folder it belongs to")


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse)
    monkeypatch.setattr(os, "fork", _refuse)
    monkeypatch.setattr(os, "posix_spawn", _refuse)
    monkeypatch.setattr(os, "posix_spawnp", _refuse)

"""``sessionfleet sim-engine`` as a real process: flags, --host with a pod-like IP, import."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sessionfleet.cli import build_parser

SESSIONFLEET = Path(sys.executable).with_name("sessionfleet")
HOST = "127.1.0.5"  # any 127.x address binds on Linux, like a KWOK pod IP


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the engine exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer /health within {timeout} s")


@pytest.fixture
def engines() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()


def start_engine(
    engines: list[subprocess.Popen[bytes]], *args: str
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port(HOST)
    process = subprocess.Popen(
        [str(SESSIONFLEET), "sim-engine", f"--host={HOST}", f"--port={port}", *args],
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    engines.append(process)
    url = f"http://{HOST}:{port}"
    wait_ready(url, process)
    return url, process


def test_help_says_it_is_a_simulator() -> None:
    parser = build_parser()
    text = parser.parse_args(["sim-engine", "--model", "m"])
    assert text.func.__name__ == "run"
    help_text = subprocess.run(
        [str(SESSIONFLEET), "sim-engine", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "SIMULATOR - not a model" in help_text


def test_a_restarted_engine_imports_its_cache(
    engines: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": "Explain this repository. " * 60}]
    body = {"model": "m", "messages": messages, "max_tokens": 2}
    url, process = start_engine(engines, "--model=m", "--kv-tokens=65536", "--block-size=16")
    post(f"{url}/v1/chat/completions", body)
    post(f"{url}/sim/cache/export", {"directory": str(tmp_path / "cp")})
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0

    url, _ = start_engine(engines, "--model=m", f"--import-cache={tmp_path / 'cp'}")
    usage = post(f"{url}/v1/chat/completions", body)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16


def test_a_snapshot_of_another_model_is_refused(
    engines: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    url, _ = start_engine(engines, "--model=m")
    post(f"{url}/sim/cache/export", {"directory": str(tmp_path)})
    process = subprocess.Popen(
        [
            str(SESSIONFLEET),
            "sim-engine",
            f"--host={HOST}",
            f"--port={free_port(HOST)}",
            "--model=other",
            f"--import-cache={tmp_path}",
        ],
        env=dict(os.environ),
        stderr=subprocess.PIPE,
    )
    engines.append(process)
    assert process.wait(timeout=20) == 2
    assert process.stderr is not None
    assert b"the snapshot is of model 'm'" in process.stderr.read()


def test_cost_flags() -> None:
    from sessionfleet.simengine.cli import config_from_args

    parse = build_parser().parse_args
    assert config_from_args(parse(["sim-engine", "--model=m"])).cost.free
    realistic = config_from_args(parse(["sim-engine", "--model=m", "--realistic"])).cost
    assert realistic.decode_seconds_per_token == 0.02
    mixed = config_from_args(
        parse(
            [
                "sim-engine",
                "--model=m",
                "--realistic",
                "--decode-ms-per-token=5",
                "--prefill-us-per-token=10",
                "--request-overhead-ms=0",
            ]
        )
    ).cost
    assert mixed.decode_seconds_per_token == 0.005
    assert mixed.prefill_seconds_per_token == pytest.approx(10e-6)
    assert mixed.request_overhead_seconds == 0
    config = config_from_args(
        parse(
            [
                "sim-engine",
                "--model=m",
                "--no-enable-prompt-tokens-details",
                "--enable-force-include-usage",
                "--kv-tokens=64",
                "--block-size=32",
            ]
        )
    )
    assert not config.enable_prompt_tokens_details and config.force_include_usage
    assert (config.kv_tokens, config.block_size) == (64, 32)
    with pytest.raises(SystemExit):
        config_from_args(parse(["sim-engine", "--model=m", "--kv-tokens=8"]))

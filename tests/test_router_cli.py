"""``sessionfleet router``: every flag reaches the settings."""

from __future__ import annotations

from sessionfleet.cli import build_parser
from sessionfleet.router.cli import settings_from_args


def test_flags_reach_the_settings() -> None:
    args = build_parser().parse_args(
        [
            "router",
            "--namespace=agents",
            "--replica=r7",
            "--session-header=X-Agent",
            "--parent-header=X-Up",
            "--final-header=X-Last",
            "--flush-interval=3",
            "--flush-writes-per-second=9",
            "--hold-timeout=4",
            "--retry-after=2",
            "--sync-timeout=6",
            "--create-timeout=1.5",
            "--connect-timeout=2.5",
            "--read-timeout=60",
            "--max-body-bytes=1000",
        ]
    )
    settings = settings_from_args(args)
    assert (settings.namespace, settings.replica) == ("agents", "r7")
    headers = settings.config.headers
    assert (headers.session_header, headers.parent_header, headers.final_header) == (
        "X-Agent",
        "X-Up",
        "X-Last",
    )
    assert (settings.flush_interval, settings.flush_writes_per_second) == (3, 9)
    assert (settings.config.hold_timeout, settings.config.retry_after) == (4, 2)
    assert (settings.config.sync_timeout, settings.config.intake.max_body_bytes) == (6, 1000)
    assert (settings.create_timeout, settings.connect_timeout, settings.read_timeout) == (
        1.5,
        2.5,
        60,
    )


def test_defaults() -> None:
    settings = settings_from_args(build_parser().parse_args(["router", "--replica=x"]))
    assert settings.config.headers.session_header == "X-Session-Id"
    assert settings.flush_interval == 10 and settings.config.hold_timeout == 30
    assert settings.namespace  # the pod's namespace, or default

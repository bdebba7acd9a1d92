"""The gRPC channel options of every channel a stage opens to another: to the stage below
(``downstream``) and, from the final stage, to the head (``returns``)."""

from __future__ import annotations


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Keepalive so a dead peer is noticed between requests, and the stage's size limit."""
    return [
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Reconnect quickly once a restarted peer is back.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]

"""What the server sends (DESIGN.md's wire table, server -> client): every message carries the
shared parameters (``arrays``; the whole model in pre-training), the pre-trained personal slice
once there is one (``personal-init``: the global model's, never a client's), the algorithm's
further records in training rounds (Scaffold's ``control``), and a ``config`` record with the
round, the phase, the step sizes and the handshake (``algorithm``, ``settings-fingerprint``,
the run tag devices version their state by); a node whose replies keep being dropped for
their values gets ``personal-reset``."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from pflower.wire import (
    ALGORITHM,
    ARRAYS,
    CONFIG,
    PERSONAL_INIT,
    PERSONAL_RESET,
    SETTINGS_FINGERPRINT,
)


def handshake(serves: Iterable[str], fingerprint: str = "") -> dict:
    """What every message says about the server's run: the algorithms whose clients it
    serves (none: any) and, when built from a run config, the fingerprint of the settings its
    clients must share (``wire.handshake_problem`` is the client's side)."""
    shake: dict = {ALGORITHM: list(serves)} if serves else {}
    if fingerprint:
        shake[SETTINGS_FINGERPRINT] = fingerprint
    return shake


def round_messages(
    node_ids: Iterable[int],
    arrays: ArrayRecord,
    config: Mapping,
    message_type: str,
    *,
    personal_init: ArrayRecord | None = None,
    extra: Mapping[str, ArrayRecord] | None = None,
    reset: Collection[int] = (),
) -> list[Message]:
    """One message per node (one content shared by all, another with ``personal-reset`` for
    the nodes of ``reset``)."""

    def content_with(config: Mapping) -> RecordDict:
        content = RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord(dict(config))})
        if personal_init is not None:
            content[PERSONAL_INIT] = personal_init
        for key, record in (extra or {}).items():
            content[key] = record
        return content

    content = content_with(config)
    reset_content = content_with({**config, PERSONAL_RESET: True}) if reset else None
    return [
        Message(
            content=reset_content if n in reset else content,
            message_type=message_type,
            dst_node_id=n,
        )
        for n in node_ids
    ]

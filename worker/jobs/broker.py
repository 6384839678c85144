"""The Redis transport the workers consume with: kombu's, except that a queue entry that is no
message is logged and dropped instead of ending the worker.

kombu pops an entry with BRPOP and decodes it in its event loop; an entry that is not JSON, or not
kombu's envelope, raises out of the loop ("Unrecoverable error") and the whole worker exits, with
every task it held. The entry is popped by then, so nothing more is lost by dropping it here. A
message that decodes but cannot run (a pickled body, an unknown task, wrong arguments) never got
this far: Celery refuses those itself and carries on.

Installed by registering it under kombu's own names for Redis (``redis://``, ``rediss://``, and the
``redis+socket://`` of the embedded broker), when ``worker.celery_app`` is imported.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

log = logging.getLogger("rloo.worker")


class Channel(kombu_redis.Channel):
    def _brpop_read(self, **options: Any) -> Any:
        try:
            return super()._brpop_read(**options)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.error("dropped a queue entry that is no message (%s: %.200s)", type(exc).__name__, exc)
            return False


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    for name in ("redis", "rediss"):
        TRANSPORT_ALIASES[name] = f"{__name__}:Transport"

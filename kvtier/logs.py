"""kvtier's log lines where the program around it configured none.

kvtier logs through ``logging.getLogger("kvtier...")`` and never configures logging for a program
that does. An engine often does not configure the root logger -- vLLM gives its own ``vllm`` logger a
handler and leaves the rest -- so kvtier's warnings would reach Python's last-resort handler: the
message alone, no time, and nothing below WARNING. :func:`log_to_stderr_unless_configured` gives the
``kvtier`` logger a timestamped stderr handler in that case only.

:func:`refusing_start`: where kvtier refuses an engine's start (a bad option, a model or split the
node service cannot serve, a required service that does not answer), the first thing an operator sees
is one line naming the fix, above the engine's own traceback of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.errors import KVTierError

#: the format of kvtier's own lines: when, how bad, which module (vLLM's lines read alike)
FORMAT = "%(levelname)s %(asctime)s.%(msecs)03d [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def log_to_stderr_unless_configured(level: int = logging.INFO) -> bool:
    """Give the ``kvtier`` logger a timestamped stderr handler at ``level``, unless it or the root logger has
    a handler already (the program's own configuration wins); True if it added one. Idempotent."""
    logger = logging.getLogger("kvtier")
    if logger.handlers or logging.getLogger().handlers:
        return False
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    return True


@contextmanager
def refusing_start(logger: logging.Logger, who: str, prefixes: tuple[str, ...] = ()) -> Iterator[None]:
    """A :class:`~kvtier.errors.KVTierError` raised in the block is logged as one ERROR line, ``"<who> refused to
    start: <message>"`` (a leading ``prefixes`` entry of the message dropped: said once, by this line), then raised on."""
    try:
        yield
    except KVTierError as e:
        message = str(e)
        for own in prefixes:
            message = message.removeprefix(own)
        logger.error("%s refused to start: %s", who, " ".join(message.split()))
        raise

"""Named points in the checkpoint write path where the fault tests make the process signal itself.

`KVREWRITE_FAULT=step:SIGNAL` (e.g. `emit:config:SIGKILL`) kills the process when the write path reaches `step`,
so the crash tests hit every write step exactly instead of relying on timing. Unset (always, outside tests), a
fault point is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "KVREWRITE_FAULT"
# Forces the two-rename swap (the fallback where RENAME_EXCHANGE is unavailable) so its recovery is tested too.
NO_EXCHANGE_ENV = "KVREWRITE_NO_RENAME_EXCHANGE"


def fault_point(step: str) -> None:
    """Signal this process if KVREWRITE_FAULT names `step` (the signal name follows the last ':')."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    where, _, name = spec.rpartition(":")
    if where == step:
        os.kill(os.getpid(), getattr(signal, name))


def exchange_disabled() -> bool:
    return os.environ.get(NO_EXCHANGE_ENV, "") not in ("", "0")

"""A container's termination message as the kubelet makes it, for `ddp-ops local`.

The kubelet gives each container instance a new empty file at its `terminationMessagePath`
(the default `/dev/termination-log`), and when the container exits reads at most the last
4096 bytes of it, whatever the exit code. Under `terminationMessagePolicy:
FallbackToLogsOnError`, a file left empty (or absent) by a container that exited non-zero
gives way to the tail of its log: at most the last 80 lines, and of them at most the last
2048 bytes. (kubernetes pkg/kubelet/kuberuntime/kuberuntime_container.go,
getTerminationMessage, readLastStringFromContainerLogs and convertToKubeContainerStatus;
the limits in pkg/kubelet/container/runtime.go; docs/facts.md, "The kubelet".)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_PATH = "/dev/termination-log"
FILE_LIMIT = 4096  # MaxContainerTerminationMessageLength
LOG_LIMIT = 2048  # MaxContainerTerminationMessageLogLength
LOG_LINES = 80  # MaxContainerTerminationMessageLogLines


def message_path(container: dict[str, Any]) -> str:
    return container.get("terminationMessagePath") or DEFAULT_PATH


def termination_message(container: dict[str, Any], exit_code: int, message_file: Path, log_file: Path) -> str:
    """What the pod's status says of the container's end: the file's tail, else, where the
    policy falls back to logs and the container failed, the log's tail."""
    data = _tail_bytes(message_file, FILE_LIMIT)
    fallback = container.get("terminationMessagePolicy") == "FallbackToLogsOnError" and exit_code != 0
    if data or not fallback:
        return data.decode(errors="replace")
    lines = _tail_bytes(log_file, None).decode(errors="replace").splitlines(keepends=True)[-LOG_LINES:]
    return "".join(lines).encode()[-LOG_LIMIT:].decode(errors="replace")


def _tail_bytes(path: Path, limit: int | None) -> bytes:
    try:
        data = path.read_bytes()
    except OSError:
        return b""
    return data if limit is None else data[-limit:]

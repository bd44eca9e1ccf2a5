"""A loopback API server that answers from recorded responses (tests/recorded/)."""

from __future__ import annotations

from typing import Any

from loopback_api import NOT_SERVED, LoopbackApi, status


class ReplayApi(LoopbackApi):
    def __init__(self, routes: dict[tuple[str, str], tuple[int, str | dict]]) -> None:
        """`routes` maps (method, path with query) to (status, body); the longest matching
        path prefix wins, and unmatched requests get the API's 404."""
        super().__init__()
        self.routes = routes
        self.requests: list[tuple[str, str]] = []

    def answer(self, method: str, target: str, headers: Any, body: bytes) -> tuple[int, str | dict]:
        self.requests.append((method, target))
        matches = [
            (path, answer) for (verb, path), answer in self.routes.items()
            if verb == method and target.startswith(path)
        ]  # fmt: skip
        if matches:
            return max(matches, key=lambda match: len(match[0]))[1]
        return 404, status(404, "NotFound", NOT_SERVED)

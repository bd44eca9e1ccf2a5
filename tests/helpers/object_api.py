"""A loopback API server that keeps namespaced objects the way the Kubernetes API does for
server-side apply, label-selected lists and deletes.

No API server can run on this machine (no kube-apiserver or etcd binaries are reachable), so
this models only the answers `ddp-ops submit` and `delete` rely on, from the API's
documentation: an apply (PATCH, `application/apply-patch+yaml`, `fieldManager` required)
answers 201 when it created the object and 200 when it updated it; a list takes a
`labelSelector` of `key=value` terms; a delete of an absent object is 404; a kind the
cluster does not serve is 404 "the server could not find the requested resource". An
`admit` callable plays the admission chain (webhooks, CEL rules) for an apply: given the
key, the stored object (None on create), the applied one and every stored object, it
answers an error (status, document) or None to let it through."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from loopback_api import NOT_SERVED, LoopbackApi, status


class ObjectApi(LoopbackApi):
    def __init__(self, served: set[str], admit: Callable[..., tuple[int, dict] | None] | None = None) -> None:
        """`served`: the plurals the cluster knows (configmaps, pytorchjobs, ...)."""
        super().__init__()
        self.served = served
        self.admit = admit
        self.objects: dict[tuple[str, str, str], dict] = {}  # (namespace, plural, name) -> object
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status answered)
        self.lock = threading.Lock()

    def answer(self, method: str, target: str, headers: Any, body: bytes) -> tuple[int, str | dict]:
        url = urlsplit(target)
        code, document = self._answer(method, url.path, parse_qs(url.query), headers, body)
        self.requests.append((method, url.path, code))
        return code, document

    def _answer(self, method: str, path: str, query: dict[str, list[str]], headers: Any, body: bytes):
        parts = path.strip("/").split("/")
        # /api/v1/namespaces/NS/PLURAL[/NAME] or /apis/GROUP/VERSION/namespaces/NS/PLURAL[/NAME]
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        if len(rest) < 3 or rest[0] != "namespaces" or rest[2] not in self.served:
            return 404, status(404, "NotFound", NOT_SERVED)
        namespace, plural, name = rest[1], rest[2], rest[3] if len(rest) > 3 else None
        key = (namespace, plural, name)
        with self.lock:
            if method == "PATCH" and name:
                if headers.get("Content-Type") != "application/apply-patch+yaml":
                    return 415, status(415, "UnsupportedMediaType", "expected an apply patch")
                if not query.get("fieldManager"):
                    return 400, status(400, "BadRequest", "fieldManager is required for apply patch")
                item = json.loads(body)
                if self.admit is not None and (
                    refused := self.admit(key, self.objects.get(key), item, self.objects)
                ):
                    return refused
                created = key not in self.objects
                version = 1 if created else int(self.objects[key]["metadata"]["resourceVersion"]) + 1
                item["metadata"]["resourceVersion"] = str(version)
                self.objects[key] = item
                return (201 if created else 200), item
            if method == "GET" and name is None:
                terms = [t.split("=", 1) for t in query.get("labelSelector", [""])[0].split(",") if t]
                items = [
                    item
                    for (ns, kind, _), item in self.objects.items()
                    if (ns, kind) == (namespace, plural)
                    and all(item["metadata"].get("labels", {}).get(k) == v for k, v in terms)
                ]
                return 200, {"kind": "List", "items": items}
            if method == "GET" and name:
                if key not in self.objects:
                    return 404, status(404, "NotFound", f'{plural} "{name}" not found')
                return 200, self.objects[key]
            if method == "DELETE" and name:
                if self.objects.pop(key, None) is None:
                    return 404, status(404, "NotFound", f'{plural} "{name}" not found')
                return 200, status(200, "", "")
        return 405, status(405, "MethodNotAllowed", f"{method} {path}")

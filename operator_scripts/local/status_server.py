"""Kubeflow Trainer's status server (KEP-2779) as `ddp-ops local` runs it for a TrainJob.

What the controller's endpoint does (kubeflow/trainer v2.3.0, pkg/statusserver; docs/facts.md,
"Trainer's status server"), on HTTPS with a certificate for the controller's Service name:
- one route, `POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs/{name}/status`
  (utils.go:33, server.go:87); anything else is 404;
- a Bearer token whose audience is that TrainJob's (auth.go:84-112) and whose pod is of the
  same namespace, else 403 "Forbidden". The emulation issues one token per audience, an
  opaque string a pod can only have read from its projected volume;
- a body that is not JSON is 422 "Invalid payload"; one without `trainerStatus` is 200 and
  changes nothing (server.go:164-181);
- the status is applied as the CRD validates it (trainer.kubeflow.org_trainjobs.yaml):
  progressPercentage 0-100, estimatedRemainingSeconds 0 to 2^31-1, at most 256 metrics of a
  name and a value of 1 to 64 characters, lastUpdatedTime a date-time and required; what
  fails is 422 with the reason. What passes replaces `status.trainerStatus` (a server-side
  apply with the server's own field manager, server.go:183-185).

Run as `python -m operator_scripts.local.status_server FOLDER ADDRESS PORT`: FOLDER holds
`server.crt`, `server.key`, `tokens.json` ({audience: token}); each accepted status is
written to `FOLDER/<namespace>/<name>.json`, and every request to `requests.log`.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import re
import secrets
import ssl
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from operator_scripts.controllers import trainjob_env
from operator_scripts.controllers.pytorchjob_env import PodPlan
from operator_scripts.local.pods import LocalError
from operator_scripts.parent_death import dies_with_parent
from trainer.telemetry.trainer_status import INT32_MAX

SERVICE = "kubeflow-trainer-controller-manager"  # config defaults.go:56, in kubeflow-system
NAMESPACE = "kubeflow-system"
HOST = f"{SERVICE}.{NAMESPACE}.svc"  # trainjobstatus.go:122
PORT = 10443  # config defaults.go:68, the Deployment's `status-server` port
LABELS = {  # the controller's pods (manifests/base/manager/manager.yaml)
    "app.kubernetes.io/name": "trainer",
    "app.kubernetes.io/component": "manager",
    "app.kubernetes.io/part-of": "kubeflow",
}
ROUTE = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs/([^/]+)/status$")
MAX_BODY = 1 << 16  # server.go:50


def audience(namespace: str, name: str) -> str:
    """The token audience the server requires for a TrainJob (utils.go:27-29)."""
    return f"trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"


def status_url(namespace: str, name: str, host: str = HOST, port: int = PORT) -> str:
    """What the TrainJobStatus plugin injects as KUBEFLOW_TRAINER_SERVER_URL (trainjobstatus.go:117-136)."""
    return f"https://{host}:{port}/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"


def invalid(status: Any) -> str | None:
    """Why the CRD's schema refuses a `trainerStatus`, or None."""
    if not isinstance(status, dict):
        return "trainerStatus: must be an object"
    for field, top in (("progressPercentage", 100), ("estimatedRemainingSeconds", INT32_MAX)):
        value = status.get(field)
        whole = isinstance(value, int) and not isinstance(value, bool)
        if value is not None and not (whole and 0 <= value <= top):
            return f"trainerStatus.{field}: Invalid value: {value!r}: must be an integer from 0 to {top}"
    metrics = status.get("metrics") or []
    if not isinstance(metrics, list) or len(metrics) > 256:
        return "trainerStatus.metrics: must be a list of at most 256 items"
    for index, metric in enumerate(metrics):
        for key in ("name", "value"):
            text = metric.get(key) if isinstance(metric, dict) else None
            if not isinstance(text, str) or not 1 <= len(text) <= 64:
                return f"trainerStatus.metrics[{index}].{key}: must be a string of 1 to 64 characters"
    if "lastUpdatedTime" not in status:
        return "trainerStatus: Invalid value: lastUpdatedTime is required when trainerStatus is present"
    try:
        datetime.datetime.fromisoformat(str(status["lastUpdatedTime"]).replace("Z", "+00:00"))
    except ValueError:
        return f"trainerStatus.lastUpdatedTime: Invalid value: {status['lastUpdatedTime']!r}: not a date-time"
    return None


def kube_status(code: int, reason: str, message: str) -> dict:
    """metav1.Status, as the server's badRequest writes it (server.go:224-237)."""
    return {"status": "Failure", "message": message, "reason": reason, "code": code}


class StatusEndpoint:
    """The server's decisions, apart from HTTP: (code, answer) for a request."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tokens: dict[str, str] = json.loads((folder / "tokens.json").read_text())

    def answer(self, method: str, path: str, authorization: str, body: bytes) -> tuple[int, dict]:
        route = ROUTE.match(path)
        if method != "POST" or route is None:
            return 404, kube_status(404, "NotFound", "Not found")
        namespace, name = route.groups()
        scheme, _, token = authorization.partition(" ")
        expected = self.tokens.get(audience(namespace, name))
        if scheme.lower() != "bearer" or expected is None or not secrets.compare_digest(token, expected):
            return 403, kube_status(403, "Forbidden", "Forbidden")
        try:
            request = json.loads(body)
        except ValueError:
            return 422, kube_status(422, "Invalid", "Invalid payload")
        if not isinstance(request, dict):
            return 422, kube_status(422, "Invalid", "Invalid payload")
        if request.get("trainerStatus") is None:
            return 200, request
        if reason := invalid(request["trainerStatus"]):
            said = f'TrainJob.trainer.kubeflow.org "{name}" is invalid: {reason}'
            return 422, kube_status(422, "Invalid", said)
        applied = self.folder / namespace / f"{name}.json"
        applied.parent.mkdir(parents=True, exist_ok=True)
        written = applied.with_suffix(".tmp")
        written.write_text(json.dumps(request["trainerStatus"]))
        written.replace(applied)
        return 200, request


def issue_credentials(folder: Path, audiences: list[str]) -> Path:
    """A CA, a server certificate for the Service's name signed by it, and a token per
    audience, in `folder`; returns the CA's file (what the plugin's ConfigMap carries)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(
        subject: str, key: ec.EllipticCurvePrivateKey, signer: ec.EllipticCurvePrivateKey, *, ca: bool
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubeflow-trainer-ca")]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            # and this host's loopback address, where a test reaches it without the pods' host table
            names = [x509.DNSName(HOST), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("kubeflow-trainer-ca", ca_key, ca_key, ca=True)
    server = certificate(HOST, server_key, ca_key, ca=False)
    pem = serialization.Encoding.PEM
    (folder / "ca.crt").write_bytes(ca.public_bytes(pem))
    (folder / "server.crt").write_bytes(server.public_bytes(pem))
    key_file = folder / "server.key"
    key_file.write_bytes(
        server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_file.chmod(0o600)
    (folder / "tokens.json").write_text(json.dumps({each: secrets.token_urlsafe(32) for each in audiences}))
    return folder / "ca.crt"


class LocalStatusServer:
    """The status server of one `ddp-ops local` TrainJob run, and what the TrainJobStatus
    plugin adds to its pods: the environment and the projected token and CA, the CA's
    ConfigMap, and the Service's name in the pods' host table."""

    def __init__(self, trainjob: dict[str, Any], folder: Path) -> None:
        metadata = trainjob["metadata"]
        self.trainjob, self.folder = trainjob, folder
        self.namespace, self.name = metadata.get("namespace", "default"), metadata["name"]
        self.audience = audience(self.namespace, self.name)
        self.ca = issue_credentials(folder, [self.audience])
        self.tokens = json.loads((folder / "tokens.json").read_text())
        self.process: subprocess.Popen | None = None

    def inject(self, plans: list[PodPlan]) -> list[PodPlan]:
        url = status_url(self.namespace, self.name)
        return [
            dataclasses.replace(
                plan,
                template=trainjob_env.with_status_server(plan.template, self.trainjob, url, self.audience),
            )
            for plan in plans
        ]

    def config_maps(self) -> list[dict[str, Any]]:
        return [trainjob_env.tls_config_map(self.trainjob, self.ca.read_text())]

    def start(self, address: str, prefix: list[str]) -> None:
        """The server at `address`, in the network namespace `prefix` enters (none: this host's);
        it dies with this process however that ends (setpriv's parent-death signal), as the pods do."""
        server = [sys.executable, "-m", __name__, str(self.folder), address, str(PORT)]
        command = [*prefix, *dies_with_parent(), *server]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        said = self.process.stdout.readline().strip()
        if not said.startswith("listening on "):
            self.stop()
            raise LocalError(f"the emulated status server did not start at {address}:{PORT}: {said}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process.stdout.close()
            self.process = None

    def applied(self) -> dict[str, Any] | None:
        """The TrainJob's `status.trainerStatus` as the server left it, if it took one."""
        path = self.folder / self.namespace / f"{self.name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def requests(self) -> list[dict[str, Any]]:
        """Every request's path and answer code, in order."""
        journal = self.folder / "requests.log"
        return [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []


def make_server(folder: Path, address: str, port: int) -> ThreadingHTTPServer:
    """The server for `folder`'s credentials on `address`:`port` (0: any free port)."""
    endpoint = StatusEndpoint(folder)
    journal = folder / "requests.log"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                code, answer = 413, kube_status(413, "RequestEntityTooLarge", "request body too large")
            else:
                body = self.rfile.read(length)
                auth = self.headers.get("Authorization", "")
                code, answer = endpoint.answer(self.command, self.path, auth, body)
            with open(journal, "a") as log:
                log.write(json.dumps({"path": self.path, "code": code}) + "\n")
            payload = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    server = ThreadingHTTPServer((address, port), Handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(folder / "server.crt", folder / "server.key")
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    return server


if __name__ == "__main__":
    running = make_server(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    print(f"listening on {sys.argv[2]}:{running.server_address[1]}", flush=True)
    running.serve_forever()

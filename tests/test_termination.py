"""The line that ends a container, where Kubernetes shows it: the kubelet's rules for the
termination message as `ddp-ops local` plays them, and `ddp-ops status` naming the failed
pod with it, on pod objects shaped as the API returns them."""

from __future__ import annotations

from operator_scripts.cluster.status import format_status, pod_failures, summarize
from operator_scripts.local.termination import termination_message

FALLBACK = {"terminationMessagePolicy": "FallbackToLogsOnError"}


def test_the_file_is_the_message_and_an_empty_one_falls_back_to_the_failed_containers_log_tail(tmp_path):
    message, log = tmp_path / "termination-log", tmp_path / "container.log"
    log.write_text("".join(f"line {n}\n" for n in range(200)))
    message.write_text("trainer: error: model.width=16: ...\n")
    assert termination_message(FALLBACK, 2, message, log) == "trainer: error: model.width=16: ...\n"
    message.write_text("x" * 5000 + "end")  # the kubelet reads the last 4096 bytes
    assert termination_message(FALLBACK, 2, message, log) == ("x" * 5000 + "end")[-4096:]
    message.write_text("")
    tail = termination_message(FALLBACK, 137, message, log)
    assert tail.splitlines() == [f"line {n}" for n in range(120, 200)]  # the last 80 lines
    assert termination_message(FALLBACK, 0, message, log) == ""  # a success falls back to nothing
    assert termination_message({}, 2, message, log) == ""  # the default policy is File
    log.write_text("y" * 3000 + "\n")
    assert termination_message(FALLBACK, 1, tmp_path / "absent", log) == ("y" * 3000 + "\n")[-2048:]


def pod(name: str, state: dict, last: dict | None = None) -> dict:
    status = {"name": "pytorch", "restartCount": 1, "state": state, "lastState": last or {}}
    return {"metadata": {"name": name, "labels": {}}, "status": {"containerStatuses": [status]}}


def test_status_names_each_failed_pod_with_its_message():
    line = "trainer: error: data.path='s3://b/v2': step 25 in s3://b/run was trained on other data (...)"
    pods = [
        pod("run-worker-0", {"terminated": {"exitCode": 2, "reason": "Error", "message": line + "\n"}}),
        pod("run-worker-1", {"running": {}}, {"terminated": {"exitCode": 137, "reason": "Error"}}),
        pod("run-worker-2", {"terminated": {"exitCode": 0, "message": "done: 380 steps ..."}}),
    ]
    failed = [f"pod run-worker-0: exit 2: {line}", "pod run-worker-1: exit 137: (no message)"]
    assert pod_failures(pods) == failed
    job = {"metadata": {"name": "run"}, "status": {"conditions": [{"type": "Failed", "status": "True"}]}}
    assert f"\n  pod run-worker-0: exit 2: {line}" in format_status(summarize(job, pods))

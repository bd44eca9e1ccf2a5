"""`ddp-ops`: the operator's CLI for the chart's job (a PyTorchJob, or a TrainJob with jobKind=TrainJob).

ddp-ops render  [-f VALUES] [--set K=V] [--release R] [-n NS] [--code DIR]   manifests, as helm template
ddp-ops submit  [-f VALUES] [--set K=V] [--release R] [-n NS] [--code DIR] [--dry-run]
                                                                create or update, as apply
ddp-ops status  JOB [-n NS]        conditions, replicas, restarts, age, rank 0's pod
ddp-ops logs    JOB [-n NS] [-f]   rank 0's pytorch container
ddp-ops delete  RELEASE [-n NS]    every object submit made for the release (its labels)
ddp-ops local   [-f VALUES] [--set K=V] [--code DIR] [--workdir DIR] [--delay POD=SECONDS] [--runtime docker]
                [--freeze-node POD=SECONDS [--node-back-after S | --node-deleted-after S]]
                                                                run the rendered job here
ddp-ops estimate --step-ms MS --grad-mb MB [--devices N ...] [--interconnect NAME] [--data-ms MS]
                                                                predicted speedup at N devices
ddp-ops flight-recorder LOCATION [--out DIR]                    the collectives of ranks killed as hung
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import re
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from operator_scripts.chart.code_bundle import CodeError, code_values
from operator_scripts.chart.render import ValuesError, deep_merge, merge_values, render
from operator_scripts.cluster.client import Cluster, ClusterError
from operator_scripts.cluster.status import format_status
from operator_scripts.local.node_loss import NODE_MONITOR_GRACE_S, NodeLossPlan
from trainer.config.argparsing import OneLineParser, existing_file, positive_float

HELM_COMMANDS = ("render", "submit", "local")
HELM_FAIL_PREFIX = re.compile(r"^execution error at \([^)]*\): ")  # what a chart's `fail` comes wrapped in
INSTALL_ID_ANNOTATION = "ddp-trainer/install-id"  # the chart's, on the job: helm/templates/_helpers.tpl


def _chart_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f", "--values", action="append", default=[], type=existing_file, help="values file (repeatable)"
    )
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], help="Helm --set expression (repeatable)"
    )
    parser.add_argument("--release", default="ddp-run", help="release name (default ddp-run)")
    parser.add_argument("-n", "--namespace", default="default", help="namespace (default default)")
    parser.add_argument(
        "--code",
        type=Path,
        metavar="DIR",
        help="ship a small local package (or a folder of modules) with the job, first on the pods' "
        "PYTHONPATH, for plug-ins without an image build (at most 1 MiB)",
    )


class DeprecatedName(argparse.Action):
    """An option's old name: still honoured for one release, with a line that names the new one."""

    def __init__(self, *args, new: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        line = f"{parser.prog}: {option_string} is deprecated: use {self.new} (the same value)"
        print(line, file=sys.stderr)
        setattr(namespace, self.dest, values)


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "job", help="the PyTorchJob's or TrainJob's name (the release's full name, e.g. ddp-run-ddp-trainer)"
    )
    parser.add_argument("-n", "--namespace", default="default", help="namespace (default default)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ddp-ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _chart_arguments(commands.add_parser("render", help="render the chart to manifests (no helm binary)"))
    submit = commands.add_parser(
        "submit", help="render and apply the objects: create them, or update them to match"
    )
    _chart_arguments(submit)
    submit.add_argument("--dry-run", action="store_true", help="print what would be created, contact nothing")
    _job_arguments(
        commands.add_parser("status", help="a job's conditions, replicas, restarts and rank 0's pod")
    )
    logs = commands.add_parser("logs", help="rank 0's log (the pytorch container)")
    _job_arguments(logs)
    logs.add_argument("-f", "--follow", action="store_true", help="stream the log")
    delete = commands.add_parser("delete", help="delete every object of a release, found by its labels")
    delete.add_argument("release", help="the release name given to submit (default there: ddp-run)")
    delete.add_argument("-n", "--namespace", default="default", help="namespace (default default)")
    local = commands.add_parser(
        "local", help="run the rendered job on this machine, pods as processes or containers"
    )
    _chart_arguments(local)
    local.add_argument(
        "--runtime",
        choices=["process", "docker"],
        default="process",
        help="process: each pod a process tree (default); docker: each pod a container of its image",
    )
    local.add_argument(
        "--pod-subnet",
        type=_subnet,
        default="10.213.0.0/24",
        help="the pods' network (as root, or with docker); this machine is its first address "
        "(default %(default)s)",
    )
    local.add_argument(
        "--secret",
        action="append",
        default=[],
        type=_secret,
        metavar="NAME=FOLDER",
        help="a Secret the job reads (checkpoint.s3.existingSecret), as a folder with a file per key, "
        "e.g. s3-credentials=~/.ddp-secret holding `credentials` (repeatable)",
    )
    local.add_argument("--workdir", type=Path, help="folder for the pods' files (default: a temporary one)")
    local.add_argument(
        "--timeout-s", type=positive_float, default=3600, help="seconds before the job counts as failed"
    )
    local.add_argument(
        "--timeout", type=positive_float, dest="timeout_s", action=DeprecatedName, new="--timeout-s",
        help="the old name of --timeout-s",
    )  # fmt: skip
    local.add_argument(
        "--delay",
        action="append",
        default=[],
        type=_delay,
        metavar="POD=SECONDS",
        help="start POD (worker-0 or a full pod name) SECONDS after the others, as a slow image "
        "pull or node scale-up would (repeatable)",
    )
    local.add_argument(
        "--freeze-node",
        action="append",
        default=[],
        type=_delay,
        metavar="POD=SECONDS",
        help="freeze the node of POD SECONDS into the run: its processes and its kubelet stop, and the "
        "control plane answers as on a cluster (NotReady, eviction by the pod's toleration; repeatable)",
    )
    local.add_argument(
        "--node-back-after", type=positive_float, metavar="SECONDS",
        help="a frozen node answers again SECONDS after it froze (default: never)",
    )  # fmt: skip
    local.add_argument(
        "--node-deleted-after", type=positive_float, metavar="SECONDS",
        help="a frozen node's Node object is deleted SECONDS after it froze (its VM gone); PodGC then "
        "force-deletes its pods (default: never)",
    )  # fmt: skip
    local.add_argument(
        "--node-monitor-grace-period", type=positive_float, default=NODE_MONITOR_GRACE_S, metavar="SECONDS",
        help="seconds without a node's status before it is NotReady (kube-controller-manager's; default 40)",
    )  # fmt: skip
    # listed for --help; their own options are parsed by operator_scripts.reports.*
    commands.add_parser(
        "estimate", help="predict speedup at N devices (ring all-reduce model)", add_help=False
    )
    commands.add_parser(
        "flight-recorder", help="what hung ranks' collectives were, from their dumps", add_help=False
    )
    return parser


def _subnet(text: str) -> str:
    try:
        network = ipaddress.ip_network(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    if network.num_addresses < 8:
        raise argparse.ArgumentTypeError(f"{text!r}: too small for the pods; give a /24, e.g. 10.213.0.0/24")
    return str(network)


def _secret(text: str) -> tuple[str, Path]:
    name, _, folder = text.partition("=")
    path = Path(folder).expanduser()
    if not name or not folder:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=FOLDER, e.g. s3-credentials=./secret")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {folder} is not a folder (a file per key of the Secret)")
    return name, path


def _delay(text: str) -> tuple[str, float]:
    pod, _, seconds = text.partition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = -1.0
    if not pod or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected POD=SECONDS, e.g. worker-0=75")
    return pod, value


def _render(args: argparse.Namespace, install_id: str | None = None):
    values = merge_values(args.values, args.sets)
    if args.code is not None:
        values = deep_merge(values, code_values(args.code))
    if install_id and not values.get("installId"):
        values["installId"] = install_id
    return render(values, release=args.release, namespace=args.namespace)


def _submit(args: argparse.Namespace) -> int:
    """Apply the release's objects. A job already there keeps its install id (the job id its
    checkpoint lease knows), as `helm upgrade` keeps it: submitting again is the same job."""
    rendered = _render(args)
    if args.dry_run:
        print(yaml.safe_dump_all(rendered.objects, sort_keys=False), end="")
        return 0
    cluster = Cluster()
    (job,) = [item for item in rendered.objects if item["kind"] in ("PyTorchJob", "TrainJob")]
    if kept := cluster.annotation(job, args.namespace, INSTALL_ID_ANNOTATION):
        rendered = _render(args, install_id=kept)
    for item in rendered.objects:
        print(cluster.apply(item, args.namespace))
    print(rendered.notes, file=sys.stderr)
    return 0


def _local(args: argparse.Namespace) -> int:
    from operator_scripts.cluster.status import progress_lines, trainer_status_source
    from operator_scripts.local.interruption import Interruption
    from operator_scripts.local.pods import LocalError
    from operator_scripts.local.run import run
    from operator_scripts.local.runtimes.process import ProcessRuntime

    rendered = _render(args)
    for line in rendered.notes.splitlines():  # render and submit print NOTES whole
        if line.startswith("DEPRECATED: "):
            print(f"ddp-ops local: {line}", file=sys.stderr)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ddp-local-"))
    if args.node_back_after is not None and args.node_deleted_after is not None:
        print(
            f"ddp-ops local: error: --node-back-after {args.node_back_after:g} and --node-deleted-after "
            f"{args.node_deleted_after:g}: give one (a frozen node either answers again or is deleted)",
            file=sys.stderr,
        )
        return 2
    losses = [
        NodeLossPlan(pod, seconds, args.node_back_after, args.node_deleted_after)
        for pod, seconds in args.freeze_node
    ]
    options = {
        "secrets": dict(args.secret),
        "timeout": args.timeout_s,
        "delays": dict(args.delay),
        "node_losses": losses,
        "node_grace_s": args.node_monitor_grace_period,
    }
    try:
        with Interruption().handled() as interruption:
            options["interruption"] = interruption
            if args.runtime == "docker":
                outcome = _local_in_docker(rendered, workdir, args.pod_subnet, options)
            else:
                outcome = run(rendered.objects, workdir, runtime=ProcessRuntime(args.pod_subnet), **options)
    except LocalError as error:
        print(f"ddp-ops local: error: {error}", file=sys.stderr)
        return 2
    print(f"pod logs under {workdir}", file=sys.stderr)
    succeeded = outcome.status in ("Succeeded", "Complete")
    quiet = succeeded or outcome.interrupted  # an interrupted run said how each pod ended
    for line in [] if quiet else outcome.failed_pods():  # as `kubectl describe pod` shows them
        print(line, file=sys.stderr)
    if start := outcome.start_line():
        print(start, file=sys.stderr)
    if outcome.kind == "TrainJob":
        source = trainer_status_source(outcome.trainer_status)
        print(*progress_lines(outcome.trainer_status, source), sep="\n", file=sys.stderr)
    print(outcome.summary(), flush=True)
    if outcome.interrupted:
        return 128 + signal.Signals[outcome.interrupted]  # as a shell reports a command its signal ended
    return 0 if succeeded else 1


def _local_in_docker(rendered, workdir: Path, subnet: str, options: dict):
    """The job's pods as containers, with the engine that answers or a private one."""
    from operator_scripts.image.engine import EngineError, engine
    from operator_scripts.local.pods import LocalError
    from operator_scripts.local.run import run
    from operator_scripts.local.runtimes.docker import DockerRuntime

    (job,) = [
        item["metadata"]["name"] for item in rendered.objects if item["kind"] in ("PyTorchJob", "TrainJob")
    ]
    try:
        with engine() as docker, DockerRuntime(docker, job, subnet) as runtime:
            return run(rendered.objects, workdir, runtime=runtime, **options)
    except EngineError as error:
        raise LocalError(str(error)) from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["estimate"]:
        from operator_scripts.reports.estimate import main as estimate

        return estimate(argv[1:])
    if argv[:1] == ["flight-recorder"]:
        from operator_scripts.reports.flight_recorder import main as flight_recorder

        return flight_recorder(argv[1:])
    args = build_parser().parse_args(argv)
    refusals: tuple[type[Exception], ...] = (ClusterError, ValuesError, CodeError)
    if importlib.util.find_spec("helm_python"):
        from helm_python import HelmError

        refusals += (HelmError,)
    elif args.command in HELM_COMMANDS:  # Helm's engine is the `ops` extra, being large
        print(
            f"ddp-ops {args.command}: error: needs Helm's engine (the 'ops' extra): run `make ops` "
            "in a checkout, else pip install 'ddp-trainer[ops]'",
            file=sys.stderr,
        )
        return 2
    try:
        if args.command == "render":
            rendered = _render(args)
            print(rendered.manifest, end="")
            print(rendered.notes, file=sys.stderr)
        elif args.command == "submit":
            return _submit(args)
        elif args.command == "status":
            print(format_status(Cluster().status(args.job, args.namespace)))
        elif args.command == "logs":
            cluster = Cluster()
            pod, container = cluster.rank0_pod(args.job, args.namespace)
            print(f"# rank 0: pod {pod}", file=sys.stderr)
            for line in cluster.log(pod, args.namespace, follow=args.follow, container=container):
                print(line, flush=True)
        elif args.command == "delete":
            print("\n".join(Cluster().uninstall(args.release, args.namespace)))
        elif args.command == "local":
            return _local(args)
    except refusals as error:
        # a chart's `fail` reaches us as Helm's "execution error at (template:line:col): why"
        why = HELM_FAIL_PREFIX.sub("", str(error))
        print(f"ddp-ops {args.command}: error: {why}".rstrip(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

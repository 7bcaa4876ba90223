"""`torchtpu-launch gke`, `skypilot` and `gke-serve`: manifests rendered from templates/, not run.

`gke` prints a JobSet manifest for GKE TPU node pools (then, as comments, the equivalent `xpk
workload create` command); `skypilot` prints a SkyPilot task. Both run one torchelastic agent
(torchtpu.launch.agent) per TPU host around the training command, so exit statuses, logs and the
restart contract are the same as with `local` and `tpu-vm`.

`gke-serve` prints a Deployment and a Service running vLLM's OpenAI server with torchtpu's
platform, one single-host TPU slice per replica (docs/serving.md).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from string import Template

from torchtpu.hardware import Topology, TopologyNameError, parse_topology
from torchtpu.train.fault import EXIT_CONFIG, RESTART_EXIT_CODES

TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")

# GKE node label per TPU generation and chips per multi-host VM (the TPU type name, which gcloud and
# xpk take, is the topology's: torchtpu.hardware).
_GENERATIONS = {
    "v4": ("tpu-v4-podslice", 4),
    "v5p": ("tpu-v5p-slice", 4),
    "v5e": ("tpu-v5-lite-podslice", 4),
    "v6e": ("tpu-v6e-slice", 4),
}


# The slice shapes each generation comes in (Cloud TPU / GKE documentation). v5e and v6e: these 2D
# shapes. v4 and v5p: the small 3D slices below, and from 4x4x4 on any AxBxC with A <= B <= C all
# multiples of 4 (the 4x4x4 cubes a pod is built from).
_SHAPES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_SMALL_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")


class RenderError(ValueError):
    pass


def valid_topology(slice_: Topology) -> bool:
    """Whether the slice's generation (v4, v5e, v5p, v6e) comes in the slice's shape."""
    if slice_.generation in ("v5e", "v6e"):
        return slice_.shape in _SHAPES_2D
    if slice_.shape in _SMALL_3D:
        return True
    dims = slice_.dims
    return len(dims) == 3 and list(dims) == sorted(dims) and all(d % 4 == 0 and d > 0 for d in dims)


def _valid_shapes(generation: str) -> str:
    if generation in ("v5e", "v6e"):
        return ", ".join(_SHAPES_2D)
    return ", ".join(_SMALL_3D) + ", then AxBxC with A <= B <= C multiples of 4 (4x4x4, 4x4x8, 4x8x8, 8x8x8, ...)"


def slice_shape(tpu: str, chips_per_host: int | None = None) -> dict:
    """'v5p:4x4x4' -> GKE labels, chips, hosts and the xpk/gcloud TPU type of one slice."""
    try:
        slice_ = parse_topology(tpu)
    except TopologyNameError:
        slice_ = None
    if slice_ is None or slice_.generation not in _GENERATIONS:
        raise RenderError(
            f"--tpu {tpu!r}: expected GENERATION:TOPOLOGY with GENERATION one of "
            f"{', '.join(_GENERATIONS)}, e.g. v5p:4x4x4 or v6e:8x8"
        )
    gen, topology, chips = slice_.generation, slice_.shape, slice_.chips
    if not valid_topology(slice_):
        raise RenderError(f"--tpu {tpu}: {gen} slices have no {topology} shape; valid shapes: {_valid_shapes(gen)}")
    label, per_host = _GENERATIONS[gen]
    if chips_per_host is None:
        # single-host v5e/v6e slices (up to 8 chips) put every chip on the one VM
        chips_per_host = chips if gen in ("v5e", "v6e") and chips <= 8 else min(per_host, chips)
    if chips % chips_per_host:
        raise RenderError(f"--tpu {tpu}: {chips} chips do not split into hosts of {chips_per_host} chips")
    return {
        "generation": gen,
        "accelerator": label,
        "topology": topology,
        "chips": chips,
        "chips_per_host": chips_per_host,
        "hosts_per_slice": chips // chips_per_host,
        "tpu_type": slice_.accelerator_type,
    }


# subcommand -> (its line in the list of subcommands, its own --help description)
_SUBCOMMANDS = {
    "gke": (
        "print a GKE JobSet manifest (and the xpk command)",
        "Render a JobSet manifest for GKE TPU node pools; it is printed, not applied.",
    ),
    "skypilot": (
        "print a SkyPilot task",
        "Render a SkyPilot task for a TPU VM pod slice; it is printed, not launched.",
    ),
}


def _add_parser(sub, name: str):
    """The subcommand's parser, with the options gke and skypilot share."""
    help, description = _SUBCOMMANDS[name]
    p = sub.add_parser(name, help=help, description=description)
    p.add_argument("--name", required=True, help="job name (lower case, digits and -)")
    p.add_argument("--tpu", required=True, help="slice as GENERATION:TOPOLOGY, e.g. v5p:4x4x4 (64 chips)")
    p.add_argument("--num-slices", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument(
        "--workdir", default=None, help="the working folder on each host (gke: the container's, default /app)"
    )
    p.add_argument("--log-dir", default="logs", help="per-attempt host logs, relative to the working folder")
    return p


def add_gke_parser(sub) -> None:
    p = _add_parser(sub, "gke")
    p.add_argument("--image", required=True, help="container image with torchtpu installed")
    p.add_argument("--cluster", default="CLUSTER", help="GKE cluster, for the xpk command")
    p.add_argument("--chips-per-host", type=int, default=None)
    p.add_argument(
        "--shutdown-timeout", type=int, default=120, help="seconds a preempted host gets to write its checkpoint"
    )


def add_skypilot_parser(sub) -> None:
    p = _add_parser(sub, "skypilot")
    p.add_argument("--runtime-version", default="v2-alpha-tpuv5", help="TPU VM software version")
    p.add_argument("--zone", default=None)


def _name(name: str) -> str:
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", name):
        raise RenderError(
            f"--name {name!r}: use lower-case letters, digits and '-' (starting with a letter, at most "
            "40 characters): it names Kubernetes objects and hosts"
        )
    return name


def _render(template: str, **values) -> str:
    with open(os.path.join(TEMPLATES, template), encoding="utf-8") as f:
        return Template(f.read()).substitute(**{k: str(v) for k, v in values.items()})


def render_gke(args, cmd: list[str]) -> str:
    """The JobSet manifest for `args`, the options of `torchtpu-launch gke`, running `cmd`."""
    name = _name(args.name)
    s = slice_shape(args.tpu, args.chips_per_host)
    megascale = ""
    if args.num_slices > 1:
        env = {
            "MEGASCALE_COORDINATOR_ADDRESS": f"{name}-slice-0-0.{name}:8080",
            "MEGASCALE_NUM_SLICES": str(args.num_slices),
            "MEGASCALE_PORT": "8080",
        }
        rows = [f'                    - name: {k}\n                      value: "{v}"' for k, v in env.items()]
        rows.append(
            "                    - name: MEGASCALE_SLICE_ID\n                      valueFrom:\n"
            "                        fieldRef:\n                          fieldPath: "
            "metadata.annotations['jobset.sigs.k8s.io/job-index']"
        )
        megascale = "\n".join(rows)
    return _render(
        "jobset.yaml",
        name=name,
        max_restarts=args.max_restarts,
        num_slices=args.num_slices,
        hosts_per_slice=s["hosts_per_slice"],
        nnodes=s["hosts_per_slice"] * args.num_slices,
        accelerator=s["accelerator"],
        topology=s["topology"],
        restart_codes=", ".join(str(c) for c in RESTART_EXIT_CODES),
        image=args.image,
        workdir=args.workdir or "/app",
        chips_per_host=s["chips_per_host"],
        megascale_env=megascale,
        command=shlex.join(cmd),
        log_dir=args.log_dir,
        shutdown_timeout=args.shutdown_timeout,
        grace_seconds=args.shutdown_timeout + 30,
    )


def xpk_command(args, cmd: list[str]) -> str:
    """The `xpk workload create` command equivalent to render_gke(args, cmd)."""
    s = slice_shape(args.tpu)
    multislice = args.num_slices > 1
    # Host 0 of the job: the first worker of the slice, or with several slices xpk's MEGASCALE coordinator.
    host0 = "${MEGASCALE_COORDINATOR_ADDRESS%%:*}" if multislice else "${TPU_WORKER_HOSTNAMES%%,*}"
    offset = f" --host-offset $((MEGASCALE_SLICE_ID * {s['hosts_per_slice']}))" if multislice else ""
    agent = (
        f"TORCHTPU_RDZV_HOST={host0} python3 -m torchtpu.launch.agent --nnodes {s['hosts_per_slice'] * args.num_slices} "
        f"--host-index auto{offset} --rdzv-endpoint auto:29400 --run-id {args.name} --max-restarts 0 "
        f"--log-dir {args.log_dir} -- " + shlex.join(cmd)
    )
    return shlex.join(
        [
            "xpk",
            "workload",
            "create",
            f"--cluster={args.cluster}",
            f"--workload={args.name}",
            f"--tpu-type={s['tpu_type']}",
            f"--num-slices={args.num_slices}",
            f"--docker-image={args.image}",
            f"--max-restarts={args.max_restarts}",
            "--command=" + agent,
        ]
    )


def render_skypilot(args, cmd: list[str]) -> str:
    """The SkyPilot task for `args`, the options of `torchtpu-launch skypilot`, running `cmd`."""
    name = _name(args.name)
    if args.num_slices != 1:
        raise RenderError(
            f"--num-slices {args.num_slices}: the SkyPilot task covers one TPU slice; use tpu-vm or gke for multislice"
        )
    s = slice_shape(args.tpu)
    return _render(
        "skypilot.yaml",
        name=name,
        accelerator=f"tpu-{s['tpu_type']}",
        runtime_version=args.runtime_version,
        cloud_line=f"  cloud: gcp\n  zone: {args.zone}" if args.zone else "  cloud: gcp",
        workdir=args.workdir or ".",
        hosts_per_slice=s["hosts_per_slice"],
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        command=shlex.join(cmd),
    )


def gke(args, cmd: list[str]) -> int:
    try:
        text = render_gke(args, cmd)
        xpk = xpk_command(args, cmd)
    except RenderError as e:
        print(f"torchtpu-launch gke: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(text)
    sys.stdout.write(f"\n# The same job with xpk (which writes a JobSet like the one above):\n# {xpk}\n")
    return 0


def _print_rendered(command: str, render, *render_args) -> int:
    """Print what `render` makes of `render_args`; a RenderError is one line on stderr (exit 2)."""
    try:
        text = render(*render_args)
    except RenderError as e:
        print(f"torchtpu-launch {command}: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(text)
    return 0


def skypilot(args, cmd: list[str]) -> int:
    return _print_rendered("skypilot", render_skypilot, args, cmd)


# ----------------------------------------------------------------------------------- serving

SERVE_PORT = 8000  # vLLM's own default


def add_gke_serve_parser(sub) -> None:
    p = sub.add_parser(
        "gke-serve",
        help="print a GKE Deployment + Service serving a model with vLLM",
        description="Render a Deployment and a Service running vLLM's OpenAI server with torchtpu's "
        "platform on GKE TPU node pools, one TPU host per replica; printed, not applied. Options after "
        "-- go to the server (e.g. -- --max-model-len 8192).",
    )
    p.add_argument("--name", required=True, help="deployment and service name (lower case, digits and -)")
    p.add_argument("--tpu", required=True, help="one host's slice as GENERATION:TOPOLOGY, e.g. v6e:2x4 (8 chips)")
    p.add_argument("--image", required=True, help="container image with torchtpu and vLLM installed (make install)")
    p.add_argument(
        "--model",
        required=True,
        help="what the server loads: a Hugging Face folder in the container (baked in or on a mounted "
        "volume, e.g. a torchtpu-train export) or a Hugging Face Hub id",
    )
    p.add_argument("--replicas", type=int, default=1, help="pods, each on its own TPU host (default 1)")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="chips the model is split over (default: every chip of the host)",
    )
    p.add_argument("--port", type=int, default=SERVE_PORT, help=f"server and service port (default {SERVE_PORT})")
    p.add_argument(
        "--service-type",
        default="ClusterIP",
        choices=("ClusterIP", "LoadBalancer", "NodePort"),
        help="how the Service is reached (default ClusterIP: inside the cluster)",
    )
    p.add_argument(
        "--startup-minutes",
        type=int,
        default=30,
        help="how long a pod may take to load and compile before /health must answer (default 30)",
    )
    p.add_argument("--workdir", default=None, help="the container's working folder (default /app)")
    p.add_argument(
        "--api-key-secret",
        default=None,
        metavar="SECRET",
        help="a Kubernetes Secret holding the server's API key: the container reads it as VLLM_API_KEY, "
        "and requests to /v1 then need 'Authorization: Bearer KEY' (docs/serving.md says how to create it)",
    )
    p.add_argument(
        "--api-key-secret-key",
        default="api-key",
        metavar="KEY",
        help="the entry of --api-key-secret that holds the key (default api-key)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help=f"render a {'/'.join(EXPOSED)} Service without --api-key-secret: anyone who reaches its "
        "address can use the server",
    )


# Service types that give the server an address outside the cluster.
EXPOSED = ("LoadBalancer", "NodePort")
_SECRET_NAME = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"  # a Kubernetes object name (DNS subdomain)
_SECRET_KEY = r"[-._a-zA-Z0-9]{1,253}"  # a Secret's data key


def _api_key_env(args, server_args: list[str]) -> list[dict]:
    """The container's environment for the API key: VLLM_API_KEY from the Secret's entry, or
    nothing. An exposed Service with no key is refused unless --allow-unauthenticated says so; a key
    on the server's command line (--api-key after --) is refused, as the manifest would show it."""
    if any(a == "--api-key" or a.startswith("--api-key=") for a in server_args):
        raise RenderError(
            "--api-key after --: the key would stand in the manifest in plain text; put it in a Kubernetes "
            "Secret and pass --api-key-secret SECRET (docs/serving.md)"
        )
    secret = args.api_key_secret
    if secret is None:
        if args.service_type in EXPOSED and not args.allow_unauthenticated:
            raise RenderError(
                f"--service-type {args.service_type} exposes the server outside the cluster with no API key: pass "
                "--api-key-secret SECRET (a Kubernetes Secret holding the key), or --allow-unauthenticated if "
                "anyone who reaches the address may use it"
            )
        return []
    if not re.fullmatch(_SECRET_NAME, secret):
        raise RenderError(f"--api-key-secret {secret!r}: not a Kubernetes Secret name (lower case, digits, '-', '.')")
    key = args.api_key_secret_key
    if not re.fullmatch(_SECRET_KEY, key):
        raise RenderError(f"--api-key-secret-key {key!r}: not a Secret entry name (letters, digits, '-', '_', '.')")
    return [{"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}]


def render_gke_serve(args, server_args: list[str]) -> str:
    """The Deployment and Service for `args`, the options of `torchtpu-launch gke-serve`; each pod
    runs vLLM's OpenAI server with `server_args` after the options rendered from `args`."""
    import json

    name = _name(args.name)
    s = slice_shape(args.tpu)
    if s["hosts_per_slice"] != 1:
        raise RenderError(
            f"--tpu {args.tpu}: {s['chips']} chips on {s['hosts_per_slice']} hosts; a server runs on one "
            "TPU host (tensor parallelism over its chips): pick a single-host slice such as v5e:2x4, "
            "v6e:2x4, v5p:2x2x1 or v4:2x2x1, and --replicas for more throughput"
        )
    chips = s["chips_per_host"]
    tp = chips if args.tensor_parallel_size is None else args.tensor_parallel_size
    if not 1 <= tp <= chips:
        raise RenderError(
            f"--tensor-parallel-size {tp}: the host of --tpu {args.tpu} has {chips} chips; use 1 to {chips}"
        )
    for option, value, low in (("--replicas", args.replicas, 0), ("--startup-minutes", args.startup_minutes, 1)):
        if value < low:
            raise RenderError(f"{option} {value}: must be at least {low}")
    if not 1 <= args.port <= 65535:
        raise RenderError(f"--port {args.port}: not a TCP port (1 to 65535)")
    env = _api_key_env(args, server_args)
    own = ["--model", args.model, "--host", "0.0.0.0", "--port", str(args.port), "--tensor-parallel-size", str(tp)]
    return _render(
        "serve_gke.yaml",
        name=name,
        replicas=args.replicas,
        accelerator=s["accelerator"],
        topology=s["topology"],
        image=args.image,
        workdir=args.workdir or "/app",
        args=json.dumps(own + list(server_args)),  # a JSON list is a YAML flow sequence, every item quoted
        env=json.dumps(env),
        port=args.port,
        chips_per_host=chips,
        startup_checks=args.startup_minutes * 6,  # probes every 10 s
        service_type=args.service_type,
    )


def gke_serve(args, server_args: list[str]) -> int:
    return _print_rendered("gke-serve", render_gke_serve, args, server_args)

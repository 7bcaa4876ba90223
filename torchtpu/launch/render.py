"""`torchtpu-launch gke` and `torchtpu-launch skypilot`: manifests rendered from templates/, not run.

`gke` prints a JobSet manifest for GKE TPU node pools (then, as comments, the equivalent `xpk
workload create` command); `skypilot` prints a SkyPilot task. Both run one torchelastic agent
(torchtpu.launch.agent) per TPU host around the training command, so exit statuses, logs and the
restart contract are the same as with `local` and `tpu-vm`.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from string import Template

from torchtpu.train.fault import EXIT_CONFIG

TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")

# GKE node label per TPU generation, TPU-type name prefix (xpk / gcloud), TensorCores per chip in
# that name (v4 and v5p count cores, v5e and v6e chips), and chips per multi-host VM.
_GENERATIONS = {
    "v4": ("tpu-v4-podslice", "v4", 2, 4),
    "v5p": ("tpu-v5p-slice", "v5p", 2, 4),
    "v5e": ("tpu-v5-lite-podslice", "v5litepod", 1, 4),
    "v6e": ("tpu-v6e-slice", "v6e", 1, 4),
}


class RenderError(ValueError):
    pass


def slice_shape(tpu: str, chips_per_host: int | None = None) -> dict:
    """'v5p:4x4x4' -> GKE labels, chips, hosts and the xpk/gcloud TPU type of one slice."""
    m = re.fullmatch(r"(v4|v5p|v5e|v6e):(\d+(?:x\d+){1,2})", tpu)
    if not m:
        raise RenderError(
            f"--tpu {tpu!r}: expected GENERATION:TOPOLOGY with GENERATION one of "
            f"{', '.join(_GENERATIONS)}, e.g. v5p:4x4x4 or v6e:8x8"
        )
    gen, topology = m.groups()
    label, prefix, cores, per_host = _GENERATIONS[gen]
    chips = math.prod(int(n) for n in topology.split("x"))
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
        "tpu_type": f"{prefix}-{chips * cores}",
    }


def _common(p) -> None:
    p.add_argument("--name", required=True, help="job name (lower case, digits and -)")
    p.add_argument("--tpu", required=True, help="slice as GENERATION:TOPOLOGY, e.g. v5p:4x4x4 (64 chips)")
    p.add_argument("--num-slices", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--log-dir", default="logs", help="per-attempt host logs, relative to the working folder")


def add_gke_parser(sub) -> None:
    p = sub.add_parser(
        "gke",
        help="print a GKE JobSet manifest (and the xpk command)",
        description="Render a JobSet manifest for GKE TPU node pools; it is printed, not applied.",
    )
    _common(p)
    p.add_argument("--image", required=True, help="container image with torchtpu installed")
    p.add_argument("--cluster", default="CLUSTER", help="GKE cluster, for the xpk command")
    p.add_argument("--chips-per-host", type=int, default=None)
    p.add_argument(
        "--shutdown-timeout", type=int, default=120, help="seconds a preempted host gets to write its checkpoint"
    )


def add_skypilot_parser(sub) -> None:
    p = sub.add_parser(
        "skypilot",
        help="print a SkyPilot task",
        description="Render a SkyPilot task for a TPU VM pod slice; it is printed, not launched.",
    )
    _common(p)
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


def render_gke(
    name: str,
    tpu: str,
    image: str,
    cmd: list[str],
    num_slices: int = 1,
    max_restarts: int = 3,
    chips_per_host: int | None = None,
    workdir: str | None = None,
    log_dir: str = "logs",
    shutdown_timeout: int = 120,
) -> str:
    name = _name(name)
    s = slice_shape(tpu, chips_per_host)
    megascale = ""
    if num_slices > 1:
        env = {
            "MEGASCALE_COORDINATOR_ADDRESS": f"{name}-slice-0-0.{name}:8080",
            "MEGASCALE_NUM_SLICES": str(num_slices),
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
        max_restarts=max_restarts,
        num_slices=num_slices,
        hosts_per_slice=s["hosts_per_slice"],
        nnodes=s["hosts_per_slice"] * num_slices,
        accelerator=s["accelerator"],
        topology=s["topology"],
        image=image,
        workdir=workdir or "/app",
        chips_per_host=s["chips_per_host"],
        megascale_env=megascale,
        command=shlex.join(cmd),
        log_dir=log_dir,
        shutdown_timeout=shutdown_timeout,
        grace_seconds=shutdown_timeout + 30,
    )


def xpk_command(
    name: str,
    tpu: str,
    image: str,
    cmd: list[str],
    num_slices: int = 1,
    max_restarts: int = 3,
    cluster: str = "CLUSTER",
    log_dir: str = "logs",
) -> str:
    s = slice_shape(tpu)
    # Host 0 of the job: the first worker of the slice, or with several slices xpk's MEGASCALE coordinator.
    host0 = "${MEGASCALE_COORDINATOR_ADDRESS%%:*}" if num_slices > 1 else "${TPU_WORKER_HOSTNAMES%%,*}"
    offset = f" --host-offset $((MEGASCALE_SLICE_ID * {s['hosts_per_slice']}))" if num_slices > 1 else ""
    agent = (
        f"TORCHTPU_RDZV_HOST={host0} python3 -m torchtpu.launch.agent --nnodes {s['hosts_per_slice'] * num_slices} "
        f"--host-index auto{offset} --rdzv-endpoint auto:29400 --run-id {name} --max-restarts 0 "
        f"--log-dir {log_dir} -- " + shlex.join(cmd)
    )
    return shlex.join(
        [
            "xpk",
            "workload",
            "create",
            f"--cluster={cluster}",
            f"--workload={name}",
            f"--tpu-type={s['tpu_type']}",
            f"--num-slices={num_slices}",
            f"--docker-image={image}",
            f"--max-restarts={max_restarts}",
            "--command=" + agent,
        ]
    )


def render_skypilot(
    name: str,
    tpu: str,
    cmd: list[str],
    num_slices: int = 1,
    max_restarts: int = 3,
    workdir: str | None = None,
    log_dir: str = "logs",
    runtime_version: str = "v2-alpha-tpuv5",
    zone: str | None = None,
) -> str:
    name = _name(name)
    if num_slices != 1:
        raise RenderError(
            f"--num-slices {num_slices}: the SkyPilot task covers one TPU slice; use tpu-vm or gke for multislice"
        )
    s = slice_shape(tpu)
    return _render(
        "skypilot.yaml",
        name=name,
        accelerator=f"tpu-{s['tpu_type']}",
        runtime_version=runtime_version,
        cloud_line=f"  cloud: gcp\n  zone: {zone}" if zone else "  cloud: gcp",
        workdir=workdir or ".",
        hosts_per_slice=s["hosts_per_slice"],
        max_restarts=max_restarts,
        log_dir=log_dir,
        command=shlex.join(cmd),
    )


def gke(args, cmd: list[str]) -> int:
    try:
        text = render_gke(
            args.name,
            args.tpu,
            args.image,
            cmd,
            args.num_slices,
            args.max_restarts,
            args.chips_per_host,
            args.workdir,
            args.log_dir,
            args.shutdown_timeout,
        )
        xpk = xpk_command(
            args.name, args.tpu, args.image, cmd, args.num_slices, args.max_restarts, args.cluster, args.log_dir
        )
    except RenderError as e:
        print(f"torchtpu-launch gke: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(text)
    sys.stdout.write(f"\n# The same job with xpk (which writes a JobSet like the one above):\n# {xpk}\n")
    return 0


def skypilot(args, cmd: list[str]) -> int:
    try:
        text = render_skypilot(
            args.name,
            args.tpu,
            cmd,
            args.num_slices,
            args.max_restarts,
            args.workdir,
            args.log_dir,
            args.runtime_version,
            args.zone,
        )
    except RenderError as e:
        print(f"torchtpu-launch skypilot: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(text)
    return 0

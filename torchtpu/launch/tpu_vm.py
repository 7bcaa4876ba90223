"""`torchtpu-launch tpu-vm NAME --zone Z ...`: the job on every worker of Cloud TPU VM slice(s).

The launcher writes one bash script and runs it (`--dry-run` prints it instead, so what is shown is
exactly what would run):

1. Preflight, on every worker of every slice (`gcloud compute tpus tpu-vm ssh --worker=all`): the
   processes holding `/dev/accel*` or `/dev/vfio/*` and a `/tmp/libtpu_lockfile` left by a dead
   job are what make the next start fail with "TPU is already in use". They are listed; with
   `--kill-stale` they are killed and the lock file removed, otherwise the launch stops there.
2. The internal address of worker 0 of slice 0 (`gcloud ... describe`): the torchelastic
   rendezvous, and for several slices the MEGASCALE coordinator.
3. On every worker, one torchelastic agent (torchtpu.launch.agent) around the training command.
   With `--num-slices S` the slices are the TPU VMs NAME-0 ... NAME-(S-1) (as queued resources
   name them) and each gets MEGASCALE_COORDINATOR_ADDRESS / NUM_SLICES / SLICE_ID / PORT.
   The script waits for every slice and exits with the first non-zero status.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

from torchtpu.train.fault import EXIT_CONFIG

RDZV_PORT = 29400  # torchelastic's customary rendezvous port
MEGASCALE_PORT = 8080  # libtpu's DCN coordination port

_PREFLIGHT = r"""holders=$(sudo lsof -t /dev/accel* /dev/vfio/[0-9]* 2>/dev/null | sort -u | tr '\n' ' ')
lock=$(ls /tmp/libtpu_lockfile 2>/dev/null)
if [ -z "$holders$lock" ]; then echo "$(hostname): TPU free"; exit 0; fi
for p in $holders; do echo "$(hostname): TPU held by pid $p: $(ps -o args= -p $p | cut -c1-120)"; done
[ -n "$lock" ] && echo "$(hostname): stale /tmp/libtpu_lockfile"
if [ "{kill}" = 1 ]; then
  [ -n "$holders" ] && sudo kill -9 $holders; sudo rm -f /tmp/libtpu_lockfile; echo "$(hostname): cleaned"; exit 0
fi
echo "$(hostname): rerun with --kill-stale to kill these and remove the lock file"; exit 3"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tpu-vm",
        help="every worker of Cloud TPU VM slice(s), over gcloud ssh",
        description="Run CMD under torchelastic on every worker of the TPU VM NAME.",
    )
    p.add_argument("name", help="the TPU VM (with --num-slices S: NAME-0 .. NAME-<S-1>)")
    p.add_argument("--zone", required=True)
    p.add_argument("--project", default=None)
    p.add_argument("--num-slices", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--workdir", default="~", help="folder on the workers to run CMD in (default: home)")
    p.add_argument(
        "--kill-stale",
        action="store_true",
        help="kill processes holding the TPU and remove a stale /tmp/libtpu_lockfile",
    )
    p.add_argument("--dry-run", action="store_true", help="print the exact commands instead of running them")


def _gcloud(verb: str, name: str, zone: str, project: str | None) -> list[str]:
    out = ["gcloud", "compute", "tpus", "tpu-vm", verb, name, f"--zone={zone}"]
    if project:
        out.append(f"--project={project}")
    return out


def slice_names(name: str, num_slices: int) -> list[str]:
    return [name] if num_slices == 1 else [f"{name}-{s}" for s in range(num_slices)]


def script(
    name: str,
    zone: str,
    project: str | None,
    cmd: list[str],
    num_slices: int = 1,
    max_restarts: int = 0,
    kill_stale: bool = False,
    workdir: str = "~",
) -> str:
    """The bash script that launches the job (what --dry-run prints)."""
    names = slice_names(name, num_slices)
    q = shlex.join
    lines = ["#!/bin/bash", "set -uo pipefail", "", "# 1. preflight: nothing may hold the TPU chips"]
    preflight = _PREFLIGHT.replace("{kill}", "1" if kill_stale else "0")
    for n in names:
        lines.append(q(_gcloud("ssh", n, zone, project) + ["--worker=all", f"--command={preflight}"]) + " || exit 1")
    lines += [
        "",
        "# 2. worker 0 of slice 0: the rendezvous (and MEGASCALE coordinator) address",
        "COORDINATOR=$("
        + q(_gcloud("describe", names[0], zone, project) + ["--format=value(networkEndpoints[0].ipAddress)"])
        + ")",
        "WORKERS=$("
        + q(_gcloud("describe", names[0], zone, project) + ["--format=value(networkEndpoints.len())"])
        + ")",
        f"NNODES=$((WORKERS * {num_slices}))",
        "",
        "# 3. one torchelastic agent per worker",
        "pids=()",
    ]
    for s, n in enumerate(names):
        env = []
        if num_slices > 1:
            env = [
                f"MEGASCALE_COORDINATOR_ADDRESS=$COORDINATOR:{MEGASCALE_PORT}",
                f"MEGASCALE_NUM_SLICES={num_slices}",
                f"MEGASCALE_SLICE_ID={s}",
                f"MEGASCALE_PORT={MEGASCALE_PORT}",
            ]
        remote = (
            f"cd {workdir} && "
            + " ".join(env + ["python3", "-m", "torchtpu.launch.agent"])
            + " --nnodes $NNODES --host-index auto"
            + (f" --host-offset $(({s} * WORKERS))" if num_slices > 1 else "")
            + f" --rdzv-endpoint $COORDINATOR:{RDZV_PORT} --run-id {shlex.quote(name)}"
            + f" --max-restarts {max_restarts} --log-dir logs -- "
            + q(cmd)
        )
        ssh = q(_gcloud("ssh", n, zone, project) + ["--worker=all"])
        # The remote command is in double quotes so that $COORDINATOR, $NNODES, $WORKERS expand here.
        lines.append(f'{ssh} --command="{_dq(remote)}" &')
        lines.append("pids+=($!)")
    lines += [
        "",
        "status=0",
        'for p in "${pids[@]}"; do wait "$p"; s=$?; [ "$status" = 0 ] && status=$s; done',
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def _dq(text: str) -> str:
    """Quote for inside bash double quotes, keeping $VAR and $((..)) expansions."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")


def run(args, cmd: list[str]) -> int:
    if args.num_slices < 1:
        print(f"torchtpu-launch tpu-vm: error: --num-slices {args.num_slices}: need at least 1", file=sys.stderr)
        return EXIT_CONFIG
    text = script(
        args.name,
        args.zone,
        args.project,
        cmd,
        num_slices=args.num_slices,
        max_restarts=args.max_restarts,
        kill_stale=args.kill_stale,
        workdir=args.workdir,
    )
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    return subprocess.call(["bash", "-c", text])

"""torchtpu-launch tpu-vm --dry-run, gke and skypilot: the exact commands and manifests they print.

The expected lines are written out here by hand (what a user would type); the YAML is parsed and
checked field by field against what GKE's JobSet controller and SkyPilot read.
"""

from __future__ import annotations

import contextlib
import io
import subprocess

import pytest
import yaml

from torchtpu.launch.cli import main

TRAIN = ["torchtpu-train", "--config", "train_configs/llama3_70b.toml"]


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_tpu_vm_dry_run_prints_the_exact_commands():
    code, out, _ = _run("tpu-vm", "my-v5p", "--zone", "us-east5-a", "--project", "proj", "--dry-run", "--", *TRAIN)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "#!/bin/bash"
    # preflight on every worker, before anything starts
    pre = [ln for ln in lines if "--worker=all '--command=holders=" in ln]
    assert len(pre) == 1
    assert pre[0].startswith("gcloud compute tpus tpu-vm ssh my-v5p --zone=us-east5-a --project=proj --worker=all ")
    assert "/dev/accel*" in out and "/dev/vfio/" in out and "/tmp/libtpu_lockfile" in out
    assert 'if [ "0" = 1 ]' in out  # no --kill-stale: report and stop
    assert (
        "COORDINATOR=$(gcloud compute tpus tpu-vm describe my-v5p --zone=us-east5-a --project=proj "
        "'--format=value(networkEndpoints[0].ipAddress)')"
    ) in lines
    assert "NNODES=$((WORKERS * 1))" in lines
    assert (
        "gcloud compute tpus tpu-vm ssh my-v5p --zone=us-east5-a --project=proj --worker=all "
        '--command="cd ~ && python3 -m torchtpu.launch.agent --nnodes $NNODES --host-index auto '
        "--rdzv-endpoint $COORDINATOR:29400 --run-id my-v5p --max-restarts 0 --log-dir logs -- "
        'torchtpu-train --config train_configs/llama3_70b.toml" &'
    ) in lines
    assert "MEGASCALE_" not in out
    # the printed script is valid bash
    assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0


def test_tpu_vm_multislice_sets_megascale_and_kill_stale_cleans():
    code, out, _ = _run(
        "tpu-vm",
        "pod",
        "--zone",
        "z",
        "--num-slices",
        "2",
        "--kill-stale",
        "--max-restarts",
        "3",
        "--dry-run",
        "--",
        "torchtpu-train",
    )
    assert code == 0
    assert 'if [ "1" = 1 ]' in out and "sudo rm -f /tmp/libtpu_lockfile" in out
    launches = [ln for ln in out.splitlines() if "torchtpu.launch.agent" in ln]
    assert len(launches) == 2
    for s, ln in enumerate(launches):
        assert ln.startswith(f"gcloud compute tpus tpu-vm ssh pod-{s} --zone=z --worker=all ")
        assert (
            f"MEGASCALE_COORDINATOR_ADDRESS=$COORDINATOR:8080 MEGASCALE_NUM_SLICES=2 MEGASCALE_SLICE_ID={s} "
            "MEGASCALE_PORT=8080 python3 -m torchtpu.launch.agent"
        ) in ln
        assert f"--host-offset $(({s} * WORKERS))" in ln and "--max-restarts 3" in ln
    assert "NNODES=$((WORKERS * 2))" in out
    assert "describe pod-0 " in out
    assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0


def test_gke_jobset_manifest_and_xpk_command():
    code, out, _ = _run(
        "gke",
        "--name",
        "llama70b",
        "--tpu",
        "v5p:4x4x4",
        "--image",
        "gcr.io/p/torchtpu:1",
        "--num-slices",
        "2",
        "--max-restarts",
        "5",
        "--cluster",
        "c1",
        "--",
        *TRAIN,
    )
    assert code == 0
    doc = yaml.safe_load(out)
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert doc["metadata"]["name"] == "llama70b"
    fp = doc["spec"]["failurePolicy"]
    assert fp["maxRestarts"] == 5
    assert fp["rules"] == [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]
    (rjob,) = doc["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 2
    job = rjob["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 16  # 64 v5p chips, 4 per host
    assert job["backoffLimit"] == 0
    # exit 42 and 127-255 (killed by a signal: 137 SIGKILL / OOM) are not failed by the policy: they fail
    # the Job via backoffLimit, which JobSet restarts (as xpk's JobSet does); 1 and 2 end the JobSet
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "NotIn"
    assert rule["onExitCodes"]["containerName"] == "trainer"
    assert rule["onExitCodes"]["values"] == [42, *range(127, 256)]
    assert len(rule["onExitCodes"]["values"]) <= 255  # Kubernetes' limit on the list
    pod = job["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["restartPolicy"] == "Never"
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "4x4x4",
    }
    (c,) = pod["containers"]
    assert c["name"] == "trainer" and c["image"] == "gcr.io/p/torchtpu:1"
    assert c["resources"]["limits"] == {"google.com/tpu": 4}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "llama70b-slice-0-0.llama70b:8080"
    assert env["MEGASCALE_NUM_SLICES"] == "2"
    assert "MEGASCALE_SLICE_ID" in env
    script = c["command"][2]
    assert c["command"][:2] == ["bash", "-c"]
    assert script == (
        "exec python3 -m torchtpu.launch.agent --nnodes 32 --host-index $((SLICE_ID * 16 + HOST_IN_SLICE)) "
        "--rdzv-endpoint llama70b-slice-0-0.llama70b:29400 --run-id llama70b --max-restarts 0 "
        "--shutdown-timeout 120 --log-dir logs -- torchtpu-train --config train_configs/llama3_70b.toml"
    )
    xpk = [ln for ln in out.splitlines() if ln.startswith("# xpk ")]
    assert len(xpk) == 1
    assert xpk[0].startswith(
        "# xpk workload create --cluster=c1 --workload=llama70b --tpu-type=v5p-128 --num-slices=2 "
        "--docker-image=gcr.io/p/torchtpu:1 --max-restarts=5 '--command="
    )


def test_gke_single_slice_has_no_megascale():
    code, out, _ = _run("gke", "--name", "j", "--tpu", "v6e:2x4", "--image", "img", "--", "torchtpu-train")
    assert code == 0
    doc = yaml.safe_load(out)
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == 1  # a v6e 2x4 slice is one 8-chip host
    c = job["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"google.com/tpu": 8}
    assert not any(e["name"].startswith("MEGASCALE") for e in c["env"])
    assert job["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"


def test_skypilot_task():
    code, out, _ = _run("skypilot", "--name", "llama70b", "--tpu", "v5p:4x4x4", "--max-restarts", "2", "--", *TRAIN)
    assert code == 0
    doc = yaml.safe_load(out)
    assert doc["name"] == "llama70b"
    assert doc["resources"]["accelerators"] == "tpu-v5p-128"
    assert doc["resources"]["accelerator_args"]["tpu_vm"] is True
    assert doc["num_nodes"] == 1
    assert doc["run"].replace("\\\n", " ").split() == (
        "python3 -m torchtpu.launch.agent --nnodes 16 --host-index auto --rdzv-endpoint auto:29400 --run-id llama70b "
        "--max-restarts 2 --log-dir logs -- torchtpu-train --config train_configs/llama3_70b.toml".split()
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["gke", "--name", "x", "--tpu", "v5p-128", "--image", "i", "--", "t"], "expected GENERATION:TOPOLOGY"),
        (["gke", "--name", "Bad_Name", "--tpu", "v5p:2x2x1", "--image", "i", "--", "t"], "--name 'Bad_Name'"),
        (
            ["gke", "--name", "x", "--tpu", "v6e:2x2x2", "--image", "i", "--", "t"],
            "--tpu v6e:2x2x2: v6e slices have no 2x2x2 shape; valid shapes: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16",
        ),
        (
            ["skypilot", "--name", "x", "--tpu", "v5p:4x4x6", "--", "t"],
            "valid shapes: 2x2x1, 2x2x2, 2x2x4, 2x4x4, then",
        ),
        (["skypilot", "--name", "x", "--tpu", "v5p:2x2x1", "--num-slices", "2", "--", "t"], "--num-slices 2"),
        (["local", "--num-hosts", "2", "--devices-per-host", "4"], "no training command"),
        (
            ["local", "--num-hosts", "2", "--devices-per-host", "4", "--", "torchtpu-train", "--training.stpes", "3"],
            "stpes",
        ),
    ],
)
def test_usage_errors_exit_2_with_one_line(argv, message):
    code, out, err = _run(*argv)
    assert code == 2
    assert message in err, err


def test_help_examples_run():
    """Every example `torchtpu-launch --help` shows runs: local and tpu-vm with --dry-run (the help
    says so), gke and skypilot as they are (they only print)."""
    from torchtpu.launch.cli import _EXAMPLES

    examples = [ln.split()[1:] for ln in _EXAMPLES.splitlines() if ln.startswith("  torchtpu-launch ")]
    assert [argv[0] for argv in examples] == ["local", "tpu-vm", "gke", "skypilot"]
    for argv in examples:
        if argv[0] == "local":
            argv = [*argv[: argv.index("--")], "--dry-run", *argv[argv.index("--") :]]
        code, out, err = _run(*argv)
        assert code == 0, (argv, err)
        assert "torchtpu.launch.agent" in out, (argv, out)
        if argv[0] == "local":  # two hosts of 4 XLA CPU devices
            assert "# host 1" in out and out.count("XLA_FLAGS=--xla_force_host_platform_device_count=4") == 2

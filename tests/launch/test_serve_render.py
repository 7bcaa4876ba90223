"""torchtpu-launch gke-serve: the Deployment and Service it prints, field by field as Kubernetes reads
them, and the server's command line as vLLM's own argument parser reads it."""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml

from torchtpu.launch.cli import main

SERVER = ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _render(*argv: str) -> tuple[dict, dict]:
    code, out, err = _run("gke-serve", *argv)
    assert code == 0, err
    deployment, service = yaml.safe_load_all(out)
    return deployment, service


def test_deployment_and_service_for_one_v6e_host():
    deployment, service = _render(
        "--name",
        "llama8b",
        "--tpu",
        "v6e:2x4",
        "--image",
        "gcr.io/p/torchtpu:1",
        "--model",
        "/models/hf_step_1000",
        "--",
        "--max-model-len",
        "8192",
        "--dtype",
        "bfloat16",
    )
    assert (deployment["apiVersion"], deployment["kind"]) == ("apps/v1", "Deployment")
    assert deployment["metadata"]["name"] == "llama8b"
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] == labels == {"app": "llama8b"}
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (c,) = pod["containers"]
    assert c["image"] == "gcr.io/p/torchtpu:1"
    assert c["command"] == SERVER
    assert c["args"] == [
        "--model",
        "/models/hf_step_1000",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "8",  # every chip of the 8-chip host
        "--max-model-len",
        "8192",
        "--dtype",
        "bfloat16",
    ]
    assert c["resources"]["limits"] == c["resources"]["requests"] == {"google.com/tpu": 8}
    assert c["env"] == []  # a ClusterIP Service with no --api-key-secret: no key
    assert c["ports"] == [{"name": "http", "containerPort": 8000}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 30 * 60

    assert (service["apiVersion"], service["kind"]) == ("v1", "Service")
    assert service["metadata"]["name"] == "llama8b"
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == labels
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_options_reach_the_manifest_and_vllm_parses_the_server_arguments():
    deployment, service = _render(
        "--name",
        "qwen",
        "--tpu",
        "v5p:2x2x1",
        "--image",
        "img",
        "--model",
        "Qwen/Qwen3-0.6B",
        "--replicas",
        "3",
        "--tensor-parallel-size",
        "2",
        "--port",
        "9000",
        "--service-type",
        "LoadBalancer",
        "--api-key-secret",
        "qwen-key",
        "--startup-minutes",
        "10",
        "--",
        "--enable-prefix-caching",
    )
    assert deployment["spec"]["replicas"] == 3
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"] == {"google.com/tpu": 4}  # a v5p 2x2x1 host has 4 chips
    assert c["ports"] == [{"name": "http", "containerPort": 9000}]
    assert c["startupProbe"]["failureThreshold"] == 60
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"][0]["port"] == 9000
    assert c["env"] == [{"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "qwen-key", "key": "api-key"}}}]

    # what the container runs is a command line vLLM's OpenAI server accepts
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(c["args"])
    assert (ns.model, ns.host, ns.port, ns.tensor_parallel_size) == ("Qwen/Qwen3-0.6B", "0.0.0.0", 9000, 2)
    assert ns.enable_prefix_caching is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tpu", "v5p:4x4x4"], "on 16 hosts; a server runs on one TPU host"),
        (
            ["--tpu", "v6e:2x4", "--tensor-parallel-size", "16"],
            "--tensor-parallel-size 16: the host of --tpu v6e:2x4 has 8",
        ),
        (["--tpu", "v6e:2x4", "--port", "0"], "--port 0: not a TCP port"),
        (["--tpu", "v6e-8"], "expected GENERATION:TOPOLOGY"),
        (["--tpu", "v6e:2x4", "--name", "Bad_Name"], "--name 'Bad_Name'"),
        (
            ["--tpu", "v6e:2x4", "--service-type", "LoadBalancer"],
            "--service-type LoadBalancer exposes the server outside the cluster with no API key: pass "
            "--api-key-secret SECRET",
        ),
        (["--tpu", "v6e:2x4", "--service-type", "NodePort"], "or --allow-unauthenticated if anyone"),
        (["--tpu", "v6e:2x4", "--api-key-secret", "Key_1"], "--api-key-secret 'Key_1': not a Kubernetes Secret"),
        (
            ["--tpu", "v6e:2x4", "--api-key-secret", "k", "--api-key-secret-key", "a/b"],
            "--api-key-secret-key 'a/b': not a Secret entry",
        ),
    ],
)
def test_bad_options_exit_2_with_one_line(argv, message):
    base = {"--name": "srv", "--image": "img", "--model": "/m"}
    for i in range(0, len(argv), 2):
        base[argv[i]] = argv[i + 1]
    code, out, err = _run("gke-serve", *[x for kv in base.items() for x in kv])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


def _container(*argv: str) -> dict:
    deployment, _ = _render("--name", "srv", "--tpu", "v6e:2x4", "--image", "img", "--model", "/m", *argv)
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_the_api_key_comes_from_the_secret_entry_named():
    c = _container("--service-type", "NodePort", "--api-key-secret", "srv-key", "--api-key-secret-key", "token")
    assert c["env"] == [{"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "srv-key", "key": "token"}}}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # /health needs no key in vLLM
        assert c[probe]["httpGet"]["path"] == "/health"


def test_an_exposed_service_without_a_key_renders_only_when_the_flag_says_so():
    c = _container("--service-type", "LoadBalancer", "--allow-unauthenticated")
    assert c["env"] == []
    assert "--api-key" not in c["args"]


def test_a_key_on_the_servers_command_line_is_refused_for_any_service():
    for key_args in (["--api-key", "sk-123"], ["--api-key=sk-123"]):
        code, out, err = _run(
            "gke-serve", "--name", "s", "--tpu", "v6e:2x4", "--image", "i", "--model", "/m", "--", *key_args
        )
        assert code == 2 and out == "" and "sk-123" not in err
        assert len(err.strip().splitlines()) == 1 and "would stand in the manifest in plain text" in err, err

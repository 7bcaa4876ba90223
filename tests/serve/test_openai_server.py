"""Train, export, serve: a `torchtpu-train` run's Hugging Face export, served by vLLM's OpenAI
server started as every vLLM guide starts it (`vllm serve MODEL`, the console script) on the tpu
device.

The oracle is transformers on the CPU, reading the same folder with no other path given: its
greedy tokens and text are what the server must return. One server (a real process on
127.0.0.1) answers every test here: completions for a batch of prompts, a chat completion and a
streamed completion.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from ..processes import free_port
from ..train.debug_run import REPO, debug_argv

STEPS = 2
NEW = 16
PROMPTS = [
    "Once upon a time there was a",
    "Anna has a cat.",
    "Ben and his dog went to the park on Monday. They saw a duck, a cow and two cats. The duck said quack and",
    "1 + 2 =",
]
# A chat template of the test's own (the trained model is a base model and its export has none):
# BOS, then one line per message, then the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
START_TIMEOUT = 420  # seconds for the server to answer /health: imports, weights, compiling each step bucket
REQUEST_TIMEOUT = 120
API_KEY = "test-key-5f2c"  # the server's VLLM_API_KEY: requests to /v1 carry it as a bearer token
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny `torchtpu-train` run of the debug model cut to 2 blocks ([model] n_layers; STEPS steps of 8
    sequences of 32 tokens), its final weights exported with checkpoint.last_save_in_hf; the Hugging Face
    folder."""
    dump = tmp_path_factory.mktemp("train_to_serve")
    argv = debug_argv(
        dump,
        STEPS,
        "--validation.no-enable",
        "--checkpoint.enable",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
        "--model.n_layers",
        "2",  # the export, and so the served model, has 2 blocks
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["OMP_NUM_THREADS"] = "1"  # PyTorch's CPU work on one thread (XLA's devices have the cores)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "torchtpu.train", *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    print(f"torchtpu-train: {STEPS} steps and the export in {time.monotonic() - t0:.0f} s")
    folder = os.path.join(dump, "checkpoint", f"hf_step_{STEPS}")
    assert os.path.isfile(os.path.join(folder, "tokenizer.json")), os.listdir(folder)
    return folder


def _transformers_greedy(folder, ids_list, new=NEW, stop_at_eos=True, suppress=()):
    """transformers' greedy continuation (token ids) of each prompt, stopping at the export's EOS
    (its generation_config.json) unless told not to, never picking the ids in `suppress`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in ids_list:
            x = torch.tensor([ids])
            kw = {} if stop_at_eos else {"eos_token_id": None}
            if suppress:
                kw["suppress_tokens"] = list(suppress)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, **kw)
            out.append(y[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module")
def reference(export):
    """The prompts' token ids (the export's tokenizer, loaded by transformers with no other path),
    transformers' greedy continuations and their text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    tokens = _transformers_greedy(export, prompt_ids)
    return {
        "tokenizer": tok,
        "prompt_ids": prompt_ids,
        "tokens": tokens,
        "text": [tok.decode(t, skip_special_tokens=True) for t in tokens],
    }


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the API server and its engine process), SIGKILL
    what is left after 30 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine process, if it outlived the server
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):
    """vLLM's OpenAI server for the export on 127.0.0.1 with torchtpu's platform; its base URL and
    log file. Stopped (with its engine process) when the module's tests are done."""
    here = tmp_path_factory.mktemp("server")
    template = here / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    log_path = here / "server.log"
    port = free_port()
    # `vllm serve` as typed: the console script of this environment's vLLM (make install)
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "vllm"),
        "serve",
        export,
        "--served-model-name",
        "trained",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "64",
        "--chat-template",
        str(template),
    ]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("VLLM_TARGET_DEVICE", None)  # it would make vLLM skip platform plugins
    env["OMP_NUM_THREADS"] = "1"  # PyTorch's CPU work on one thread (XLA's devices have the cores)
    env["VLLM_API_KEY"] = API_KEY  # as `torchtpu-launch gke-serve --api-key-secret` gives it from a Secret
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"no /health after {START_TIMEOUT} s:\n{log_path.read_text()[-4000:]}"
            time.sleep(1)
        print(f"vLLM's OpenAI server answered /health after {START_TIMEOUT - (deadline - time.monotonic()):.0f} s")
        yield {"url": url, "log": log_path, "pid": proc.pid}
    finally:
        _stop(proc)


def _complete_characters(text: str) -> str:
    """`text` as vLLM returns it: its detokenizer holds back bytes that do not yet form a whole
    UTF-8 character (what decoding shows as U+FFFD at the end), and a byte-level model's last
    tokens can be such bytes."""
    return text.rstrip("\ufffd")


def _post(server, path, body, headers=HEADERS):
    req = urllib.request.Request(server["url"] + path, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        assert r.status == 200
        return json.loads(r.read())


@pytest.mark.xdist_group("vllm")
def test_completions_of_a_trained_export_are_transformers_greedy_tokens(server, reference):
    """One /v1/completions request with every prompt (batched by vLLM's scheduler): the prompt ids
    are the export tokenizer's (BOS first), the completions transformers' greedy tokens and text."""
    log = server["log"].read_text()
    assert "TPU KV cache size" in log  # the engine runs on torchtpu's platform (vLLM's CPU one says CPU)
    out = _post(
        server,
        "/v1/completions",
        {
            "model": "trained",
            "prompt": PROMPTS,
            "max_tokens": NEW,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == len(PROMPTS)
    for i, c in enumerate(choices):
        print(f"prompt {i} ({len(reference['prompt_ids'][i])} tokens): served {c['token_ids']}")
        print(f"{'':>{len(str(i)) + 7}}transformers {reference['tokens'][i]}")
        assert c["prompt_token_ids"] == reference["prompt_ids"][i]
        assert c["prompt_token_ids"][0] == reference["tokenizer"].bos_token_id
        assert c["token_ids"] == reference["tokens"][i]
        assert c["text"] == _complete_characters(reference["text"][i])


@pytest.mark.xdist_group("vllm")
def test_chat_completion_answers_with_the_templated_greedy_tokens(server, export, reference):
    """/v1/chat/completions renders the conversation with the chat template and answers with
    transformers' greedy continuation of that text. The answer is 8 tokens of the tokenizer's
    vocabulary (EOS ignored; the model's 48 ids past the tokenizer's 2,000 masked, as they decode
    to nothing), so it is text whatever the barely trained model prefers."""
    tok = reference["tokenizer"]
    body = {
        "model": "trained",
        "messages": [{"role": "user", "content": "What does the cat say?"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "allowed_token_ids": list(range(len(tok))),
        "return_token_ids": True,
    }
    out = _post(server, "/v1/chat/completions", body)
    (choice,) = out["choices"]
    # the same conversation through the same template, continued greedily by transformers
    ids = tok(f"{tok.bos_token}user: What does the cat say?\nassistant:", add_special_tokens=False)["input_ids"]
    vocab = json.load(open(os.path.join(export, "config.json")))["vocab_size"]
    (want,) = _transformers_greedy(export, [ids], new=8, stop_at_eos=False, suppress=range(len(tok), vocab))
    text = _complete_characters(tok.decode(want, skip_special_tokens=True))
    print(f"chat: served {choice['token_ids']} {choice['message']['content']!r}\n      transformers {want} {text!r}")
    assert choice["message"]["role"] == "assistant"
    assert out["prompt_token_ids"] == ids
    assert choice["token_ids"] == want
    assert choice["message"]["content"] == text != ""


@pytest.mark.xdist_group("vllm")
def test_streamed_completion_arrives_in_pieces_that_make_the_greedy_text(server, reference):
    body = {"model": "trained", "prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0, "stream": True}
    req = urllib.request.Request(server["url"] + "/v1/completions", data=json.dumps(body).encode(), headers=HEADERS)
    pieces, done = [], False
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        assert r.status == 200 and r.headers.get_content_type() == "text/event-stream"
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            pieces.append(json.loads(data)["choices"][0]["text"])
    print(f"{len(pieces)} streamed pieces: {pieces}")
    assert done
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == _complete_characters(reference["text"][0])


@pytest.mark.xdist_group("vllm")
def test_a_server_with_an_api_key_answers_401_without_it(server):
    """VLLM_API_KEY (what gke-serve's --api-key-secret sets from a Secret): /v1 answers 401 without
    the key or with another one, 200 with it; /health, which probes read, needs none."""
    body = {"model": "trained", "prompt": "1 + 2 =", "max_tokens": 2, "temperature": 0}
    for headers in ({"Content-Type": "application/json"}, dict(HEADERS, Authorization="Bearer wrong-key")):
        with pytest.raises(urllib.error.HTTPError) as info:
            _post(server, "/v1/completions", body, headers)
        assert info.value.code == 401
    assert len(_post(server, "/v1/completions", body)["choices"]) == 1
    with urllib.request.urlopen(server["url"] + "/health", timeout=REQUEST_TIMEOUT) as r:
        assert r.status == 200


@pytest.mark.xdist_group("vllm")
def test_the_servers_processes_stay_small_with_no_memory_options(server):
    """Started with no KV-cache size or memory share, the API server and its engine process on XLA's
    CPU devices hold a few GiB together, not a share of the host's memory."""
    import psutil

    root = psutil.Process(server["pid"])
    tree = [root, *root.children(recursive=True)]
    rss = sum(p.memory_info().rss for p in tree)
    print(f"the server's {len(tree)} processes: {rss / (1 << 30):.2f} GiB resident")
    assert len(tree) >= 2  # the API server and its engine process
    assert rss < 4 << 30

"""Draft-model speculative decoding on the tpu device (`speculative_config={"method": "draft_model",
"model": ..., "num_speculative_tokens": k}`).

vLLM's `DraftModelProposer` drafts k tokens a request with a smaller model of the target's
vocabulary. Each engine step it runs the draft model k times: once over the step's tokens (the
target's scheduled tokens and, after each request's, the token just sampled; the drafts the target
rejected stay in that batch as padding, with no cache write), then k - 1 times over one token a
request, each fed the previous draft. Its bookkeeping (input ids, positions, slot mappings, the
attention metadata, the choice of rows to sample) is vLLM's own and runs on the host with vLLM's
CPU kernels, as on vLLM's CPU backend; `TpuDraftModelProposer` is that proposer with the model
moved to tpu:

- the draft model is built, laid out over the mesh and loaded as the target is
  (`TpuModelRunner.load_tpu_model`); its attention layers are cache layers of the engine like the
  target's, so the runner allocates their caches beside the target's and one block table serves
  both;
- each draft forward is one compiled program per padding bucket (`DraftModelSteps`), the target's
  step with the draft model: from the packed token ids to the logits of the rows the proposer
  samples (one a request) and their argmax. Every bucket's program is compiled at warm-up.

vLLM's proposer reads the draft model's output as hidden states, indexes them with the rows it
samples and calls `compute_logits`. Those rows' logits already came out of the program, so the
proposer's rows are handed to the model before its first forward (`set_inputs_first_pass` returns
them; the later forwards sample every token), and the output (`DraftOutput`) stands for the rows'
hidden states: indexing it gives itself, `compute_logits` its logits on the host. Greedy drafts
(vLLM's default `draft_sample_method`) read only the argmax tokens; probabilistic drafts read the
logits. The proposer also copies each forward's hidden states into a buffer that only EAGLE's
inputs read (`hidden_states`); a draft model takes none, so that buffer is a sink here.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.spec_decode.draft_model import DraftModelProposer

import torchtpu

from . import steps
from .attention import host_metadata


class TpuDraftModelProposer(DraftModelProposer):
    def __init__(self, vllm_config, runner):
        super().__init__(vllm_config=vllm_config, device=torch.device("cpu"), runner=runner)
        self.tpu_runner = runner
        self.hidden_states = _HiddenStatesSink()

    def _get_model(self):
        config = self._create_draft_vllm_config()
        model = self.tpu_runner.load_tpu_model(config, config.model_config, prefix="draft_model")
        return DraftModelSteps(model, self.tpu_runner)

    def set_inputs_first_pass(self, *args, **kwargs):
        num_tokens, rows, metadata = super().set_inputs_first_pass(*args, **kwargs)
        self.model.sample_rows = rows
        return num_tokens, rows, metadata

    def _greedy_sample(self, hidden_states):
        if self.use_heterogeneous_vocab:  # drafts in the draft's vocabulary, mapped on the host
            return super()._greedy_sample(hidden_states)
        return self.model.greedy_tokens(hidden_states)


class DraftOutput:
    """A draft forward's output, standing for the hidden states of the rows the proposer samples:
    their logits and argmax tokens, on tpu until read."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, rows: int):
        self._logits = logits
        self._tokens = tokens
        self.rows = rows

    def __getitem__(self, index):
        return self

    def logits(self) -> torch.Tensor:
        return self._logits.cpu()[: self.rows]

    def tokens(self) -> torch.Tensor:
        return self._tokens.cpu()[: self.rows]


class DraftModelSteps:
    """The draft model as vLLM's proposer calls it: on host inputs, under the proposer's forward
    context (the tpu backend's host metadata of the draft's cache layers), it runs the compiled
    program of the batch's bucket on tpu."""

    def __init__(self, model: torch.nn.Module, runner):
        self.model = model
        self.runner = runner
        self.step = torchtpu.compile(self._step, warmup="abstract")
        self.compiled_buckets: set = set()
        self.sample_rows: torch.Tensor | None = None  # the next forward's rows to sample

    def __call__(self, input_ids=None, positions=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is not None or kwargs.get("hidden_states") is not None:
            raise NotImplementedError("torchtpu: a draft model's step takes token ids only")
        rows, self.sample_rows = self.sample_rows, None
        # the first forward samples the proposer's rows; the later ones, one token a request, all
        indices = np.arange(host_metadata().num_actual_tokens) if rows is None else rows.numpy()
        bucket, packed = self.runner.pack_step(input_ids, positions, indices, one_row_per_request=True)
        logits, tokens = self.run(bucket, packed)
        return DraftOutput(logits, tokens, len(indices))

    def run(self, bucket, packed: np.ndarray):
        with torch.inference_mode(False), torch.no_grad():
            out = self.step(torch.from_numpy(packed).to(self.runner.tpu_device), bucket)
        self.compiled_buckets.add(bucket)
        return out

    def _step(self, packed: torch.Tensor, bucket):
        logits = self.runner.step_logits(self.model, packed, bucket)
        return logits, logits.argmax(dim=-1)

    def compute_logits(self, hidden_states):
        return _output(hidden_states).logits()

    def greedy_tokens(self, hidden_states) -> torch.Tensor:
        return _output(hidden_states).tokens()

    def warm_up(self) -> int:
        """Compile the draft step of every padding bucket; returns how many."""
        for bucket in self.runner.buckets.all():
            one_row = bucket.one_row_per_request()
            self.run(one_row, steps.empty(one_row, self.runner.buckets.max_blocks_per_seq))
        return len(self.compiled_buckets)


def _output(hidden_states) -> DraftOutput:
    if not isinstance(hidden_states, DraftOutput):
        raise RuntimeError(
            f"torchtpu: the draft model's logits are computed in its compiled step; got {type(hidden_states).__name__}"
        )
    return hidden_states


class _HiddenStatesSink:
    """`SpecDecodeBaseProposer.hidden_states` for a draft model, which reads no hidden states: the
    proposer's writes into it (EAGLE's next inputs) are dropped."""

    def __setitem__(self, index, value) -> None:
        pass

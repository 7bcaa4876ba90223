"""Names vulture cannot see being used: PyTorch, JAX, torchelastic, tokenizers, argparse and pytest call or
read them by name. Read by vulture only (`make lint`); never imported. Each entry says who uses it.

Anything else vulture reports is dead code: delete it rather than list it here.
"""
# ruff: noqa: B018, F821

# PyTorch's PrivateUse1 backend (torchtpu.backend.device): torch.tpu.* mirrors torch.cuda.* and torch
# calls these hooks, device-guard methods and module functions by name.
_.type_
_.has_primary_context
_.dev_id
_.is_built
_.is_initialized
_.seed_all
_.get_rng_state_all
_.set_rng_state_all
_.max_memory_allocated
_.mem_get_info
_.get_device_name
_._is_in_bad_fork
_.memory_reserved
_.max_memory_reserved
_.including_emulation
_.empty_cache
_.reset_peak_memory_stats
# nn.Parameter subclasses on tpu (torchtpu.backend.module_moves): PyTorch reads a custom tensor's _is_param flag
_._is_param

# ATen schema arguments: the dispatcher binds a lowering's arguments by their schema names, so a
# lowering declares the ones it has no use for (a tpu tensor has no pinned memory or memory format).
_.pin_memory
_.memory_format
_.non_blocking
_.unsafe
_.unroll_dim
_.sparse_grad
_.sparse
_.sorted_
_.assume_unique
_.check_errors
_.implicit
_.self_is_result
_.half_to_float
_.input_dtype
_.buffer
_.reserve
_.neg_log_likelihood
_.allow_tf32
_.benchmark
_.cudnn_enabled
_.bias_sizes
_.return_debug_mask
_.grad_input_mask
_.cum_seq_q
_.cum_seq_k
_.max_q
_.max_k
_.philox_seed
_.philox_offset

# Signatures PyTorch and JAX call with fixed arguments: nn.Module state-dict hooks, Tensor.__repr__ and
# __reduce_ex__, jax.monitoring duration listeners.
_.local_metadata
_.strict
_.missing_keys
_.unexpected_keys
_.error_msgs
_.tensor_contents
_.proto
_.duration

# Attributes PyTorch reads: AOTAutograd's tangent coercion and boxed calling convention, FakeTensorMode's
# device-init switch; a module's class swapped in place (layer scan, real RoPE).
_.__coerce_same_metadata_as_tangent__
_._boxed_call
_.avoid_device_init
_.__class__

# torchelastic's agent reads these on the subclass torchtpu.launch.agent builds.
_.root_log_dir
_.reify
_._remaining_restarts

# argparse, tokenizers and transformers read these attributes.
_.required
_.pre_tokenizer
_.decoder
_.eos_token_id

# Entry points: console script (pyproject [project.scripts]) and the public torchtpu.persistent_cache_stats.
_.launch_main
_.persistent_cache_stats

# pytest reads module-level marks.
_.pytestmark
# pytest calls conftest hooks by name (tests/conftest.py), and a registered plugin's hooks
# (tests/opinfo/pass_rate.py); its exit status counts session.testsfailed.
_.pytest_collection_finish
_.pytest_collection_modifyitems
_.pytest_configure
_.pytest_sessionstart
_.pytest_runtest_logreport
_.pytest_runtestloop
_.pytest_terminal_summary
_.testsfailed

# Installed on TpuTensor by backend.handlers (PyTorch calls them).
_.__torch_dispatch__
_.__repr__

# PyTorch API parameters torchtpu accepts and does not need: with one controller every process holds the
# global value (src_data_rank), collectives are XLA's and synchronous (async_op), local_map's inputs are
# always redistributed to its placements and its gradients' layout is left to XLA (redistribute_inputs,
# in_grad_placements), a gradient keeps its tensor's dtype (backward_dtype). None of them changes a value.
_.src_data_rank
_.async_op
_.backward_dtype
_.in_grad_placements
_.redistribute_inputs
# torch DeviceMesh methods kept for code written against PyTorch's DeviceMesh.
_.get_group
_.get_local_rank

# Read by name: ChipSpec fields (hardware.chip_spec returns them as a dict), a config key refused when
# changed (profiler_warmup, expert_tensor_parallel_degree), attributes the config-honesty test reads
# through strings.
_.expert_tensor_parallel_degree
_.hbm_bytes
_.hbm_bandwidth
_.profiler_warmup
_.wandb_mode
_.host_batch

# vLLM (torchtpu.serve): vLLM finds the platform through the entry point and calls the Platform's,
# Worker's, ModelRunner's and attention backend's methods by name, and workers' methods through
# collective_rpc.
_.TpuWorker
_.init_device
_._maybe_get_memory_pool_context
_.determine_available_memory
_.compile_or_warm_up_model
_.wake_up
_.torchtpu_cache_stats
_._model_forward
_.block_ids
_.level
_._zero_block_ids
_.async_scheduling
_.cache_dtype_str
_.check_and_update_config
_.common_prefix_len
_.cudagraph_capture_sizes
_.cudagraph_mode
_.device_control_env_var
_.device_name
_.dispatch_key
_.fast_build
_.forward_includes_kv_cache_update
_.get_attn_backend_cls
_.get_builder_cls
_.get_current_memory_usage
_.get_device_communicator_cls
_.get_device_total_memory
_.get_impl_cls
_.get_kv_cache_shape
_.get_name
_.get_supported_kernel_block_sizes
_.get_preferred_block_size
_.default_block_size
_.initialize_kv_cache_tensors
_.is_pin_memory_available
_.kernel_block_sizes
_.kv_cache_allocation_context
_.load_model
_.opaque_attention_op
_.is_monolithic  # vLLM's FusedMoE asks its method (torchtpu.serve.moe)
_.apply_monolithic
_.get_min_capability  # vLLM's linear-kernel selection asks the w8a16 kernel (torchtpu.serve.quant)
_.can_implement
_.apply_weights
_.platform_plugin
_.general_plugin
# vLLM's draft-model speculation (torchtpu.serve.draft, runner, platform): its proposer builds the draft
# model through _get_model, its runner copies the drafts through _copy_draft_token_ids_to_cpu and reads
# what it sets; the platform checks the runner's caches and its triton overrides read the expand kernel
# by name, which vLLM calls with the keyword MAX_NUM_TOKENS
_._get_model
_._copy_draft_token_ids_to_cpu
_._draft_token_req_ids
_.prev_num_spec_tokens
_.check_runner_kv_caches_multi_layer
_._expand_kernel_impl
MAX_NUM_TOKENS
_.simple_compile_backend
_.supported_dtypes
_.validate_request
_.processed_inputs
_.supported_kv_cache_dtypes
_.supports_attn_type
_.supports_sliding_window
_.supports_structured_output
_.verify_quantization

# torch.distributed calls these of a process group (torchtpu.distributed.process_group) and its Work
_.is_completed
_.get_future
_.getBackendName
_.allreduce_coalesced
_.all_gather_single_coalesced
_.reduce_scatter_single_coalesced

# ModelFamily.hf_adapter: torchtitan's Hugging Face state-dict adapter of a family (weights in and out)
_.hf_adapter
# torchtitan's MoE load-balancing optimizer hook asks its ParallelDims for this (tests/train/reference.py)
_.get_optional_mesh

# PyTorch's dispatcher calls the tpu device's own kernels (torchtpu_autoload.KERNELS names them), its
# dynamo backend registry the `torch_dynamo_backends` entry point, torch.cuda's readers these
_._empty_memory_format
_._copy_from
_._pin_memory_cpu
_._is_pinned_cpu
_.compile_backend
_.reset_max_memory_allocated
# FlexAttention (torchtpu.backend.flex_attention, its tests): PyTorch calls a score_mod as (score, b, h, q_idx,
# kv_idx) and a mask_mod as (b, h, q_idx, kv_idx), and the backward operator's kernel with its joint graph, by position
_.q_idx
_.joint_graph

# tests/train/user_code/my_norm.py: the model family it registers names its preparer as a
# "module:attribute" string, which torchtpu.models.registry resolves by name.
use_my_norm

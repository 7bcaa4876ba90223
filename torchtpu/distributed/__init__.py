"""The sharding layer: PyTorch's DeviceMesh / DTensor placements / FSDP2 / tensor-parallel
plans, mapped onto one global JAX mesh and `NamedSharding`s, so that XLA emits the
collectives (single-program SPMD).

    from torchtpu.distributed import init_device_mesh, fully_shard, parallelize_module
    mesh = init_device_mesh("tpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))

See mesh.py (meshes), placements.py (placements <-> PartitionSpec), dtensor.py
(distribute_tensor and the DTensor methods of tpu tensors), parallel.py (tensor parallelism),
fsdp.py (fully_shard), batch.py (the batch over the data-parallel axes), params.py (parameter
layouts, materialize), collectives.py (functional collectives, local_map, loss_parallel).
"""

from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: F401
from torch.distributed.tensor.parallel import (  # noqa: F401
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from . import process_group  # noqa: F401  (registers the "tpu" backend of torch.distributed)
from .batch import batch_placements, place_batch  # noqa: F401
from .collectives import local_map, loss_parallel, vocab_parallel_cross_entropy  # noqa: F401
from .dtensor import distribute_tensor, local_shards, shard_as  # noqa: F401
from .fsdp import FSDPState, MixedPrecisionPolicy, fully_shard  # noqa: F401
from .mesh import DeviceMesh, current_mesh, init_device_mesh, initialize, set_mesh  # noqa: F401
from .parallel import parallelize_module  # noqa: F401
from .params import empty, local_bytes, materialize  # noqa: F401

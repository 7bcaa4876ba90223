"""The data position in a checkpoint: every row stream of the global batch by row number, whichever
process reads it (data.GlobalBatchLoader), so a checkpoint resumes on another host count or mesh
with the same micro-batch."""

from __future__ import annotations

from .config.job_config import ConfigError

__all__ = ["loader_states", "load_loader_state"]

_LOADER_INTS = ("seed", "epoch", "file", "doc", "global_doc", "offset", "batches", "bad_records")


def loader_states(loader) -> dict:
    """The data position for a checkpoint: every row stream's, by global row (a list indexed by row),
    whichever process reads it, so the checkpoint resumes on any host count. Process 0 writes the
    checkpoint's non-array data, so with several processes the rows' positions are gathered to all."""
    import jax

    mine = loader.state_dict()
    streams = mine["streams"]
    first = next(iter(streams.values()))
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        table = np.full((loader.global_rows, 1 + len(_LOADER_INTS)), -1, dtype=np.int64)
        for r, st in streams.items():
            table[r] = [1, *(st[k] for k in _LOADER_INTS)]
        gathered = multihost_utils.process_allgather(table)  # (processes, rows, 1 + ints)
        streams = {}
        for r in range(loader.global_rows):
            held = [row for row in gathered[:, r] if row[0] == 1]
            if not held:
                raise RuntimeError(f"no process holds row {r} of the global batch")  # a layout bug, not user input
            streams[r] = dict(first, dp_rank=r, **{k: int(v) for k, v in zip(_LOADER_INTS, held[0][1:])})
    return {"global_rows": loader.global_rows, "streams": [streams[r] for r in range(loader.global_rows)]}


def load_loader_state(loader, saved: dict, dims) -> None:
    """Restore this process's rows from a checkpoint's data position (see loader_states)."""
    if "streams" not in saved:
        raise ConfigError(
            "the checkpoint's data position was written by an older torchtpu (one position per host, not per "
            "batch row); add --checkpoint.exclude_from_loading dataloader to restart the data stream"
        )
    rows = int(saved["global_rows"])
    if rows != loader.global_rows:
        fix = (
            f"resume with --training.local_batch_size {rows // dims.dp} to keep the same batches"
            if rows % dims.dp == 0
            else f"resume with a data-parallel degree that divides {rows}"
        )
        raise ConfigError(
            f"the checkpoint's data position is for micro-batches of {rows} sequences; this job's are "
            f"{loader.global_rows} (training.local_batch_size {dims.local_batch_size} x {dims.dp} data-parallel "
            f"ranks): {fix}, or add --checkpoint.exclude_from_loading dataloader to restart the data stream"
        )
    try:
        loader.load_state_dict(saved)
    except ValueError as e:
        raise ConfigError(f"cannot continue the checkpoint's data stream: {e}") from None

"""The loops over scanned blocks (scan.py): `lax.scan` with one block per iteration, unrolled into
straight-line code where XLA:CPU needs it (`loop_unrolled`) and for the dry run's costing copies
(`straight_line_loops`), whose cost XLA counts in full where it counts a loop body once.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def loop_unrolled() -> bool:
    """Whether the blocks' loops are unrolled here: only on CPU devices of several processes, for
    an XLA:CPU defect (elsewhere they are `lax.scan` loops).

    XLA:CPU orders a program's collectives by *scheduling* edges: a collective may start once the
    one before it has started. A plain collective runs to its end before the next starts, but a
    while loop is asynchronous, so a collective after the loop that does not read its results
    (the final norm's and the output projection's FSDP all-gathers in the evaluation step) runs
    while the loop's own all-gathers do. Within one process each collective meets its peers by
    its op id, so that is harmless; across processes XLA:CPU runs them on gloo with one tag for
    all, the two streams of messages interleave differently on each host, and gloo aborts
    ("Received data size doesn't match expected size"). Unrolled, the blocks are straight-line
    code with no loop, the same arithmetic (tests/launch/test_launch.py checks the losses against
    the unscanned job), a compile time that grows with depth again, and the same stacked
    storage and checkpoints."""
    return jax.process_count() > 1 and jax.devices()[0].platform == "cpu"


_STRAIGHT_LINE = [False]


@contextlib.contextmanager
def straight_line_loops(unroll: bool | int = True):
    """Within this block, programs traced run the blocks' loops fully unrolled (`lax.scan`'s
    unroll=True): the scanned program's own structure (stacked weights, the forward's kept
    outputs, the backward's recomputation) as straight-line code, whose cost XLA counts in full
    where it counts a loop body once (the step estimate's costing copies). `unroll=k` instead
    keeps the loops with k blocks per iteration, each block reading its own row of the stacked
    inputs and writing its own row of the stacked outputs as a one-block iteration does
    (`blocks_loop`), so XLA's cost of a k-block body less a 1-block one is k - 1 blocks as the
    loop runs them (`bench.step_estimate --loop`)."""
    prev = _STRAIGHT_LINE[0]
    _STRAIGHT_LINE[0] = unroll
    try:
        yield
    finally:
        _STRAIGHT_LINE[0] = prev


def straight_line() -> bool:
    """Whether the blocks' loops are unrolled into straight-line code here (`blocks_loop`)."""
    return loop_unrolled() or _STRAIGHT_LINE[0] is True


def blocks_loop(body, init, xs, n: int, reverse: bool = False):
    """`lax.scan(body, init, xs, reverse=reverse)` over the n blocks: a loop of one block per
    iteration, unrolled into straight-line code where `loop_unrolled` or `straight_line_loops()`
    says so, and with k blocks per iteration under `straight_line_loops(k)`.

    The k-block loop is not `lax.scan`'s `unroll=k`, which reshapes every stacked input and output
    to (n / k, k, ...) and slices and writes a group of k rows per iteration: XLA adds copies for
    those groups (a toy FSDP stack of matmul blocks on v5p: 8% more per block than one block per
    iteration). Here each block of an iteration slices row i of the stacked inputs and writes row
    i of the stacked outputs, the ops a one-block iteration runs."""
    k = _STRAIGHT_LINE[0]
    if straight_line():
        return jax.lax.scan(body, init, xs, reverse=reverse, unroll=True)
    if not k or k == 1:
        return jax.lax.scan(body, init, xs, reverse=reverse)
    if n % k:
        raise ValueError(f"straight_line_loops({k}): {n} blocks do not split into iterations of {k}")

    def row(i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs)

    _, out_row = jax.eval_shape(body, init, row(0))
    outs = jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), out_row)

    def iteration(state, t):
        carry, outs = state
        for j in range(k):
            i = t * k + (k - 1 - j if reverse else j)
            carry, y = body(carry, row(i))
            outs = jax.tree.map(lambda o, v, i=i: jax.lax.dynamic_update_index_in_dim(o, v, i, 0), outs, y)
        return (carry, outs), None

    (carry, outs), _ = jax.lax.scan(iteration, (init, outs), jnp.arange(n // k, dtype=jnp.int32), reverse=reverse)
    return carry, outs

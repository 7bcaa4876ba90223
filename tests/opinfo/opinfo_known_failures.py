"""OpInfos known to fail the harness (tests/opinfo/opinfo_harness.py), with the reason.

tests/opinfo/test_opinfo.py marks these xfail(strict=True): an entry whose OpInfo starts passing
fails the suite until it is removed here, so these lists only ever shrink. The summary
tests count the results the OpInfo tests had and hold them to the bar: at least 99% of the
float32 OpInfos pass forward, at least 98% of the autograd OpInfos backward.

Keys are `opinfo_id`s ("name" or "name.variant_test_name"), values the reason.
"""

SPARSE = "sparse layouts cannot move to tpu (dense tensors only)"

# Failing in both directions: the forward itself is missing or wrong.
_BOTH: dict[str, str] = {
    "sparse.sampled_addmm": SPARSE,
    "sparse.mm.reduce": SPARSE,
    "to_sparse": SPARSE,
    "chalf": "complex32 has no JAX/XLA dtype",
    "grid_sampler_3d": "aten.grid_sampler_3d has no lowering (2-D is lowered)",
}

FORWARD: dict[str, str] = {
    **_BOTH,
    "matrix_exp": "differs from CPU beyond 1e-4 on an ill-conditioned sample (JAX's Pade/scaling-squaring)",
}

BACKWARD: dict[str, str] = {
    **_BOTH,
    "to": "a cross-device sample trips the autograd engine's stream assert (the tpu device has no streams)",
}

# OpInfos whose failure takes the whole test process down: run in a subprocess, as strict
# expected failures ("direction:opinfo_id").
CRASHES: dict[str, str] = {
    "backward:linalg.eig": "autograd's engine returns NULL without an exception on the 0x0 sample, then "
    "aborts the process",
    "backward:linalg.eigvals": "the 0x0 sample aborts the process inside autograd's engine",
}

"""OpInfos known to fail the harness (tests/opinfo_harness.py), with the reason.

tests/test_opinfo.py marks these xfail(strict=True): an entry whose OpInfo starts passing
fails the suite until it is removed here, so these lists only ever shrink. The summary
tests hold them to the bar: at most 5% of the float32 OpInfos may fail forward, at most 10%
of the autograd OpInfos backward.

Keys are `opinfo_id`s ("name" or "name.variant_test_name"), values the reason.
"""

FORWARD: dict[str, str] = {
    "sparse.sampled_addmm": "sparse CSR tensors cannot move to tpu (dense layouts only)",
}

BACKWARD: dict[str, str] = {
}

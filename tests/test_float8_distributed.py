"""FP8 training under DistributedDataParallel, two real processes (gloo on CPU): the
delayed-scaling amaxes are all-reduced with MAX, so both ranks hold the same scales and
histories, those of one process training on the concatenated batch, and the DDP run follows that
process step for step.

The ranks run in tests/_dist_worker.py (``torch.multiprocessing.spawn``); each writes what it
ended with to a file that the tests here read. The two ranks' inputs differ 8x in magnitude, so
every check below fails if the amaxes are not reduced (checked by hand with the all-reduce in
``update_states`` removed: the state, the reductions and the loss checks fail).
"""

from __future__ import annotations

import _dist_worker as w
import pytest
import torch

LAYERS = ("fc1", "fc2", "fc3")
ROLES = ("input", "weight", "output", "grad_output", "grad_input")
# The DDP run and the single process differ only in fp32 summation order: the reference's wgrad
# GEMM sums 2B rows at once, DDP sums B rows per rank and then all-reduces, and the FP8 casts see
# the same values (see _dist_worker.single_process). Measured here over the 4 steps: losses agree
# within 1e-7 relative, parameters within 2e-8 absolute, fp8 states exactly. 1e-5 leaves 100x
# headroom for another CPU's kernels; without the all-reduce the losses move by 1.4e-3, with SUM
# in place of MAX by 4e-3.
RTOL = 1e-5

# ~35 s with a warm Inductor cache, ~55 s cold on 2 cores (five FP8 graphs compiled, two ranks at
# once, then the single process)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(rank 0's results, rank 1's, the single process's): see _dist_worker._finish."""
    ranks = w.spawn_ranks(w.rank_main, tmp_path_factory.mktemp("ddp"))
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks ran
    try:
        single = w.single_process()
    finally:
        torch.set_num_threads(threads)
    return *ranks, single


def test_every_layer_trained_in_fp8(runs):
    # guards the checks below against a run that silently fell back to fp32 (nothing compiled,
    # no state) or was compiled otherwise than this test expects
    r0, r1, single = runs
    assert r0["graphs"] == r1["graphs"] == [["fc1"], ["fc2", "fc3"]]  # split at DDP's buckets
    assert single["graphs"] == [["fc1", "fc2", "fc3"]]
    for run in runs:
        assert set(run["fp8"]) == {
            f"{layer}.{key}"
            for layer in LAYERS
            for key in ("pending", *(f"{r}.{f}" for r in ROLES for f in ("amax_history", "scale")))
        }
        assert all(run["fp8"][f"{layer}.input.scale"] != 1 for layer in LAYERS)


def test_ranks_hold_the_same_scales_and_histories(runs):
    r0, r1, _ = runs
    # After the last step, before its update: the scales and the reduced rows agree; row 0 holds
    # each rank's own amaxes of the last step, not reduced yet.
    p0, p1 = r0["pending"], r1["pending"]
    for k in p0:
        if k.endswith(".scale"):
            assert torch.equal(p0[k], p1[k]), k
        elif k.endswith(".amax_history"):
            assert torch.equal(p0[k][1:], p1[k][1:]), k
    assert p0["fc1.pending"] and p1["fc1.pending"]
    x, _ = w.batches()[-1]
    local = [x[r * w.B : (r + 1) * w.B].abs().max() for r in range(w.WORLD)]
    assert p0["fc1.input.amax_history"][0] == local[0]
    assert p1["fc1.input.amax_history"][0] == local[1] > 4 * local[0]
    # after that update (all-reduce, then roll): every tensor identical
    differ = [k for k in r0["fp8"] if not torch.equal(r0["fp8"][k], r1["fp8"][k])]
    assert not differ, differ


def test_a_state_saved_with_all_reduce_is_every_ranks(runs):
    # fp8_state_dict(all_reduce=True) before that update: row 0 already the MAX over ranks, so
    # the state either rank saves is the same, and resuming from it on any rank makes the update
    # the next step would have made
    r0, r1, single = runs
    s0, s1, p0, p1 = r0["synced"], r1["synced"], r0["pending"], r1["pending"]
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k
        if k.endswith(".amax_history"):
            assert torch.equal(s0[k][0], torch.maximum(p0[k][0], p1[k][0])), k
            assert torch.equal(s0[k][1:], p0[k][1:]), k
        else:
            assert torch.equal(s0[k], p0[k]), k
    assert s0["fc1.input.amax_history"][0] > p0["fc1.input.amax_history"][0]
    for k, v in single["synced"].items():  # one process: nothing to reduce
        assert torch.equal(v, single["pending"][k]), k


def test_amaxes_are_the_elementwise_max_over_ranks(runs):
    r0, r1, _ = runs
    # each step after the first, one MAX all-reduce per graph (its own layers' amaxes); then one
    # for the state saved with all_reduce=True (all layers), and one for the final update, which
    # finds the rows already reduced and changes nothing
    assert [len(b) for b, _ in r0["reductions"]] == [5, 10] * (w.STEPS - 1) + [15, 15]
    assert len(r1["reductions"]) == len(r0["reductions"])
    (last0, again0), (last1, again1) = r0["reductions"][-1], r1["reductions"][-1]
    assert torch.equal(last0, last1) and torch.equal(again0, last0) and torch.equal(again1, last0)
    for (before0, after0), (before1, after1) in zip(
        r0["reductions"][:-1], r1["reductions"][:-1], strict=True
    ):
        assert not torch.equal(before0, before1)  # the ranks saw different amaxes
        assert torch.equal(after0, torch.maximum(before0, before1))
        assert torch.equal(after1, after0)
        assert (after0 > before0).any()  # rank 0 took rank 1's larger amaxes
    # fc1's input is the data itself: its amax is the max over both ranks' rows of each step. The
    # final update took the scale from the 4 steps' amaxes, then rolled the history (length 4)
    # past step 0's and zeroed row 0.
    amax = [x.abs().max().item() for x, _ in w.batches()]
    for run in (r0, r1):
        assert run["fp8"]["fc1.input.amax_history"].tolist() == [0.0, *amax[1:]]
        assert run["fp8"]["fc1.input.scale"].item() == pytest.approx(448.0 / max(amax), rel=1e-6)


def test_ddp_follows_the_single_process_on_the_whole_batch(runs):
    r0, r1, single = runs
    ddp = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"], strict=True)]
    assert ddp == pytest.approx(single["losses"], rel=RTOL)
    assert r0["losses"] != r1["losses"]  # the ranks trained on different rows
    for k, v in single["fp8"].items():
        torch.testing.assert_close(r0["fp8"][k], v, rtol=RTOL, atol=0, msg=k)
    for n, p in single["params"].items():
        torch.testing.assert_close(r0["params"][n], p, rtol=RTOL, atol=1e-7, msg=n)


def test_parameters_stay_identical_across_ranks(runs):
    r0, r1, _ = runs
    for n, p in r0["params"].items():
        assert torch.equal(p, r1["params"][n]), n
        assert not torch.equal(p, dict(w.make_model().named_parameters())[n])  # they trained

"""The backend's attention pass (passes/cpu/attention.py): sdpa over transformers' repeated KV
cache (fp32, bf16 or fp16) becomes the packed native attention, the same numbers; what it must
not take stays sdpa."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxquant.kernels.cpu as native
from fxquant.passes.rewrite import counters

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.unavailable_reason()}"
)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv (integrations/sdpa_attention.py), as its sdpa attention calls it."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class Attention(torch.nn.Module):
    """A decode step's attention over a static cache: the query heads, the cache, its mask."""

    def __init__(self, groups: int = 3, **sdpa) -> None:
        super().__init__()
        self.groups, self.sdpa = groups, sdpa

    def forward(self, q, k, v, mask):
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        return F.scaled_dot_product_attention(q, k, v, **({"attn_mask": mask} | self.sdpa))


def _inputs(b=1, hk=2, groups=3, t=1, length=40, d=16, visible=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hk * groups, t, d, generator=g)
    k, v = (torch.randn(b, hk, length, d, generator=g) for _ in range(2))
    mask = torch.zeros(b, 1, t, length, dtype=torch.bool)
    for row in range(t):
        mask[:, 0, row, : visible - t + 1 + row] = True  # causal, then the cache's unused tail
    return q, k, v, mask


def _compiled(module):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(module, backend="fxquant", options={"config": "int8wo"})


def _kernel_calls(fn, *args):
    """fn(*args), and how many times its second call ran the native attention op (the first
    compiles)."""
    fn(*args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, sum(e.name == "fxquant::native_gqa_attention" for e in prof.events())


@pytest.mark.parametrize(
    ("b", "groups", "t", "scale"), [(1, 3, 1, None), (2, 2, 1, 0.3), (1, 4, 5, None)]
)
def test_sdpa_over_a_repeated_cache_runs_the_packed_kernel(b, groups, t, scale):
    module = Attention(groups, **({} if scale is None else {"scale": scale}))
    args = _inputs(b=b, groups=groups, t=t)
    want = module(*args)
    got, calls = _kernel_calls(_compiled(module), *args)
    assert counters["attention.packed"] == 1 and calls == 1
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_cache_runs_the_kernel_in_fp32(dtype):
    """bf16 / fp16 (a model in its checkpoint's dtype): the same kernel, the cache widened to
    fp32 as it is read; the result is the attention of the same values, rounded once to the
    dtype (transformers' eager attention rounds its probabilities too: further off)."""
    module = Attention()
    args = [a.to(dtype) if a.is_floating_point() else a for a in _inputs(t=2)]
    got, calls = _kernel_calls(_compiled(module), *args)
    assert counters["attention.packed"] == 1 and calls == 1
    assert got.dtype == dtype
    q, k, v, mask = (a.double() if a.is_floating_point() else a for a in args)
    want = F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask)
    ulp = torch.finfo(dtype).eps  # one rounding to the dtype: half an ulp, relative
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=ulp)
    torch.testing.assert_close(got, module(*args), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["causal", "additive mask", "dropout", "no mask", "one group"])
def test_what_the_kernel_cannot_take_stays_sdpa(case):
    args = list(_inputs())
    module = Attention()
    if case == "causal":
        module, args[3] = Attention(is_causal=True), None
    elif case == "additive mask":
        args[3] = torch.zeros(args[3].shape).masked_fill(~args[3], float("-inf"))
    elif case == "dropout":
        module = Attention(dropout_p=0.5)
        torch.manual_seed(0)
    elif case == "no mask":
        args[3] = None
    elif case == "one group":
        module = Attention(groups=1)
        args = list(_inputs(groups=1))
    compiled = _compiled(module)
    if case == "dropout":
        compiled(*args)  # random: only the rewrite is checked
    else:
        torch.testing.assert_close(compiled(*args), module(*args), atol=2e-6, rtol=1e-5)
    assert counters["attention.packed"] == 0

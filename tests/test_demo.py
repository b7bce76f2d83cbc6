"""fxquant.demo's side-by-side timing (``_speeds``) on stand-in packages: no model, no build.

The demo itself (SmolLM2, three AOTInductor builds) is the README's first command, run from a
clean clone before each submission; these check the bookkeeping it relies on.
"""

from __future__ import annotations

import torch

from fxquant.demo import _speeds

VOCAB = 11


class Next:
    """A package whose greedy next token is ``(last input token + step) % VOCAB``; it records
    the order of calls across packages, and can fail at a given call."""

    def __init__(self, name: str, calls: list[str], *, step: int = 1, fail_at: int | None = None):
        self.name, self.calls, self.step, self.fail_at = name, calls, step, fail_at

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.calls.append(self.name)
        if self.fail_at is not None and sum(c == self.name for c in self.calls) > self.fail_at:
            raise RuntimeError("boom\nsecond line")
        logits = torch.zeros(1, ids.shape[1], VOCAB)
        logits[0, -1, (int(ids[0, -1]) + self.step) % VOCAB] = 1.0
        return logits


def test_packages_run_in_turn_and_follow_fp32s_tokens():
    calls: list[str] = []
    pkgs = {"fp32": Next("fp32", calls), "q": Next("q", calls, step=2)}
    prompt = torch.tensor([[3, 4]])
    speeds, errors = _speeds(pkgs, prompt, new_tokens=5, rounds=3)
    assert errors == {}
    # prefills alternate, then every decode step alternates
    assert calls == ["fp32", "q"] * (3 + 4)
    fp32_ids, q_ids = speeds["fp32"][2], speeds["q"][2]
    assert fp32_ids == [5, 6, 7, 8, 9]  # its own greedy chain
    # q is fed fp32's token at each step: its id is fp32's token + 2, not its own chain
    assert q_ids == [6, 7, 8, 9, 10]
    for pre, dec, _ in speeds.values():
        assert pre > 0 and dec > 0


def test_a_failing_package_is_reported_and_the_others_finish():
    calls: list[str] = []
    pkgs = {"fp32": Next("fp32", calls), "bad": Next("bad", calls, fail_at=4)}
    speeds, errors = _speeds(pkgs, torch.tensor([[1]]), new_tokens=6, rounds=3)
    assert errors == {"bad": "RuntimeError: boom"}
    assert list(speeds) == ["fp32"] and len(speeds["fp32"][2]) == 6
    assert calls.count("bad") == 5  # 3 prefills, 1 step, then the failing call


def test_without_fp32_each_package_follows_itself():
    pkgs = {"q": Next("q", [], step=3)}
    speeds, _ = _speeds(pkgs, torch.tensor([[0]]), new_tokens=4, rounds=1)
    assert speeds["q"][2] == [3, 6, 9, 1]

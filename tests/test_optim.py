"""The optimizer recipe (``rlhf_switch.engines.optim``): ``LocalShardAdamW`` is torch's AdamW
bit for bit — decoupled weight decay included — and the warmup schedule is the stated one.
Pure, in-process, on plain tensors (a DTensor's step is its local tensors' step: the same
``adam`` call on the same numbers; the engines' tests compare whole layouts across processes)."""
from __future__ import annotations

import math

import pytest
import torch

from rlhf_switch.engines.optim import AdamWConfig, LinearWarmup, LocalShardAdamW


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((5, 3), (7,), (2, 2, 2))]


def _steps(opt: torch.optim.Optimizer, params, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_local_shard_adamw_is_torch_adamw_bit_for_bit(weight_decay):
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    a, b = _params(), _params()
    opt_a, opt_b = cfg.make(a, on_local_shards=True), cfg.make(b)
    assert type(opt_a) is LocalShardAdamW and type(opt_b) is torch.optim.AdamW
    _steps(opt_a, a, 4)
    _steps(opt_b, b, 4)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a.state[pa][key], opt_b.state[pb][key]), key
    assert opt_a.state_dict()["param_groups"] == opt_b.state_dict()["param_groups"]


def test_local_shard_adamw_decays_weights_decoupled_not_as_l2():
    """AdamW's decay shrinks the weight by ``lr * wd`` outside the Adam ratio; L2 adds ``wd * p``
    to the gradient, which Adam then normalises away. With a gradient of 0 and a weight of 2, one
    step of decoupled decay gives exactly ``2 * (1 - lr * wd)`` (1.98); L2 would move it by a whole
    ``lr`` (1.9: the ratio of a lone gradient to its own root mean square is 1)."""
    lr, wd = 0.1, 0.1
    p = torch.nn.Parameter(torch.full((4,), 2.0))
    opt = AdamWConfig(lr=lr, weight_decay=wd).make([p], on_local_shards=True)
    p.grad = torch.zeros(4)
    opt.step()
    assert torch.equal(p.detach(), torch.full((4,), 2.0) * (1 - lr * wd))
    # a gradient as well: decay first, then the Adam step (bias-corrected first step: lr * sign)
    q = torch.nn.Parameter(torch.full((3,), 2.0))
    opt = AdamWConfig(lr=lr, betas=(0.9, 0.999), eps=0.0, weight_decay=wd).make([q], on_local_shards=True)
    q.grad = torch.full((3,), 1e-3)
    opt.step()
    assert q.detach().tolist() == pytest.approx([2.0 * (1 - lr * wd) - lr] * 3, rel=1e-6)


def test_local_shard_adamw_refuses_a_closure():
    p = _params()
    with pytest.raises(ValueError, match="no closure"):
        AdamWConfig().make(p, on_local_shards=True).step(lambda: 0.0)


def test_linear_warmup_reaches_lr_at_warmup_steps():
    assert [LinearWarmup(4)(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert LinearWarmup(0)(0) == 1.0
    p = _params()
    cfg = AdamWConfig(lr=0.2, warmup_steps=2)
    opt = cfg.make(p, on_local_shards=True)
    sched = cfg.scheduler(opt)
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        _steps(opt, p, 1)
        sched.step()
    assert lrs == [0.1, 0.2, 0.2] and math.isclose(sched.get_last_lr()[0], 0.2)

"""`rl_learner.ema`: the EMA formula, and `WeightEMA` over a model's trainable parameters (one
process, no process group: rank 0). Its place in checkpoints and exports: test_checkpoint.py."""

from __future__ import annotations

import pytest
import torch

from rl_learner import WeightEMA, ema_update


def test_ema_update_is_beta_average_plus_one_minus_beta_value_in_place():
    average = torch.tensor([1.0, 2.0, -4.0])
    returned = ema_update(average, torch.tensor([3.0, 2.0, 0.0]), 0.75)
    assert returned is average
    assert torch.allclose(average, torch.tensor([1.5, 2.0, -3.0]))  # 0.75·a + 0.25·v
    assert torch.equal(
        ema_update(torch.ones(2), torch.full((2,), 5.0, dtype=torch.bfloat16), 0.0), torch.full((2,), 5.0)
    )


def test_ema_update_names_its_bad_arguments():
    with pytest.raises(ValueError, match=r"beta: 1.0 is not a number in \[0, 1\)"):
        ema_update(torch.zeros(2), torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match=r"value: shape \(3,\) differs from average's \(2,\)"):
        ema_update(torch.zeros(2), torch.zeros(3), 0.5)
    with pytest.raises(TypeError, match=r"average: dtype torch\.int64"):
        ema_update(torch.zeros(2, dtype=torch.long), torch.zeros(2), 0.5)


class _Tied(torch.nn.Module):
    """An embedding tied to the output layer, a trainable bias and a frozen scale."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4)
        self.head.weight = self.embed.weight
        self.scale = torch.nn.Parameter(torch.ones(3), requires_grad=False)


def test_weight_ema_after_t_steps_is_the_closed_form_and_skips_frozen_parameters():
    torch.manual_seed(0)
    model, beta = _Tied(), 0.9
    history = [{name: p.detach().clone() for name, p in model.named_parameters()}]
    ema = WeightEMA(model, beta)
    assert sorted(ema.state_dict()) == ["embed.weight", "head.bias"]  # tied once, frozen left out
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))
        history.append({name: p.detach().clone() for name, p in model.named_parameters()})
        ema.update(model)
    # EMA_t = β^t θ_0 + (1 − β) Σ_{s=1..t} β^{t−s} θ_s
    for name in ("embed.weight", "head.bias"):
        expected = beta**3 * history[0][name] + sum(
            (1 - beta) * beta ** (3 - s) * history[s][name] for s in (1, 2, 3)
        )
        assert torch.allclose(ema.state_dict()[name], expected, atol=1e-6)
        assert ema.state_dict()[name].dtype == torch.float32
    assert ema.updates == 3
    assert ema.initial_weight() == pytest.approx(0.729)
    exported = ema.export_names(model)
    assert sorted(exported) == ["embed.weight", "head.bias", "head.weight"]  # the tied alias too
    assert exported["head.weight"] is exported["embed.weight"]


def test_weight_ema_state_round_trips_and_refuses_another_model():
    model = _Tied()
    ema = WeightEMA(model, 0.5)
    ema.update(model)
    restored = WeightEMA(_Tied(), 0.5)
    restored.load_state_dict(ema.state_dict(), updates=1)
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in ema.state_dict().items())
    assert restored.updates == 1
    with pytest.raises(KeyError, match=r"missing \['head\.bias'\]"):
        restored.load_state_dict({"embed.weight": torch.zeros(4, 3)}, updates=0)
    with pytest.raises(ValueError, match=r"beta: 1 is not a number in \(0, 1\)"):
        WeightEMA(model, 1)

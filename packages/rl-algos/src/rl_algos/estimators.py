"""Advantage estimators, found by name in `ADVANTAGE_ESTIMATORS`.

Every estimator returns `(advantages, returns)`, both `[batch, seq]` float32, zero where
`action_mask` is 0. Each declares, as keyword arguments, only the inputs it needs, drawn from:

  token_rewards     `[batch, seq]` per-token rewards (see `rl_algos.token_level_rewards`)
  rewards           `[batch]` scalar outcome rewards
  values            `[batch, seq]` critic values V(s_t)
  action_mask       `[batch, seq]` 1 on tokens the policy chose
  group_ids         `[batch]` integer prompt group of each sample
  baseline_rewards  `[batch]` reward of a baseline response (ReMax: the greedy response)
  all_reduce        in-place sum over data-parallel ranks, for global whitening

`compute_advantages(name, **inputs)` passes each estimator the inputs it declares and checks
the rest, so a loop can hand every estimator the same batch. Add your own with
`ADVANTAGE_ESTIMATORS.register("name")`; its keyword arguments follow the same names.

Outcome estimators broadcast one scalar advantage A_i over every action token of sample i:
A[i, t] = A_i·m[i, t]; their returns equal their advantages (there is no critic to fit).

Outcome estimators ignore `token_rewards`, so a KL in the reward cannot reach them. Their
OpenRLHF forms do take it: `group_reward_to_go` (and `flash_reinforce`) puts the centred and
scaled outcome on the last action token of the token rewards, keeps −β·KL_t on every action
token and returns the reward-to-go (see `REWARD_TO_GO_PRESETS` for OpenRLHF's names).

Groups of one. Every estimator with a group baseline (grpo, dr_grpo, rloo, opo, gpg,
reinforce_baseline, grpo_passk, group_reward_to_go) takes `singleton`, with one meaning everywhere: "zero" (the
default: the lone sample is its own baseline, A = 0), "raw" (the baseline is 0, so the
sample keeps its reward: verl's rule) or "error" (raise, naming the group).
"""

from __future__ import annotations

import inspect

import torch

from ._checks import (
    check_choice,
    check_floating,
    check_ndim,
    check_positive,
    check_rows,
    check_same_shape,
    check_shape,
    compute_dtype,
    mask_as,
)
from .group import (
    GROUP_NORM_PRESETS,
    SINGLETON_POLICIES,
    GroupStats,
    fill_singletons,
    group_normalize,
    group_stats,
)
from .masked import AllReduce, last_action_index, masked_whiten
from .registry import Registry
from .returns import compute_discounted_returns, compute_gae

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BATCH_FIELDS",
    "REWARD_TO_GO_PRESETS",
    "compute_advantages",
    "dr_grpo",
    "estimator_inputs",
    "flash_reinforce",
    "gae",
    "gpg",
    "group_reward_to_go",
    "grpo",
    "grpo_passk",
    "opo",
    "reinforce",
    "reinforce_baseline",
    "remax",
    "rloo",
]

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")

BATCH_FIELDS = (
    "token_rewards",
    "rewards",
    "values",
    "action_mask",
    "group_ids",
    "baseline_rewards",
    "all_reduce",
)
"""Inputs `compute_advantages` hands to an estimator only if the estimator declares them."""


def estimator_inputs(estimator: str) -> frozenset[str]:
    """The `BATCH_FIELDS` the estimator registered as `estimator` declares: what it needs from a
    run (`"values"`: a critic; `"baseline_rewards"`: a baseline response's reward; `"token_rewards"`:
    per-token rewards, so a KL in the reward reaches it)."""
    return frozenset(inspect.signature(ADVANTAGE_ESTIMATORS[estimator]).parameters) & frozenset(BATCH_FIELDS)


def compute_advantages(estimator: str, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as `estimator` on a batch.

    `inputs` may hold any of `BATCH_FIELDS` (an estimator receives those it declares; the others
    are ignored, so one call site serves every estimator) and options (gamma, lam, epsilon, ...),
    which must be accepted by the chosen estimator.

    Returns:
      (advantages, returns), both `[batch, seq]`.
    """
    fn = ADVANTAGE_ESTIMATORS[estimator]
    params = inspect.signature(fn).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    call = {}
    for key, value in inputs.items():
        if key in params or accepts_any:
            call[key] = value
        elif key not in BATCH_FIELDS:
            options = sorted(k for k in params if k not in BATCH_FIELDS)
            raise TypeError(
                f"advantage estimator {estimator!r} has no option {key!r}; its options are {options}"
            )
    missing = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind is p.KEYWORD_ONLY
        and (name not in call or call[name] is None)
    ]
    if missing:
        raise ValueError(f"advantage estimator {estimator!r} needs {missing}, which were not given")
    return fn(**call)


# ----------------------------------------------------------------------------- critic / returns


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(
    *,
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO with a critic: generalised advantage estimation (Schulman et al., 2016).

    δ_t = r_t + γ·V_{t+1} − V_t,  A_t = δ_t + γλ·A_{t+1},  returns = A + V,
    where t + 1 is the next action token (environment tokens are skipped). OpenRLHF's defaults
    are γ = λ = 1. With `whiten`, the advantages (not the returns, which were computed before)
    are whitened over the action tokens of the batch, `masked_whiten`'s OpenRLHF convention
    (population variance, ε = 1e-8; `all_reduce` makes it global over data-parallel ranks), as
    OpenRLHF does for GAE.
    """
    advantages, returns = compute_gae(token_rewards, values, action_mask, gamma=gamma, lam=lam)
    if whiten:
        advantages = masked_whiten(advantages, action_mask, all_reduce=all_reduce)
    dtype = compute_dtype(token_rewards, values)
    return advantages.to(dtype), returns.to(dtype)


@ADVANTAGE_ESTIMATORS.register("reinforce")
def reinforce(
    *,
    token_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    whiten: bool = True,
    unbiased: bool = False,
    epsilon: float = 1e-8,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al., 2025): discounted return, then global whitening.

    G_t = r_t + γ·G_{t+1} over action tokens;  A = (G − μ)·rsqrt(max(σ², ε)) with μ, σ² over
    every action token of the batch (of every rank, with `all_reduce`). OpenRLHF uses the
    population variance (`unbiased=False`); verl the unbiased one.

    Returns (A, G).
    """
    returns = compute_discounted_returns(token_rewards, action_mask, gamma=gamma)
    returns = returns.to(compute_dtype(returns))
    advantages = returns
    if whiten:
        advantages = masked_whiten(
            returns, action_mask, unbiased=unbiased, epsilon=epsilon, all_reduce=all_reduce
        )
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_baseline")
def reinforce_baseline(
    *,
    token_rewards: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    reward_clip: float | None = 10.0,
    gamma: float = 1.0,
    whiten: bool = True,
    unbiased: bool = False,
    epsilon: float = 1e-8,
    singleton: str = "zero",
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (OpenRLHF): centre r by its group mean, clip, then REINFORCE++.

        r̃_i = clip(r_i − mean_g(r), −c, c)       (OpenRLHF: centre first, then clip)

    `token_rewards` must be `token_level_rewards(rewards, action_mask, kl=..., reward_clip=c)`
    with the same `rewards` and the same c as `reward_clip` here (both default to 10): the
    outcome that function placed on the last action token, clip(r_i), is replaced by r̃_i; the
    KL part stays. Then discounted returns and global whitening (`reinforce`).

    Worked values, one group r = [30, 0, 0, 12], one token each, no KL, c = 10: r̃ =
    [10, −10, −10, 1.5] (the returns) and A = [1.438, −0.934, −0.934, 0.430].

    Args:
      reward_clip: c > 0, or None when neither side clips.
      singleton: see the module docstring ("raw" keeps r for a group of one: verl).
    """
    check_ndim("token_rewards", token_rewards, 2, "[batch, seq]")
    check_shape("rewards", rewards, token_rewards.shape[:1], "[batch]")
    centred = group_normalize(rewards, group_ids, centre="group", scale="none", singleton=singleton)
    shaped = _replace_outcome(token_rewards, rewards, centred, action_mask, reward_clip)
    return reinforce(
        token_rewards=shaped,
        action_mask=action_mask,
        gamma=gamma,
        whiten=whiten,
        unbiased=unbiased,
        epsilon=epsilon,
        all_reduce=all_reduce,
    )


# ------------------------------------------------------------------------- group-relative (outcome)


@ADVANTAGE_ESTIMATORS.register("grpo", aliases=("group_norm",))
def grpo(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    preset: str | None = None,
    centre: str = "group",
    scale: str = "group_std",
    unbiased: bool = True,
    epsilon: float = 1e-6,
    singleton: str = "zero",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al., 2024): A_i = (r_i − mean_g)/(std_g + ε), broadcast over tokens.

    `preset` ("verl", "trl", "openrlhf", "nemo_rl"; see `GROUP_NORM_PRESETS`) replaces the
    knobs with that framework's convention; otherwise they go to `group_normalize`. Defaults are
    verl's ε = 1e-6 and unbiased std, with a group of one giving 0 (`singleton="zero"`; verl's
    own rule is "raw", which its preset sets).
    """
    if preset is not None:
        if preset not in GROUP_NORM_PRESETS:
            raise ValueError(f"preset must be one of {sorted(GROUP_NORM_PRESETS)}, got {preset!r}")
        knobs = GROUP_NORM_PRESETS[preset]
    else:
        knobs = {
            "centre": centre,
            "scale": scale,
            "unbiased": unbiased,
            "epsilon": epsilon,
            "singleton": singleton,
        }
    scalar = group_normalize(rewards, group_ids, **knobs)
    return _broadcast(scalar, action_mask)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    singleton: str = "zero",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO (Liu et al., 2025): A_i = r_i − mean_g, no std division.

    Pair it with the `seq-mean-token-sum-norm` aggregation (a constant divisor), as in the paper.
    `singleton`: a group of one gets 0 ("zero"), r ("raw": verl) or an error.
    """
    centred = group_normalize(rewards, group_ids, centre="group", scale="none", singleton=singleton)
    return _broadcast(centred, action_mask)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    singleton: str = "zero",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al., 2024): A_i = r_i − mean_{j≠i} r_j = K/(K−1)·(r_i − mean_g).

    `singleton`: a group of one (no other member) gets 0 ("zero"), r ("raw": verl's loop form)
    or an error.
    """
    centred = group_normalize(rewards, group_ids, centre="leave_one_out", scale="none", singleton=singleton)
    return _broadcast(centred, action_mask)


@ADVANTAGE_ESTIMATORS.register("opo")
def opo(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    singleton: str = "zero",
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al., 2025): length-weighted baseline b_g = Σ_i L_i r_i / Σ_i L_i; A_i = r_i − b_g.

    L_i is the number of action tokens of sample i. With r = [1, 0, 0.5, 0] and
    L = [2, 4, 3, 1]: b = 0.35, A = [0.65, −0.35, 0.15, −0.35]. `singleton`: a group of one gets
    0 ("zero"), r ("raw": verl) or an error.
    """
    check_choice("singleton", singleton, SINGLETON_POLICIES)
    stats = group_stats(rewards, group_ids)
    mask = _check_mask_rows(action_mask, rewards)
    lengths = mask.sum(-1).to(torch.float64)
    r = rewards.to(torch.float64)
    weighted = torch.zeros(stats.num_groups, dtype=torch.float64, device=r.device)
    weighted.index_add_(0, stats.inverse, lengths * r)
    total = torch.zeros_like(weighted).index_add_(0, stats.inverse, lengths)
    baseline = weighted / total.clamp(min=1)
    advantages = fill_singletons(r - baseline[stats.inverse], r, stats, group_ids, singleton)
    return _broadcast(advantages.to(_out_dtype(rewards)), action_mask)


@ADVANTAGE_ESTIMATORS.register("gpg")
def gpg(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    singleton: str = "zero",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al., 2025): A_i = α·(r_i − mean_g), α = B / max(1, #{i : r_i ≠ 0}).

    α rescales the batch so that samples with a zero reward do not dilute the gradient. Pair it
    with the `reinforce` policy loss (no ratio), as in the paper. `singleton`: a group of one
    gets 0 ("zero"), α·r ("raw": verl, baseline 0) or an error.
    """
    centred = group_normalize(rewards, group_ids, centre="group", scale="none", singleton=singleton)
    nonzero = torch.count_nonzero(rewards).clamp(min=1)
    alpha = rewards.shape[0] / nonzero.to(centred.dtype)
    return _broadcast(alpha * centred, action_mask)


REWARD_TO_GO_PRESETS: dict[str, dict[str, object]] = {
    # (r − mean_g)/(std_g + 1e-9), unbiased std
    "group_norm": {"centre": "group", "scale": "group_std", "unbiased": True, "epsilon": 1e-9},
    # r − mean_g
    "dr_grpo": {"centre": "group", "scale": "none"},
    # r − mean of the other members of the group
    "rloo": {"centre": "leave_one_out", "scale": "none"},
    # r − mean of the whole batch (no group)
    "flash_reinforce": {"centre": "batch", "scale": "none"},
}
"""Knobs of `group_reward_to_go` (`group_normalize`'s) that give OpenRLHF 0.11.2's estimator of the
same name. OpenRLHF's `reinforce_baseline` is not among them: it whitens the returns afterwards
(rl_algos' `reinforce_baseline`)."""


@ADVANTAGE_ESTIMATORS.register("group_reward_to_go")
def group_reward_to_go(
    *,
    token_rewards: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    preset: str | None = None,
    centre: str = "group",
    scale: str = "group_std",
    unbiased: bool = True,
    epsilon: float = 1e-9,
    singleton: str = "zero",
    reward_clip: float | None = 10.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A group-normalised outcome as the last token's reward, then the undiscounted reward-to-go.

    OpenRLHF 0.11.2's `group_norm`, `rloo`, `dr_grpo` and `flash_reinforce`, KL in the reward
    included (its `compute_advantages_and_returns` and `compute_reward`):

        ã_i = clip(group_normalize(r)_i, −c, c)              (centre and scale first, then clip)
        r̃_t = −β·KL_t·m_t + [t = last action token of i]·ã_i
        A_t = G_t = Σ_{s ≥ t, m_s = 1} r̃_s                   (γ = 1, no whitening)

    `token_rewards` must be `token_level_rewards(rewards, action_mask, kl=..., kl_coef=β,
    reward_clip=c)` with the same `rewards` and c as `reward_clip` here (both default to 10): the
    outcome that function placed on the last action token, clip(r_i), is replaced by ã_i and the
    KL part stays. Without a KL every action token of sample i gets ã_i, the outcome estimator's
    value (`grpo` with `preset="openrlhf"` for `group_norm`), except that the clip comes after
    the normalisation.

    Worked values: one group r = [2, 0, 1] (mean 1, unbiased std 1), action masks [1, 1, 1],
    [1, 1, 0], [1, 0, 0], KL [[0.5, 1, 2], [1, 3, ·], [4, ·, ·]], β = 0.1, group_norm:
    ã = [1, −1, 0]; A = [[0.65, 0.7, 0.8], [−1.4, −1.3, 0], [−0.4, 0, 0]].

    Args:
      token_rewards: `[batch, seq]` per-token rewards (above).
      rewards: `[batch]` scalar outcome rewards, before clipping.
      action_mask: `[batch, seq]`; every row needs an action token.
      group_ids: `[batch]` integer prompt group; needed unless centre and scale are not group based.
      preset: a name of `REWARD_TO_GO_PRESETS` (OpenRLHF's estimator names); it replaces centre,
        scale, unbiased and epsilon. The defaults are those of "group_norm".
      centre, scale, unbiased, epsilon, singleton: the knobs of `group_normalize`.
      reward_clip: c > 0, or None when neither side clips.

    Returns:
      (A, G), equal, `[batch, seq]` float32, 0 off the action tokens.
    """
    knobs: dict[str, object] = {"centre": centre, "scale": scale, "unbiased": unbiased, "epsilon": epsilon}
    if preset is not None:
        if preset not in REWARD_TO_GO_PRESETS:
            raise ValueError(f"preset must be one of {sorted(REWARD_TO_GO_PRESETS)}, got {preset!r}")
        knobs = {**knobs, **REWARD_TO_GO_PRESETS[preset]}
    check_ndim("token_rewards", token_rewards, 2, "[batch, seq]")
    check_shape("rewards", rewards, token_rewards.shape[:1], "[batch]")
    scalar = group_normalize(rewards, group_ids, singleton=singleton, **knobs)
    shaped = _replace_outcome(token_rewards, rewards, scalar, action_mask, reward_clip)
    returns = compute_discounted_returns(shaped, action_mask, gamma=1.0)
    return returns, returns.clone()


@ADVANTAGE_ESTIMATORS.register("flash_reinforce")
def flash_reinforce(
    *,
    token_rewards: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    reward_clip: float | None = 10.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashREINFORCE (OpenRLHF 0.11.2): the batch mean as the baseline, no group, no whitening.

        ã_i = clip(r_i − mean_batch(r), −c, c), then the reward-to-go of `group_reward_to_go`

    (its preset "flash_reinforce"), for one sample per prompt. `token_rewards` as there. Worked
    values: r = [1, 0, 0, 0], one token each, no KL: A = [0.75, −0.25, −0.25, −0.25].
    """
    return group_reward_to_go(
        token_rewards=token_rewards,
        rewards=rewards,
        action_mask=action_mask,
        preset="flash_reinforce",
        reward_clip=reward_clip,
    )


@ADVANTAGE_ESTIMATORS.register("remax")
def remax(
    *, rewards: torch.Tensor, baseline_rewards: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., 2024): A_i = r_i − r(greedy response to i's prompt).

    `baseline_rewards[i]` is the reward of the greedy response to sample i's prompt.
    """
    _check_rewards_like("rewards", rewards)
    _check_rewards_like("baseline_rewards", baseline_rewards)
    check_same_shape("baseline_rewards", baseline_rewards, "rewards", rewards)
    return _broadcast((rewards.double() - baseline_rewards.double()).float(), action_mask)


@ADVANTAGE_ESTIMATORS.register("grpo_passk")
def grpo_passk(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    normalize_by_std: bool = False,
    epsilon: float = 1e-6,
    singleton: str = "zero",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k (Chen et al., 2025): only the best sample of a group is credited.

    The best member (the first one on ties) gets r_max − r_second; every other member gets 0.
    With `normalize_by_std` the credit is divided by (std_g + ε). `singleton`: a group of one
    gets 0 ("zero"), r ("raw", no second-best to subtract) or an error.
    """
    check_positive("epsilon", epsilon)
    stats = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    advantages = _best_minus_second(r, stats)
    if normalize_by_std:
        spread = stats.std(unbiased=True)
        advantages = torch.where(spread > 0, advantages / (spread + epsilon), advantages)
    advantages = fill_singletons(advantages, r, stats, group_ids, singleton)
    return _broadcast(advantages.to(_out_dtype(rewards)), action_mask)


def _best_minus_second(r: torch.Tensor, stats: GroupStats) -> torch.Tensor:
    inverse, groups = stats.inverse, stats.num_groups
    best = torch.full((groups,), -torch.inf, dtype=r.dtype, device=r.device)
    best = best.scatter_reduce(0, inverse, r, reduce="amax")
    positions = torch.arange(r.shape[0], device=r.device)
    is_max = r == best[inverse]
    # The winner is the lowest index among the members that reach the group maximum.
    sentinel = torch.full((groups,), r.shape[0], dtype=positions.dtype, device=r.device)
    winner = sentinel.scatter_reduce(0, inverse, torch.where(is_max, positions, r.shape[0]), reduce="amin")
    is_winner = positions == winner[inverse]
    second = torch.full((groups,), -torch.inf, dtype=r.dtype, device=r.device)
    second = second.scatter_reduce(0, inverse, torch.where(is_winner, -torch.inf, r), reduce="amax")
    credit = best - second  # +inf for a group of one (no second)
    return torch.where(is_winner & torch.isfinite(credit[inverse]), credit[inverse], torch.zeros_like(r))


# ----------------------------------------------------------------------------------- helpers


def _replace_outcome(
    token_rewards: torch.Tensor,
    rewards: torch.Tensor,
    shaped: torch.Tensor,
    action_mask: torch.Tensor,
    reward_clip: float | None,
) -> torch.Tensor:
    """`token_rewards` `[batch, seq]` with clip(r_i) on each row's last action token replaced by
    clip(shaped_i) (float32); c = `reward_clip` > 0, or None for no clip on either side."""
    r = rewards.to(torch.float64)
    before, after = r, shaped.to(torch.float64)
    if reward_clip is not None:
        check_positive("reward_clip", reward_clip)
        before = r.clamp(-reward_clip, reward_clip)
        after = after.clamp(-reward_clip, reward_clip)
    mask = mask_as("action_mask", action_mask, token_rewards, "token_rewards")
    last = last_action_index(mask, "action_mask")
    out = token_rewards.float().clone()
    rows = torch.arange(out.shape[0], device=out.device)
    out[rows, last] += (after - before).to(out.dtype)
    return out


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return torch.float64 if rewards.dtype == torch.float64 else torch.float32


def _check_rewards_like(name: str, value: torch.Tensor) -> None:
    check_ndim(name, value, 1, "[batch]")
    check_floating(name, value)


def _check_mask_rows(action_mask: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    check_ndim("action_mask", action_mask, 2, "[batch, seq]")
    check_rows("action_mask", action_mask, "rewards", rewards)
    return action_mask.to(torch.float32)


def _broadcast(scalar: torch.Tensor, action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = _check_mask_rows(action_mask, scalar)
    advantages = scalar.to(torch.float32)[:, None] * mask
    return advantages, advantages.clone()

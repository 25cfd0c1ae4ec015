"""Policy-gradient losses on the fused linear path (no ``[tokens, vocab]`` logits, ever).

Every quantity an RL update needs per token -- the log-probability of the sampled
token and the entropy of the distribution it was sampled from -- comes out of the
fused ``linear_cross_entropy`` (``reduction="none"`` gives ``-log p``; ``with_entropy``
the entropy), so the LM head's logits exist one tile at a time in forward *and*
backward. Everything else here works on per-token ``[T]`` tensors:

- ``ppo_clip``: the clipped surrogate of PPO (Schulman et al. 2017, "Proximal Policy
  Optimization Algorithms", eq. 7), ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``
  with ``r = exp(logp - logp_old)``; asymmetric bounds allow "clip-higher"; optional
  dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"):
  for ``A < 0`` the loss is capped at ``-A c`` (``c > 1``).
- ``grpo_advantages``: GRPO's group-normalized outcome advantages (Shao et al. 2024,
  "DeepSeekMath", sec. 4.1.2): ``(r_i - mean(r_group)) / (std(r_group) + eps)``.
- ``kl_penalty``: per-token estimators of KL(pi || pi_ref) from samples of pi
  (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):
  k1 = log(pi / pi_ref), k2 = (log ratio)^2 / 2, k3 = (pi_ref / pi) - 1 - log(pi_ref / pi)
  (unbiased and always >= 0; the one GRPO uses).
- ``aggregation_weights``: how per-token losses become one number. The weights are a
  function of the *whole* batch (mask and sequence ids), computed once before the batch
  is split into ranks and micro-batches; a micro-batch's loss is then ``sum(w * l)``
  over its tokens, and summing those shares (micro-batches, data/context-parallel
  ranks) gives exactly the full-batch loss. Modes: ``token-mean`` (every token of the
  batch weighs the same), ``seq-mean-token-mean`` (mean over sequences of each
  sequence's token mean), ``seq-mean-token-sum`` (mean over sequences of token sums).
- ``rollout_correction``: importance weights for the gap between the rollout engine's
  sampling distribution and the training engine's (numerics, or one step of asynchrony),
  on the ratio ``rho = pi_train(old) / pi_rollout`` of the batch's ``old_logprobs`` to its
  ``rollout_logprobs``: truncated IS (TIS; Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl)
  ``w = min(rho, C)``, or masked IS (MIS; verl's rollout correction,
  https://verl.readthedocs.io/en/latest/algo/rollout_corr.html) ``w = rho if rho <= C else 0``;
  per token, or per sequence with ``rho_seq = exp(sum of the sequence's token log-ratios)``
  (the product of its token ratios) given to each of its tokens. The weight is detached
  and multiplies the policy-gradient term only.

Legend: T tokens (flattened), H hidden, V vocabulary (this rank's slice), N rollouts,
G rollouts per prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bumblebee.primitives.loss import linear_cross_entropy

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence")
IGNORE = -100


# ------------------------------------------------------------------------------ per-token terms
def token_logprobs(
    hidden_TH,
    weight_VH,
    targets_T,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    vocab_group=None,
    **tiles,
):
    """(log p(target) [T] fp32, entropy [T] or None) of ``softmax(hidden @ weight^T / temperature)``,
    differentiable, through the fused linear CE. ``targets_T == -100`` marks positions
    without a target (log-prob 0 there; the entropy is computed everywhere).
    ``vocab_group``: ranks holding row slices of ``weight_VH`` (targets are global ids)."""
    out = linear_cross_entropy(
        hidden_TH,
        weight_VH,
        targets_T,
        ignore_index=IGNORE,
        reduction="none",
        with_entropy=with_entropy,
        temperature=temperature,
        vocab_group=vocab_group,
        **tiles,
    )
    nll_T, entropy_T = out if with_entropy else (out, None)
    return -nll_T, entropy_T


@torch.no_grad()
def token_logprobs_no_grad(hidden_TH, weight_VH, targets_T, **kwargs):
    """Forward-only ``token_logprobs`` (old-policy and reference log-probs): no graph is kept."""
    return token_logprobs(hidden_TH, weight_VH, targets_T, **kwargs)


def ppo_clip(
    logp_T,
    old_logp_T,
    adv_T,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
):
    """Per-token clipped surrogate loss, and where the ratio clip / the dual clip is active."""
    ratio_T = torch.exp(logp_T - old_logp_T)
    unclipped_T = -adv_T * ratio_T
    clipped_T = -adv_T * torch.clamp(ratio_T, 1.0 - clip_low, 1.0 + clip_high)
    loss_T = torch.maximum(unclipped_T, clipped_T)
    is_clipped_T = clipped_T > unclipped_T
    is_dual_T = torch.zeros_like(is_clipped_T)
    if dual_clip is not None:
        cap_T = -adv_T * dual_clip  # only binds for A < 0
        is_dual_T = (adv_T < 0) & (loss_T > cap_T)
        loss_T = torch.where(is_dual_T, cap_T, loss_T)
    return loss_T, is_clipped_T, is_dual_T


def kl_penalty(logp_T, ref_logp_T, estimator: str = "k3"):
    """Per-token estimate of KL(pi || pi_ref) at tokens sampled from pi (Schulman 2020)."""
    log_ratio_T = logp_T - ref_logp_T  # log pi / pi_ref
    if estimator == "k1":
        return log_ratio_T
    if estimator == "k2":
        return 0.5 * log_ratio_T.square()
    if estimator == "k3":
        x_T = -log_ratio_T.clamp(-20.0, 20.0)  # log pi_ref / pi; the clamp only guards exp overflow
        return torch.expm1(x_T) - x_T  # expm1: no cancellation for small log-ratios
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def grpo_advantages(rewards_N, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6):
    """Group-normalized advantages [N]; rollouts of one prompt are consecutive (groups of
    ``group_size``). ``scale_by_std=False`` only centers (the "Dr. GRPO" variant)."""
    rewards_N = torch.as_tensor(rewards_N, dtype=torch.float32)
    if rewards_N.numel() and not bool(torch.isfinite(rewards_N).all()):
        bad = torch.nonzero(~torch.isfinite(rewards_N.reshape(-1)))[:, 0].tolist()
        raise ValueError(
            f"rewards must be finite; not finite at {bad[:8]} (of {rewards_N.numel()})"
        )
    if group_size < 1 or rewards_N.numel() % group_size:
        raise ValueError(f"{rewards_N.numel()} rewards do not split into groups of {group_size}")
    r_PG = rewards_N.view(-1, group_size)
    adv_PG = r_PG - r_PG.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        adv_PG = adv_PG / (r_PG.std(dim=1, keepdim=True) + eps)
    return adv_PG.reshape(-1)


def rollout_correction(log_ratio_T, mask_T, cap: float, mode: str | None):
    """(weight [T], metric sums) for log-ratios ``log(pi_train / pi_rollout)`` (token or
    sequence level, already expanded to tokens). ``mode``: "tis" (``min(rho, cap)``), "mis"
    (``rho`` where ``rho <= cap``, else 0) or None (weight 1, metrics only). The weight is
    detached: it reweights the samples, it is not a function to differentiate."""
    lr_T = log_ratio_T.detach().float()
    log_cap = math.log(cap)
    over_T = (lr_T > log_cap) & mask_T
    # exp after the cap on the log: exact min(rho, C) with no overflow for long sequences
    capped_T = torch.exp(torch.clamp(lr_T, max=log_cap))
    if mode == "tis":
        w_T = capped_T
    elif mode == "mis":
        w_T = torch.where(over_T, 0.0, capped_T)
    elif mode is None:
        w_T = torch.ones_like(lr_T)
    else:
        raise ValueError(f"unknown rollout correction {mode!r}; valid: tis, mis")
    # rho for the metrics, its log capped at 80 so a long sequence's product stays finite in fp32
    rho_T = torch.where(mask_T, torch.exp(torch.clamp(lr_T, max=80.0)), 0.0)
    stats = {  # sums over the mask (the engine divides by the token count), "_max": a maximum
        "is_ratio_mean": rho_T.sum(),
        "is_ratio_max": rho_T.max() if rho_T.numel() else rho_T.new_zeros(()),
    }
    if mode:
        stats[f"is_{'mask' if mode == 'mis' else 'clip'}_frac"] = over_T.sum().float()
    return torch.where(mask_T, w_T, 0.0), stats


# ------------------------------------------------------------------------------ aggregation
def _sequence_lengths(m, seq_ids):
    """(masked tokens per sequence [S] fp32, each token's sequence [numel])."""
    _, inverse = torch.unique(seq_ids.reshape(-1), return_inverse=True)
    len_S = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, device=m.device)
    len_S.scatter_add_(0, inverse, m.reshape(-1))
    return len_S, inverse


def aggregation_totals(mask, seq_ids):
    """[2] fp32: masked tokens and sequences with a masked token. Summed over the parts of a
    global batch (ranks) they are the denominators of ``aggregation_weights`` for the whole."""
    m = mask.float()
    len_S, _ = _sequence_lengths(m, seq_ids)
    return torch.stack([m.sum(), (len_S > 0).sum().float()])


def aggregation_weights(mask, seq_ids, mode: str = "token-mean", totals=None):
    """Per-token weights (same shape as ``mask``) such that the aggregated loss is
    ``sum(weights * loss)``. ``seq_ids`` names each token's sequence (any integers, equal
    within a sequence); sequences without a masked token do not count. ``totals``: the
    global ``aggregation_totals`` when ``mask`` is one part of the batch (a sequence lies
    whole within one part), so the parts' weights add up to the whole batch's."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    m = mask.float()
    if mode == "token-mean":
        return m / (m.sum() if totals is None else totals[0]).clamp(min=1.0)
    len_S, inverse = _sequence_lengths(m, seq_ids)
    n_seq = (len_S > 0).sum().clamp(min=1).float() if totals is None else totals[1].clamp(min=1.0)
    if mode == "seq-mean-token-sum":
        return m / n_seq
    return m / (len_S[inverse].view_as(m).clamp(min=1.0) * n_seq)


def aggregate(values, weights):
    return (values * weights).sum()


# ------------------------------------------------------------------------------ loss functions
@dataclass
class PolicyInputs:
    """What a loss function sees for one micro-batch; every tensor has the same shape and
    refers to the same tokens (``mask``: tokens the update trains on)."""

    logprobs: torch.Tensor  # log pi_theta(token), differentiable
    entropy: torch.Tensor | None  # entropy of the distribution the token came from, differentiable
    mask: torch.Tensor  # bool
    weights: torch.Tensor  # aggregation weights (0 off the mask), see aggregation_weights
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None  # log pi_rollout(token), from the sampler
    # each token's sequence's sum of (old_logprobs - rollout_logprobs) over its trained tokens
    rollout_seq_log_ratio: torch.Tensor | None = None


@dataclass
class PolicyLoss:
    """PPO / GRPO policy loss per token: clipped surrogate + kl_coef * KL(pi || pi_ref)
    - entropy_coef * entropy, aggregated with ``agg``; with ``tis`` / ``mis`` the surrogate
    term of each token is weighted by ``rollout_correction``. Called on a micro-batch, it
    returns (its share of the loss, per-token metric sums over the mask; names ending in
    ``_max`` are maxima, reduced with max by the engine)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # e.g. 3.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    needs_entropy: bool = True  # computed for the metrics even when entropy_coef = 0
    # rollout correction (rollout_correction): at most one of tis / mis, each the cap C (> 1)
    tis: float | None = None
    mis: float | None = None
    is_level: str = "token"  # token | sequence

    def __post_init__(self):
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"PolicyLoss.{name} must be a finite number, got {value!r}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(
                f"clip_low/clip_high must be >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"agg must be one of {AGGREGATIONS}, got {self.agg!r}")
        if self.tis is not None and self.mis is not None:
            raise ValueError("set at most one of tis (truncated IS) and mis (masked IS)")
        cap = self.tis if self.tis is not None else self.mis
        if cap is not None and not cap > 1.0:  # a cap <= 1 would down-weight on-policy tokens
            raise ValueError(f"the tis / mis cap must be > 1, got {cap}")
        if self.is_level not in IS_LEVELS:
            raise ValueError(f"is_level must be one of {IS_LEVELS}, got {self.is_level!r}")

    @property
    def is_mode(self) -> str | None:
        return "tis" if self.tis is not None else "mis" if self.mis is not None else None

    def _rollout_weight(self, x: PolicyInputs):
        """(per-token IS weight or None, metric sums); metrics whenever rollout log-probs are given."""
        mode = self.is_mode
        if x.rollout_logprobs is None:
            if mode:
                raise ValueError(f"{mode} needs rollout_logprobs in the batch")
            return None, {}
        if self.is_level == "sequence":
            if x.rollout_seq_log_ratio is None:
                raise ValueError(
                    "is_level = 'sequence' needs rollout_seq_log_ratio (prediction_view derives it)"
                )
            log_ratio_T = x.rollout_seq_log_ratio
        else:
            log_ratio_T = x.old_logprobs - x.rollout_logprobs
        cap = self.tis if mode == "tis" else self.mis if mode == "mis" else 2.0
        w_T, stats = rollout_correction(log_ratio_T, x.mask, cap, mode)
        return (w_T if mode else None), stats

    def __call__(self, x: PolicyInputs):
        if x.advantages is None or x.old_logprobs is None:
            raise ValueError("PolicyLoss needs advantages and old_logprobs in the batch")
        m = x.mask
        pg_T, clipped_T, dual_T = ppo_clip(
            x.logprobs,
            x.old_logprobs,
            x.advantages,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
        )
        w_T, is_stats = self._rollout_weight(x)
        loss_T = pg_T if w_T is None else w_T * pg_T
        stats = {
            "clip_frac": (clipped_T & m).sum().float(),
            "dual_clip_frac": (dual_T & m).sum().float(),
            "approx_kl_old": (kl_penalty(x.logprobs.detach(), x.old_logprobs, "k3") * m).sum(),
            **is_stats,
        }
        if x.ref_logprobs is not None:
            kl_T = kl_penalty(x.logprobs, x.ref_logprobs, self.kl_estimator)
            stats["kl"] = (kl_T.detach() * m).sum()
            if self.kl_coef:
                loss_T = loss_T + self.kl_coef * kl_T
        elif self.kl_coef:
            raise ValueError("kl_coef > 0 needs ref_logprobs in the batch")
        if x.entropy is not None:
            stats["entropy"] = (x.entropy.detach() * m).sum()
            if self.entropy_coef:
                loss_T = loss_T - self.entropy_coef * x.entropy
        elif self.entropy_coef:
            raise ValueError("entropy_coef > 0 needs the entropy (needs_entropy = True)")
        return aggregate(torch.where(m, loss_T, 0.0), x.weights), stats


@dataclass
class TokenNLL:
    """Supervised loss: -log p of the masked tokens (SFT, the warm-up before RL)."""

    agg: str = "token-mean"
    needs_entropy: bool = False

    def __call__(self, x: PolicyInputs):
        return aggregate(-x.logprobs, x.weights), {}


def call_loss(loss_fn, x: PolicyInputs, seen: list) -> tuple[torch.Tensor, dict]:
    """``loss_fn(x)``, checked: a (0-d loss tensor, {name: tensor}) pair whose metric names are
    those of the earlier calls of the same step (``seen``, appended to): a renamed metric would
    otherwise come out as a mean over only some micro-batches."""
    out = loss_fn(x)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"loss_fn must return (loss, metrics), got {type(out).__name__}")
    loss, stats = out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        what = (
            f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        )
        raise TypeError(f"loss_fn's loss must be a 0-d tensor (to differentiate), got {what}")
    if not isinstance(stats, dict) or not all(isinstance(v, torch.Tensor) for v in stats.values()):
        raise TypeError("loss_fn's metrics must be a dict of name -> tensor (sums over the tokens)")
    names = frozenset(stats)
    if seen and names != seen[0]:
        raise ValueError(
            f"loss_fn returned metrics {sorted(names)} for micro-batch {len(seen)} but "
            f"{sorted(seen[0])} for micro-batch 0: return the same names on every call"
        )
    seen.append(names)
    return loss, stats


def fused_policy_loss(
    hidden_TH,
    weight_VH,
    targets_T,
    loss_fn,
    *,
    weights_T,
    advantages_T=None,
    old_logprobs_T=None,
    ref_logprobs_T=None,
    rollout_logprobs_T=None,
    rollout_seq_log_ratio_T=None,
    temperature: float = 1.0,
    vocab_group=None,
    **tiles,
):
    """Hidden states + LM head -> (loss, metric sums, logp_T, entropy_T) in one call, the
    logits never materialized. ``targets_T``: next-token ids, -100 where nothing is trained."""
    logp_T, entropy_T = token_logprobs(
        hidden_TH,
        weight_VH,
        targets_T,
        temperature=temperature,
        with_entropy=loss_fn.needs_entropy,
        vocab_group=vocab_group,
        **tiles,
    )
    x = PolicyInputs(
        logp_T,
        entropy_T,
        targets_T != IGNORE,
        weights_T,
        advantages_T,
        old_logprobs_T,
        ref_logprobs_T,
        rollout_logprobs_T,
        rollout_seq_log_ratio_T,
    )
    loss, stats = call_loss(loss_fn, x, [])
    return loss, stats, logp_T, entropy_T
